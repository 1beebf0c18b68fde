"""The run-folder lock: one holder, created with its content, staleness by a heartbeat that does not
move on this host's clock, a holder that loses it stops, only the holder releases. Local files here;
the bucket's conditional puts on moto's real server."""
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from helpers import moto_s3
from infra.errors import UserError
from pipeline import lock as lockmod
from pipeline.lock import BucketLock, LocalLockFile, _holder, run_lock, take

BUCKET = "capline-lock"


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(lockmod, "HEARTBEAT", 0.1)
    monkeypatch.setattr(lockmod, "STALE_AFTER", 0.8)
    monkeypatch.setattr(lockmod, "POLL", 0.05)


def _beating(path, info, stop, every=0.1):
    """Another host's live holder: rewrites its lock (heartbeat counter moving) until stopped, by an
    atomic replace as a real holder does: a plain rewrite is empty for a moment, which reads as a holder
    that wrote no details."""
    tmp = path.with_name(path.name + ".beat")
    while not stop.wait(every):
        info["beat"] += 1
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)


def test_a_live_holder_is_refused_and_only_it_releases(tmp_path):
    with run_lock(tmp_path):
        with pytest.raises(UserError, match=f"in use by another capline run \\(pid {os.getpid()} on"):
            with run_lock(tmp_path):
                pass
        assert (tmp_path / ".capline.lock").exists()   # the refused run did not remove it
    assert not (tmp_path / ".capline.lock").exists()
    assert not list(tmp_path.iterdir())                # no temporary files left behind


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(dead.pid).create_time() if psutil.pid_exists(dead.pid) else time.time()
    dead.wait()
    lock = tmp_path / ".capline.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "pid_started": started}))
    said = []
    t0 = time.monotonic()
    with run_lock(tmp_path, log=said.append):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert time.monotonic() - t0 < lockmod.STALE_AFTER          # no watching: the pid says it all
    assert said == [f"lock: taking over a stale lock of pid {dead.pid} on {socket.gethostname()} (no longer running)"]


def test_a_live_holder_whose_clock_is_behind_is_not_taken_over(tmp_path):
    # its wall clock 200 s behind ours: every heartbeat time it writes looks old, but it moves
    lock = tmp_path / ".capline.lock"
    info = {"host": "elsewhere", "pid": 7, "since": time.time() - 200, "beat": 0, "heartbeat": time.time() - 200}
    lock.write_text(json.dumps(info))
    stop = threading.Event()
    beater = threading.Thread(target=_beating, args=(lock, info, stop))
    beater.start()
    try:
        with pytest.raises(UserError, match="in use by another capline run \\(pid 7 on elsewhere"):
            with run_lock(tmp_path):
                pass
    finally:
        stop.set()
        beater.join()
    # it stopped beating: after STALE_AFTER on our clock it is stale, whatever its times say
    info["heartbeat"] = time.time() + 3600
    lock.write_text(json.dumps(info))
    said = []
    with run_lock(tmp_path, log=said.append):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert said[-1] == "lock: taking over a stale lock of pid 7 on elsewhere (its heartbeat did not move for 1 s)"


def test_an_unreadable_lock_is_watched_not_taken_at_once(tmp_path):
    # an empty lock (a holder between creating and writing, as locks were made before) that then
    # gets its content: the second run must refuse, not take it as stale
    lock = tmp_path / ".capline.lock"
    lock.write_text("")
    filler = threading.Timer(0.2, lambda: lock.write_text(json.dumps({"host": "h2", "pid": 9, "since": 0})))
    filler.start()
    with pytest.raises(UserError, match="pid 9 on h2"):
        with run_lock(tmp_path):
            pass
    filler.join()


def _taker(path, q):
    try:
        take(LocalLockFile(path), _holder(), lambda m: None)
        q.put(("took", os.getpid()))
        time.sleep(1.5)      # hold it while the others try (they started together)
    except UserError as err:
        q.put(("refused", str(err)))


