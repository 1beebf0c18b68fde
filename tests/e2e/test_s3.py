"""Run folders in object storage, against a local S3-compatible server (moto's server mode, with
IAM checks on): a missing bucket, wrong credentials and no tracking server are refused before any
work. A run folder in S3 resumed after a kill on a "new machine" (an empty working copy), training
reading its shards from there, credentials written nowhere and status/explain reading in place: the
two-node test (tests/e2e/test_cluster.py), which does all of it on a cluster that shares no disk."""

import pytest

from helpers import capline, moto_s3, eval_index_cache

pytestmark = pytest.mark.slow
BUCKET = "capline-runs"
ARGS = ["--set", "source.num_samples=300", "--set", "source.eval_size=30", "--set", "stages.ingest.samples_per_shard=60",
        "--set", "stages.shard.samples_per_shard=100", "--set", "stages.clip_score.bootstrap.steps=30",
        "--set", f"stages.dedup.cache_dir={eval_index_cache()}",
        "--set", "train.steps=20", "--set", "train.checkpoint_every=10", "--set", "train.sample_every=10",
        "--until", "train"]


@pytest.fixture(scope="module")
def s3():
    yield from moto_s3(BUCKET)


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
