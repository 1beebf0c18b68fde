"""A run folder in a bucket (moto's real server on loopback): the working copy synced by checksums,
hostile object keys refused, the run lock in the bucket (conditional puts), and a local lock whose
stale takeover is atomic. No Ray: the stages here write from the driver."""
import json
import multiprocessing
import os
import time

import pyarrow as pa
import pytest

from helpers import bucket_keys, capline, moto_s3
from pipeline.config import load_config
from pipeline.lock import BucketLock, _take_local, run_lock
from pipeline.runner import output_digest, run_pipeline
from pipeline.storage import RunStore
from stages.base import KEPT, Stage, StageResult
from stages.dataplane import write_part
from infra.errors import UserError

BUCKET = "capline-sync"


@pytest.fixture(scope="module")
def s3_env():
    yield from moto_s3(BUCKET)


@pytest.fixture
def s3(s3_env, monkeypatch, tmp_path):
    env, client = s3_env
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CAPLINE_CACHE", str(tmp_path / "cache"))
    return client


class Numbers(Stage):
    """num_samples keys in partitions of 4, plus a file the driver writes (as the demo's site is)."""
    name = "numbers"

    def section(self, config):
        return {"n": config.source.num_samples}

    def run(self, ctx):
        n = ctx.cfg["n"]
        parts = []
        for i in range(0, n, 4):
            keys = [f"k{j:04d}" for j in range(i, min(n, i + 4))]
            t = pa.table({"key": keys, "verdict": [KEPT] * len(keys), "reason": [""] * len(keys)})
            parts.append(write_part(ctx.storage, "numbers", f"p{i // 4}", None, keys, t))
        (ctx.stage_dir / "site").mkdir(parents=True, exist_ok=True)
        (ctx.stage_dir / "site" / "index.txt").write_text(f"{n} numbers\n")
        return StageResult(parts)


def _run(store, n):
    cfg = load_config(None, [f"source.num_samples={n}", "track_data=false"])
    return run_pipeline(cfg, store.local, log=lambda m: None, stages=[Numbers()], observers=[], store=store)


def test_workers_write_the_bucket_and_a_rerun_leaves_nothing_stale(s3, tmp_path):
    store = RunStore(f"s3://{BUCKET}/sync/a")
    _run(store, 10)
    keys = set(bucket_keys(s3, BUCKET, "sync/a/"))
    assert {f"sync/a/numbers/ledger/p{i}.parquet" for i in range(3)} <= keys
    assert {"sync/a/numbers/site/index.txt", "sync/a/numbers/_SUCCESS", "sync/a/manifest.json"} <= keys
    # partitions went to the bucket, not into the working copy; the driver's own file is in both
    assert not (store.local / "numbers" / "ledger").exists()
    marker = json.loads(s3.get_object(Bucket=BUCKET, Key="sync/a/numbers/_SUCCESS")["Body"].read())
    assert marker["driver_files"] == ["numbers/site/index.txt"]
    assert set(marker["files"]) == {"numbers/site/index.txt"} | {f"numbers/ledger/p{i}.parquet" for i in range(3)}

    _run(store, 4)           # another input: one partition now, the others must not linger
    keys = set(bucket_keys(s3, BUCKET, "sync/a/"))
    assert "sync/a/numbers/ledger/p0.parquet" in keys
    assert not {"sync/a/numbers/ledger/p1.parquet", "sync/a/numbers/ledger/p2.parquet"} & keys
    assert s3.get_object(Bucket=BUCKET, Key="sync/a/numbers/site/index.txt")["Body"].read() == b"4 numbers\n"


def test_pull_compares_checksums_and_checks_the_digest(s3, tmp_path):
    store = RunStore(f"s3://{BUCKET}/sync/b")
    _run(store, 8)
    other = tmp_path / "other"                # another machine's working copy
    os.environ["CAPLINE_CACHE"] = str(other)
    fresh = RunStore(f"s3://{BUCKET}/sync/b")
    assert fresh.pull(log=lambda m: None) > 0
    site = fresh.local / "numbers" / "site" / "index.txt"
    assert site.read_text() == "8 numbers\n"
    # a stale _SUCCESS and a changed file of the same size: replaced, found by checksum, not by size
    success = fresh.local / "numbers" / "_SUCCESS"
    real = success.read_bytes()
    success.write_bytes(real.replace(b'"input_digest": "', b'"input_digest": "0')[:len(real)])
    site.write_text("9 numbers\n")
    said = []
    fresh.pull(log=said.append)
    assert success.read_bytes() == real and site.read_text() == "8 numbers\n"
    assert said == ["storage: fetched 2 files of 1 finished stages from s3://capline-sync/sync/b"]
    assert fresh.pull(log=lambda m: None) == 0      # nothing differs: nothing is fetched

    # the bucket's copy rewritten after its _SUCCESS: the pull says which stage is inconsistent
    s3.put_object(Bucket=BUCKET, Key="sync/b/numbers/site/index.txt", Body=b"tampered\n")
    site.unlink()
    with pytest.raises(UserError, match="does not match the sha256 its stage's _SUCCESS recorded"):
        RunStore(f"s3://{BUCKET}/sync/b").pull(log=lambda m: None)
    # a _SUCCESS whose digest does not cover its parts.json
    marker = json.loads(real)
    marker["output_digest"] = output_digest([], {})
    marker["driver_files"] = []
    s3.put_object(Bucket=BUCKET, Key="sync/b/numbers/_SUCCESS", Body=json.dumps(marker).encode())
    with pytest.raises(UserError, match="numbers: its _SUCCESS does not match its parts.json"):
        RunStore(f"s3://{BUCKET}/sync/b").pull(log=lambda m: None)


