"""A run folder in a bucket (moto's real server on loopback): the working copy synced by checksums,
hostile object keys refused, the run lock in the bucket (conditional puts), and a local lock whose
stale takeover is atomic. No Ray: the stages here write from the driver."""
import json
import os

import pyarrow as pa
import pytest

from helpers import bucket_keys, capline, moto_s3
from pipeline.config import load_config
from pipeline.lock import run_lock
from pipeline.runner import output_digest, run_pipeline
from pipeline.storage import RunStore
from stages.base import KEPT, Stage, StageResult
from stages.dataplane import write_part
from infra.errors import UserError

pytestmark = pytest.mark.slow   # a moto server / capline processes per test: not in the fast set

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


@pytest.mark.parametrize("key", ["", ".", "numbers/..", "numbers/./x", "numbers//x", "/etc/x", "numbers\\..\\x"])
def test_keys_naming_the_working_copy_itself_are_refused(s3, key):
    with pytest.raises(UserError, match="would be written outside the working copy"):
        RunStore(f"s3://{BUCKET}/sync/d")._inside(key)


def test_pull_keeps_the_success_marker_it_validated(s3, tmp_path, monkeypatch):
    """A writer replaces _SUCCESS while another machine pulls: the copy kept is the one checked
    against parts.json, not a second download of whatever is there by then."""
    from infra.storage import Storage

    store = RunStore(f"s3://{BUCKET}/sync/e")
    _run(store, 8)
    validated = s3.get_object(Bucket=BUCKET, Key="sync/e/numbers/_SUCCESS")["Body"].read()
    read = Storage.read_bytes

    def racing_read(self, rel):
        data = read(self, rel)
        if rel == "numbers/_SUCCESS":
            s3.put_object(Bucket=BUCKET, Key="sync/e/numbers/_SUCCESS", Body=b'{"swapped": true}')
        return data

    monkeypatch.setattr(Storage, "read_bytes", racing_read)
    monkeypatch.setenv("CAPLINE_CACHE", str(tmp_path / "machine-b"))
    fresh = RunStore(f"s3://{BUCKET}/sync/e")
    fresh.pull(log=lambda m: None)
    assert (fresh.local / "numbers" / "_SUCCESS").read_bytes() == validated


def test_a_list_file_is_pinned_in_the_bucket_once_by_its_content(s3, tmp_path):
    """The source stage's list files travel through an object-store run folder named by content:
    an unchanged file is not uploaded again on the next run, a changed one is, and the copy of a
    file no longer listed is deleted."""
    from infra.storage import Storage
    from stages.source.stage import INPUT, pin_inputs

    storage = Storage.from_uri(f"s3://{BUCKET}/pins")
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("url,caption\nhttp://x/1.jpg,one\n")
    b.write_text("url,caption\nhttp://x/2.jpg,two\n")
    uploads = []
    real = storage.write_file
    storage.write_file = lambda rel, local: uploads.append(rel) or real(rel, local)
    first = pin_inputs(storage, [a, b])
    assert [r.rsplit("-", 1)[1] for r in first] == ["a.csv", "b.csv"] and uploads == first
    assert pin_inputs(storage, [a, b]) == first and uploads == first      # nothing uploaded again
    b.write_text("url,caption\nhttp://x/3.jpg,three\n")
    second = pin_inputs(storage, [a, b])
    assert second[0] == first[0] and second[1] != first[1] and uploads == first + [second[1]]
    assert sorted(bucket_keys(s3, BUCKET, f"pins/{INPUT}/")) == sorted(f"pins/{r}" for r in second)
    assert Storage.local(tmp_path / "run").is_local and pin_inputs(Storage.local(tmp_path / "run"), [a]) == [None]


def test_a_model_folder_fetched_from_the_bucket_is_removed_when_the_process_ends(tmp_path):
    """Storage.local_dir's per-process copy of a folder in the bucket (a scorer, a checkpoint, for
    libraries that want a path) is fetched once and removed at exit: one was left in /tmp per worker."""
    import subprocess
    import sys

    from infra.storage import Storage

    Storage.local(tmp_path).write_bytes("model/weights.bin", b"w" * 10)
    code = ("import sys; from infra.storage import Storage, _fetched; "
            f"p = _fetched(Storage.local({str(tmp_path)!r}), 'model'); assert _fetched(Storage.local({str(tmp_path)!r}), 'model') == p; "
            "print(p); assert (p / 'weights.bin').read_bytes() == b'w' * 10")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    fetched = out.stdout.strip()
    assert "capline-fetch-" in fetched and not os.path.exists(fetched)