@pytest.mark.slow   # starts Ray, a moto server or capline processes: not in the fast set
def test_racing_runs_one_takes_and_the_lock_is_never_seen_empty(tmp_path):
    path = tmp_path / ".capline.lock"
    dead = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "pid_started": 0}))
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            try:
                seen.append(path.read_bytes())
            except FileNotFoundError:
                pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_taker, args=(path, q)) for _ in range(6)]
    for p in procs:
        p.start()
    results = [q.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    stop.set()
    watcher.join()
    took = [r for r in results if r[0] == "took"]
    assert len(took) == 1, results
    assert all("is in use by another capline run" in r[1] for r in results if r[0] == "refused"), results
    assert seen and all(json.loads(raw)["pid"] for raw in seen)   # every read parsed: never empty


def test_a_run_that_loses_its_lock_stops_and_leaves_the_new_holders(tmp_path):
    lock = tmp_path / ".capline.lock"
    said = []
    from infra.storage import Storage

    storage = Storage.local(tmp_path / "data")
    t0 = time.monotonic()
    with pytest.raises(UserError, match="the lock was taken by pid 4242 on usurper, so this run stopped writing"):
        with run_lock(tmp_path, log=said.append):
            lock.write_text(json.dumps({"host": "usurper", "pid": 4242}))
            while time.monotonic() - t0 < 30:    # a run writing: stopped by the heartbeat thread within a beat
                storage.write_bytes("part.bin", b"x")
                time.sleep(0.02)
    assert time.monotonic() - t0 < 5
    storage.write_bytes("after.bin", b"x")                 # released: this process may write again
    assert json.loads(lock.read_text())["pid"] == 4242      # not ours to release
    assert "this run stops writing" in said[-1]
    lock.unlink()
    with pytest.raises(UserError, match="the lock was removed by someone else"):
        with run_lock(tmp_path):
            lock.unlink()
            time.sleep(30)


def test_a_gs_run_folder_is_refused_not_locked_elsewhere(tmp_path):
    with pytest.raises(UserError, match="gs://b/run: capline can lock only local and s3:// run folders"):
        with run_lock(tmp_path, uri="gs://b/run"):
            pass


@pytest.fixture(scope="module")
def s3_env():
    yield from moto_s3(BUCKET)


@pytest.fixture
def s3(s3_env, monkeypatch):
    env, client = s3_env
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return client


@pytest.mark.slow   # starts Ray, a moto server or capline processes: not in the fast set
def test_a_stale_bucket_lock_is_taken_over_by_exactly_one(s3):
    uri = f"s3://{BUCKET}/stale"
    gone = {"host": "node-that-died", "pid": 4242, "since": 0, "heartbeat": time.time()}
    s3.put_object(Bucket=BUCKET, Key="stale/.capline.lock", Body=json.dumps(gone).encode())
    said, results = [], []

    def attempt(i):
        try:
            take(BucketLock(uri), {**_holder(), "who": i}, said.append)
            results.append(("took", i))
        except UserError as err:
            results.append(("refused", str(err)))

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = [r for r in results if r[0] == "took"]
    assert len(took) == 1, results
    assert [m for m in said if "taking over" in m] == [
        "lock: taking over a stale lock of pid 4242 on node-that-died (its heartbeat did not move for 1 s)"]
    holder = json.loads(s3.get_object(Bucket=BUCKET, Key="stale/.capline.lock")["Body"].read())
    assert holder["who"] == took[0][1]
    assert all("in use by another capline run" in r[1] for r in results if r[0] == "refused")


@pytest.mark.slow   # starts Ray, a moto server or capline processes: not in the fast set
def test_a_bucket_lock_taken_away_stops_the_run(s3, tmp_path):
    uri = f"s3://{BUCKET}/lost"
    with pytest.raises(UserError, match="the lock was taken by pid 5 on other-node"):
        with run_lock(tmp_path, uri=uri):
            s3.put_object(Bucket=BUCKET, Key="lost/.capline.lock", Body=json.dumps({"host": "other-node", "pid": 5}).encode())
            time.sleep(30)
    assert json.loads(s3.get_object(Bucket=BUCKET, Key="lost/.capline.lock")["Body"].read())["pid"] == 5


def test_a_lost_lock_stops_writes_even_when_something_else_takes_sigint(tmp_path):
    """A library may own SIGINT (Ray Train does during fit): the run's writes stop all the same."""
    import signal

    from infra.storage import Storage

    storage = Storage.local(tmp_path / "data")
    before = signal.signal(signal.SIGINT, lambda *a: None)     # the interrupt is swallowed
    try:
        t0 = time.monotonic()
        with pytest.raises(UserError, match="the lock was taken by pid 7 on other, so this run stopped writing"):
            with run_lock(tmp_path):
                (tmp_path / ".capline.lock").write_text(json.dumps({"host": "other", "pid": 7}))
                while time.monotonic() - t0 < 30:
                    storage.write_bytes("part.bin", b"x")
                    time.sleep(0.02)
        assert time.monotonic() - t0 < 5
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_run_started_in_the_background_is_stopped_by_a_lost_lock_all_the_same(tmp_path):
    """A shell starts a background command (`nohup capline run ... &`) with SIGINT ignored, so the
    lock's SIGINT stopped nothing: a run blocked in a wait went on until its next write (measured:
    these tests' 30 s sleeps ran out in `make test`, started in the background). There the lock
    wakes the main thread by SIGUSR1 instead, and leaves SIGINT ignored."""
    import signal

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    usr1 = signal.getsignal(signal.SIGUSR1)
    try:
        t0 = time.monotonic()
        with pytest.raises(UserError, match="the lock was taken by pid 9 on elsewhere, so this run stopped writing"):
            with run_lock(tmp_path):
                assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
                (tmp_path / ".capline.lock").write_text(json.dumps({"host": "elsewhere", "pid": 9}))
                time.sleep(30)          # a wait, no write: only a signal can end it
        assert time.monotonic() - t0 < 5
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGUSR1) == usr1
    finally:
        signal.signal(signal.SIGINT, before)