def test_pull_refuses_keys_outside_the_working_copy(s3, tmp_path):
    store = RunStore(f"s3://{BUCKET}/sync/c")
    _run(store, 4)
    marker = json.loads(s3.get_object(Bucket=BUCKET, Key="sync/c/numbers/_SUCCESS")["Body"].read())
    marker["driver_files"] = ["numbers/../../../../escaped.txt"]
    s3.put_object(Bucket=BUCKET, Key="sync/c/numbers/_SUCCESS", Body=json.dumps(marker).encode())
    os.environ["CAPLINE_CACHE"] = str(tmp_path / "elsewhere" / "cache")
    fresh = RunStore(f"s3://{BUCKET}/sync/c")
    with pytest.raises(UserError, match=r"object key 'numbers/\.\./\.\./\.\./\.\./escaped.txt' would be written "
                                        "outside the working copy"):
        fresh.pull(log=lambda m: None)
    assert not any(p.name == "escaped.txt" for p in tmp_path.rglob("*"))


def test_second_driver_on_one_s3_run_folder_is_refused_naming_the_holder(s3, s3_env, tmp_path):
    uri = f"s3://{BUCKET}/sync/locked"
    with run_lock(tmp_path / "wc", uri=uri):
        assert "sync/locked/.capline.lock" in bucket_keys(s3, BUCKET, "sync/locked/")
        env = {**s3_env[0], "CAPLINE_CACHE": str(tmp_path / "machine-b"), "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}
        out = capline("run", "--run-dir", uri, "--set", "source.num_samples=50", env=env)
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"{uri} is in use by another capline run (pid {os.getpid()} on" in out.stderr
        assert "ray:" not in out.stdout and "Traceback" not in out.stderr
    assert "sync/locked/.capline.lock" not in bucket_keys(s3, BUCKET, "sync/locked/")   # released


def test_a_stale_bucket_lock_is_taken_over_by_exactly_one(s3, tmp_path):
    import threading

    uri = f"s3://{BUCKET}/sync/stale"
    gone = {"host": "node-that-died", "pid": 4242, "pid_started": 0, "since": 0, "heartbeat": time.time() - 3600}
    s3.put_object(Bucket=BUCKET, Key="sync/stale/.capline.lock", Body=json.dumps(gone).encode())
    said, results = [], []

    def take(i):
        try:
            BucketLock(uri).take({**gone, "host": "here", "pid": os.getpid(), "pid_started": _started(),
                                  "heartbeat": time.time(), "who": i}, said.append)
            results.append(("took", i))
        except UserError as err:
            results.append(("refused", str(err)))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = [r for r in results if r[0] == "took"]
    assert len(took) == 1, results
    assert said == ["lock: taking over a stale lock of pid 4242 on node-that-died (its heartbeat stopped)"]
    holder = json.loads(s3.get_object(Bucket=BUCKET, Key="sync/stale/.capline.lock")["Body"].read())
    assert holder["who"] == took[0][1]
    assert all("in use by another capline run" in r[1] for r in results if r[0] == "refused")


def _started() -> float:
    import psutil

    return psutil.Process().create_time()


def _taker(path, q):
    from pipeline.lock import _holder

    try:
        _take_local(path, _holder(), lambda m: None)
        q.put(("took", os.getpid()))
        time.sleep(0.6)      # hold it while the others try (they started together)
    except UserError as err:
        q.put(("refused", str(err)))


def test_a_stale_local_lock_is_taken_over_by_exactly_one(tmp_path):
    path = tmp_path / ".capline.lock"
    dead = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    path.write_text(json.dumps({"host": os.uname().nodename, "pid": dead.pid, "pid_started": 0, "since": 0,
                                "heartbeat": 0}))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_taker, args=(path, q)) for _ in range(6)]
    for p in procs:
        p.start()
    results = [q.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    took = [r for r in results if r[0] == "took"]
    assert len(took) == 1, results
    assert all("is in use by another capline run" in r[1] for r in results if r[0] == "refused"), results
