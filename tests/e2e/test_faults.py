"""Faults injected through whole runs (source to shards), each compared with an undisturbed run of the
same inputs and seed: the object store answering 503 SlowDown / 500, resetting connections and
stalling; a Ray worker killed (SIGKILL) in the first task of every group of tasks of every stage;
the run folder's disk filling up mid-run, then freed. Each must end with byte-identical shards, or
with one clear line and a resume that ends identical: nothing lost."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, CountingProxy, bucket_keys, capline, moto_s3, eval_index_cache

pytestmark = pytest.mark.slow

BUCKET = "capline-faults"
ARGS = ["--set", "source.num_samples=160", "--set", "source.eval_size=20", "--set", "stages.ingest.samples_per_shard=40",
        "--set", "stages.shard.samples_per_shard=60", "--set", "stages.clip_score.bootstrap.steps=20",
        "--set", "stages.tokenizer.vocab_size=300", "--set", "track_data=false",
        "--set", f"stages.dedup.cache_dir={eval_index_cache()}", "--until", "shard"]


def _shards_local(run_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((run_dir / "shard" / "shards").glob("*.tar"))}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    proc = capline("run", "--run-dir", str(run_dir), *ARGS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shards = _shards_local(run_dir)
    assert len(shards) >= 2
    return shards


@pytest.fixture(scope="module")
def s3():
    yield from moto_s3(BUCKET)


def test_workers_killed_and_object_store_faults_through_a_whole_run_change_nothing(undisturbed, s3, tmp_path):
    """Both at once (each run of the pipeline costs a minute of CI): the run folder in a bucket behind
    a proxy that answers 5 % of requests with 503 SlowDown, 500, a reset or a stall, and a Ray
    worker SIGKILLed in the first task of every group of tasks of every stage (failpoints)."""
    env, client = s3
    moto = env["AWS_ENDPOINT_URL"].rsplit(":", 1)
    proxy = CountingProxy((moto[0].split("//")[1], int(moto[1])), latency=0.0, faults=0.05, seed=7, stall=1.0).start()
    points = tmp_path / "failpoints"
    points.mkdir()
    try:
        uri = f"s3://{BUCKET}/faulty"
        proc = capline("run", "--run-dir", uri, *ARGS, timeout=1200,
                       env={**env, "AWS_ENDPOINT_URL": proxy.endpoint, "CAPLINE_CACHE": str(tmp_path / "cache"),
                            "CAPLINE_FAILPOINTS": str(points)})
        print("faults injected:", proxy.injected, "of", len(proxy.entries), "requests")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert sum(proxy.injected.values()) >= 20 and set(proxy.injected) == {"503", "500", "reset", "stall"}
    finally:
        proxy.shutdown()
    killed = sorted(p.read_text().strip() for p in points.iterdir())
    print("workers killed in:", killed)
    stages = {k.split(":")[0].split()[0] for k in killed}
    assert {"ingest", "dedup", "basic", "language", "clip_score", "tokenizer", "shard"} <= stages, stages
    keys = sorted(k for k in bucket_keys(client, BUCKET, "faulty/shard/shards/") if k.endswith(".tar"))
    got = {Path(k).name: hashlib.sha256(client.get_object(Bucket=BUCKET, Key=k)["Body"].read()).hexdigest() for k in keys}
    assert got == undisturbed


FILL = r"""
set -u
mount -t tmpfs -o size={small}m capline-fault-tmpfs {mnt}
{py} -m pipeline.cli run --run-dir {mnt}/run {args} > {out}/first.log 2>&1
echo $? > {out}/first.rc
mount -o remount,size=400m {mnt}
{py} -m pipeline.cli run --run-dir {mnt}/run {args} > {out}/second.log 2>&1
echo $? > {out}/second.rc
cp -r {mnt}/run/shard/shards {out}/shards 2>/dev/null || true
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (unshare --mount)")
def test_a_run_folder_that_fills_up_stops_clearly_and_resumes_identical(undisturbed, tmp_path):
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    args = " ".join(f"'{a}'" for a in ARGS)
    script = FILL.format(small=9, mnt=mnt, py=sys.executable, args=args, out=out)
    subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script], cwd=ROOT,
                   env={**os.environ}, timeout=1500, check=True)
    first = (out / "first.log").read_text()
    assert (out / "first.rc").read_text().strip() == "2", first[-3000:]
    errors = [ln for ln in first.splitlines() if ln.startswith("capline: error:")]
    assert len(errors) == 1 and "no space left" in errors[0] and "rerun the same command to resume" in errors[0], first[-3000:]
    assert "Traceback" not in first
    second = (out / "second.log").read_text()
    assert (out / "second.rc").read_text().strip() == "0", second[-3000:]
    assert "done before with the same input, skipped" in second          # resumed, not restarted
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "shards").glob("*.tar"))}
    assert got == undisturbed
    print("stages finished before the disk filled:", [ln for ln in second.splitlines() if "skipped" in ln])
