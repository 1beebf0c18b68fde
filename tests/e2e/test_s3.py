"""Run folders in object storage, against a local S3-compatible server (moto's server mode, with
IAM checks on): the demo writes its run folder there, resumes there after a kill (on a "new machine":
an empty working copy), training reads its shards from there, and the credentials appear nowhere."""
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from helpers import ROOT, CountingProxy, bucket_keys, capline, kill_driver, moto_s3

pytestmark = pytest.mark.slow
BUCKET = "capline-runs"
ARGS = ["--set", "source.num_samples=300", "--set", "source.eval_size=30", "--set", "stages.ingest.samples_per_shard=60",
        "--set", "stages.shard.samples_per_shard=100", "--set", "stages.clip_score.bootstrap.steps=30",
        "--set", f"stages.dedup.cache_dir={tempfile.mkdtemp(prefix='capline-eval-index-')}",
        "--set", "train.steps=20", "--set", "train.checkpoint_every=10", "--set", "train.sample_every=10",
        "--until", "train"]


@pytest.fixture(scope="module")
def s3():
    yield from moto_s3(BUCKET)


def _keys(client, prefix):
    return bucket_keys(client, BUCKET, prefix)


def test_missing_bucket_and_wrong_credentials(s3, tmp_path):
    env, _ = s3
    env = {**env, "CAPLINE_CACHE": str(tmp_path / "cache")}
    proc = capline("run", "--run-dir", "s3://no-such-bucket/runs/x", *ARGS, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "the bucket no-such-bucket does not exist" in proc.stderr
    proc = capline("run", "--run-dir", f"s3://{BUCKET}/runs/x", *ARGS, env={**env, "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "refused the credentials" in proc.stderr
    assert "ray:" not in proc.stdout          # refused before any work


def test_without_a_tracking_server_it_says_so_before_any_work(s3, tmp_path):
    env, _ = s3
    env = {**env, "CAPLINE_CACHE": str(tmp_path / "cache")}
    proc = capline("run", "--run-dir", f"s3://{BUCKET}/runs/untracked", *ARGS, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "set MLFLOW_TRACKING_URI" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "ray:" not in proc.stdout


def test_run_folder_in_s3_resumes_after_a_kill_elsewhere(s3, tmp_path):
    env, client = s3
    # one machine here, so a SQLite store both "machines" reach stands in for a tracking server
    env = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    uri = f"s3://{BUCKET}/runs/demo"
    machine_a = {**env, "CAPLINE_CACHE": str(tmp_path / "machine-a")}
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--run-dir", uri, *ARGS]
    log_a = open(tmp_path / "a.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_a, stderr=subprocess.STDOUT, env={**os.environ, **machine_a})
    deadline = time.time() + 600
    while "runs/demo/dedup/_SUCCESS" not in _keys(client, "runs/demo/dedup/"):
        assert proc.poll() is None, (tmp_path / "a.log").read_text()[-3000:]
        assert time.time() < deadline, "dedup never finished"
        time.sleep(0.5)
    kill_driver(proc)                            # killed after dedup, somewhere in the filters
    assert "runs/demo/train/_SUCCESS" not in _keys(client, "runs/demo/train/")

    machine_b = {**env, "CAPLINE_CACHE": str(tmp_path / "machine-b")}     # an empty working copy
    again = capline("run", "--run-dir", uri, *ARGS, env=machine_b, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    out = again.stdout
    assert "storage: fetched" in out
    for stage in ("source", "ingest", "dedup"):
        assert f"{stage}: done before with the same input, skipped" in out, stage
    assert f"train: workers read the 3 shards from {uri}/shard/shards" in out or \
        f"shards from {uri}/shard/shards" in out
    keys = set(_keys(client, "runs/demo/"))
    for stage in ("source", "ingest", "dedup", "basic", "language", "clip_score", "tokenizer", "shard", "train"):
        assert f"runs/demo/{stage}/_SUCCESS" in keys, stage
    assert {"runs/demo/manifest.json", "runs/demo/report.html"} <= keys
    assert any(k.startswith("runs/demo/shard/shards/") and k.endswith(".tar") for k in keys)
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key="runs/demo/manifest.json")["Body"].read())
    assert manifest["stages"]["train"]["output_digest"]

    # the credentials were never written: not in logs, working copies or the bucket
    secret, key_id = env["AWS_SECRET_ACCESS_KEY"].encode(), env["AWS_ACCESS_KEY_ID"].encode()
    texts = [(tmp_path / "a.log").read_bytes(), again.stdout.encode(), again.stderr.encode()]
    texts += [p.read_bytes() for root in ("machine-a", "machine-b") for p in (tmp_path / root).rglob("*") if p.is_file()]
    texts += [client.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys]
    assert not any(secret in t or key_id in t for t in texts)


def test_status_and_explain_on_s3_read_summaries_and_rows_not_tars(s3, tmp_path):
    """On the run the test above left in the bucket: `capline status` reads each stage's control files
    in place, `explain` one sample's rows; neither downloads a tar (nor, for status, any ledger)."""
    env, client = s3
    if "runs/demo/shard/_SUCCESS" not in _keys(client, "runs/demo/shard/"):
        pytest.skip("needs the finished run of test_run_folder_in_s3_resumes_after_a_kill_elsewhere")
    proxy = CountingProxy(("127.0.0.1", int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])), 0).start()
    try:
        fresh = {**env, "AWS_ENDPOINT_URL": proxy.endpoint, "CAPLINE_CACHE": str(tmp_path / "new-machine")}
        status = capline("status", f"s3://{BUCKET}/runs/demo", "--json", env=fresh)
        assert status.returncode == 0, status.stderr
        rows = {r["stage"]: r for r in json.loads(status.stdout)}
        assert rows["shard"]["state"] == "done" and rows["shard"]["kept"] > 0
        assert not proxy.gets(".tar") and not proxy.gets(".parquet"), proxy.gets()
        assert len(proxy.gets()) <= 4 * len(rows), len(proxy.gets())      # a few small objects per stage
        key = next(k for k in _keys(client, "runs/demo/shard/index/") if k.endswith(".parquet"))
        import pyarrow.parquet as pq
        import io

        sample = pq.read_table(io.BytesIO(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())).column("key")[0].as_py()
        explain = capline("explain", f"s3://{BUCKET}/runs/demo", sample, env=fresh)
        assert explain.returncode == 0 and "shard" in explain.stdout, explain.stderr
        assert not proxy.gets(".tar"), proxy.gets(".tar")
        assert not (tmp_path / "new-machine").exists() or not list((tmp_path / "new-machine").rglob("*.tar"))
    finally:
        proxy.shutdown()
