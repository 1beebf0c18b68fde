"""One run at a time per run folder: `.capline.lock` in it, created with its content in one step.

The lock holds the holder's host, pid, start time, a random token and a heartbeat counter that a
thread advances every HEARTBEAT seconds. Another run that finds it refuses, naming the holder,
unless the holder is gone:
- on this host: its pid no longer runs (or is another process with the same number): taken over
  at once;
- anywhere else, or a lock that does not parse: its content does not change for STALE_AFTER
  seconds, timed on *this* host's monotonic clock. Two hosts' wall clocks are never compared:
  a live holder whose clock runs minutes behind ours is still alive.
A stale lock is taken over by exactly one run, said out loud.

The holder refreshes the lock only while it is still the one it wrote. Finding it gone or
another's, or failing to refresh it for longer than another run would wait before taking it, the
run stops writing at once (its main thread is interrupted), says so and exits with an error; only
the holder removes its lock.

Where it lives: a local run folder's lock is written to a private file and hard-linked into place
(a link never replaces an existing file); a stale one is renamed away (only one taker can move a
given file) and a new one linked. An `s3://` run folder's lock is an object created with a
conditional put (`If-None-Match: *`), refreshed and taken over under `If-Match` of the ETag read.
Other object stores have no conditional write through pyarrow: a `gs://` run folder is refused
rather than locked somewhere else.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from infra.errors import UserError

# seconds; CAPLINE_LOCK_HEARTBEAT_S shortens both for tests that race runs (stale = 6 heartbeats)
HEARTBEAT = float(os.environ.get("CAPLINE_LOCK_HEARTBEAT_S", 20.0))
STALE_AFTER = 6 * HEARTBEAT
POLL = 1.0


def _holder() -> dict:
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": psutil.Process().create_time(),
            "token": secrets.token_hex(8), "since": time.time(), "beat": 0, "heartbeat": time.time()}


def _encode(info: dict) -> bytes:
    return json.dumps(info, sort_keys=True).encode()


def _parse(raw: bytes) -> dict:
    try:
        got = json.loads(raw)
        return got if isinstance(got, dict) else {}
    except (ValueError, UnicodeDecodeError):
        return {}


def _pid_alive(info: dict) -> bool:
    import psutil

    try:
        proc = psutil.Process(int(info["pid"]))
        return abs(proc.create_time() - float(info.get("pid_started", 0))) < 1.0   # not a reused pid
    except (psutil.NoSuchProcess, KeyError, ValueError, TypeError):
        return False


def _refuse(where, other: dict) -> None:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(other.get("since", 0) or 0)))
    who = f"pid {other.get('pid')} on {other.get('host')}, since {since}" if other else "a holder that wrote no details"
    raise UserError(f"{where} is in use by another capline run ({who}); wait for it to finish, or run elsewhere")


class LocalLockFile:
    """The lock as a file: versions are the sha256 of its bytes."""

    def __init__(self, path: Path):
        self.path = path
        self.where = path.parent

    @staticmethod
    def version(raw: bytes) -> str:
        return hashlib.sha256(raw).hexdigest()

    def create(self, data: bytes) -> str | None:
        tmp = self.path.with_name(f"{self.path.name}.new-{secrets.token_hex(6)}")
        tmp.write_bytes(data)
        try:
            os.link(tmp, self.path)          # fails if a lock exists: never a moment with an empty lock
            return self.version(data)
        except FileExistsError:
            return None
        finally:
            tmp.unlink(missing_ok=True)

    def read(self) -> tuple[bytes, str] | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return raw, self.version(raw)

    def take_over(self, data: bytes, version: str) -> str | None:
        moved = self.path.with_name(f"{self.path.name}.stale-{secrets.token_hex(6)}")
        try:
            os.rename(self.path, moved)      # of two takers, one moves it, the other finds none
        except FileNotFoundError:
            return None
        try:
            if self.version(moved.read_bytes()) != version:   # it changed after we judged it: give it back
                try:
                    os.link(moved, self.path)
                except FileExistsError:
                    pass
                return None
        finally:
            moved.unlink(missing_ok=True)
        return self.create(data)

    def refresh(self, data: bytes, version: str) -> str | None:
        got = self.read()
        if got is None or got[1] != version:
            return None
        tmp = self.path.with_name(f"{self.path.name}.beat-{secrets.token_hex(6)}")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)
        return self.version(data)

    def remove(self, version: str) -> None:
        got = self.read()
        if got is not None and got[1] == version:
            self.path.unlink(missing_ok=True)


class BucketLock:
    """The lock object of an s3:// run folder, through boto3's conditional writes: versions are ETags."""

    def __init__(self, uri: str):
        import boto3

        bucket, _, prefix = uri.split("://", 1)[1].partition("/")
        self.bucket, self.key = bucket, f"{prefix.rstrip('/')}/.capline.lock".lstrip("/")
        self.where = uri
        self.client = boto3.session.Session().client("s3")   # credentials as the environment has them now

    @staticmethod
    def _conflict(err) -> bool:
        code = str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))
        return code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409", "404")

    def _put(self, data: bytes, **condition) -> str | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=data, **condition)["ETag"]
        except ClientError as err:
            if self._conflict(err):
                return None
            raise

    def create(self, data: bytes) -> str | None:
        return self._put(data, IfNoneMatch="*")

    def read(self) -> tuple[bytes, str] | None:
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.NoSuchKey:
            return None
        return got["Body"].read(), got["ETag"]

    def take_over(self, data: bytes, version: str) -> str | None:
        return self._put(data, IfMatch=version)

    refresh = take_over

    def remove(self, version: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=version)
        except ClientError:
            pass    # another run holds it now: not ours to remove


def _watch(backend, version: str) -> str:
    """Whether a lock's content moves over STALE_AFTER seconds of this host's monotonic clock:
    'moved', 'gone' or 'still'."""
    t0 = time.monotonic()
    while (left := STALE_AFTER - (time.monotonic() - t0)) > 0:
        time.sleep(min(POLL, left))
        got = backend.read()
        if got is None:
            return "gone"
        if got[1] != version:
            return "moved"
    return "still"


def take(backend, info: dict, log) -> str:
    """Take the lock for `info`, or refuse naming its live holder. -> the version written."""
    for _ in range(5):
        data = _encode(info)
        if (version := backend.create(data)) is not None:
            return version
        got = backend.read()
        if got is None:
            continue
        other, seen = _parse(got[0]), got[1]
        if other.get("host") == info["host"]:
            if _pid_alive(other):
                _refuse(backend.where, other)
            why = "no longer running"
        else:
            log(f"lock: {backend.where} is held by pid {other.get('pid')} on {other.get('host')}; "
                f"watching its heartbeat for up to {STALE_AFTER:.0f} s")
            moved = _watch(backend, seen)
            if moved == "gone":
                continue
            if moved == "moved":
                now = backend.read()
                _refuse(backend.where, _parse(now[0]) if now else other)
            why = f"its heartbeat did not move for {STALE_AFTER:.0f} s"
        if (version := backend.take_over(data, seen)) is not None:
            log(f"lock: taking over a stale lock of pid {other.get('pid')} on {other.get('host')} ({why})")
            return version
    raise UserError(f"{backend.where}: could not take the run lock; another run keeps taking it")


class Held:
    """A taken lock and the thread that keeps it: `lost` says why it is no longer ours."""

    def __init__(self, backend, info: dict, version: str, log, wake: int | None):
        self.backend, self.info, self.version, self.log = backend, info, version, log
        self.wake = wake        # the signal that stops the main thread (`_waking_signal`); None: writes only
        self.lost: str | None = None
        self.stop = threading.Event()
        self.mutex = threading.Lock()
        self.thread = threading.Thread(target=self._beat, name="capline-lock-heartbeat", daemon=True)

    def _lose(self, why: str) -> None:
        with self.mutex:
            if self.stop.is_set() or self.lost:
                return
            self.lost = why
            self.log(f"lock: {why}; this run stops writing")
            from infra.storage import block_writes

            block_writes(f"{self.backend.where}: {why}, so this run stopped writing")   # even if the signal is caught
            # the main thread is where the run writes: stop it now. A real signal, aimed at it,
            # also wakes a blocking call (a sleep, a wait on Ray), where interrupt_main() would not
            if self.wake is not None:
                signal.pthread_kill(threading.main_thread().ident, self.wake)

    def _beat(self) -> None:
        last_ok = time.monotonic()
        while not self.stop.wait(HEARTBEAT):
            self.info["beat"] += 1
            self.info["heartbeat"] = time.time()
            try:
                version = self.backend.refresh(_encode(self.info), self.version)
            except Exception as err:   # storage unreachable: retry, until another run could take it
                if time.monotonic() - last_ok > STALE_AFTER - 2 * HEARTBEAT:
                    self._lose(f"the lock could not be refreshed for {time.monotonic() - last_ok:.0f} s ({err})")
                continue
            if version is None:
                got = self.backend.read()
                other = _parse(got[0]) if got else {}
                self._lose(f"the lock was taken by pid {other.get('pid')} on {other.get('host')}" if got
                           else "the lock was removed by someone else")
                return
            self.version, last_ok = version, time.monotonic()

    def release(self) -> None:
        with self.mutex:
            self.stop.set()
        self.thread.join(timeout=5)
        if not self.lost:
            self.backend.remove(self.version)


def _backend(run_dir: Path, uri: str | None):
    if not uri:
        run_dir.mkdir(parents=True, exist_ok=True)
        return LocalLockFile(run_dir / ".capline.lock")
    if uri.startswith("s3://"):
        return BucketLock(uri)
    raise UserError(f"{uri}: capline can lock only local and s3:// run folders (a lock needs a conditional write, "
                    "which pyarrow does not offer for this scheme); use an s3:// or local --run-dir")


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


@contextmanager
def _waking_signal():
    """The signal a lost lock sends the main thread to stop the run, set up for the block. SIGINT,
    as Ctrl-C: every stage ends on it resumably and Ray Train stops its workers gracefully on it. A
    command a shell started in the background (`nohup capline run ... &`, a script's `&`) inherits
    SIGINT ignored, so that signal would stop nothing until the run's next write; there SIGUSR1 is
    used, with a handler of its own for the block (it raises KeyboardInterrupt, as SIGINT would),
    and the ignored SIGINT is left as the caller set it. Outside the main thread no handler can
    be set: None (a lost lock then stops the process's writes only)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield signal.SIGINT
        return
    before = signal.signal(signal.SIGUSR1, _raise_interrupt)
    try:
        yield signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, before if before is not None else signal.SIG_DFL)


@contextmanager
def run_lock(run_dir: Path, log=print, uri: str | None = None):
    """Hold the run folder's lock for the block: in the bucket for an s3:// run folder, else a file.
    A lock lost during the block ends it with a UserError naming what happened."""
    backend = _backend(run_dir, uri)
    info = _holder()
    with _waking_signal() as wake:
        held = Held(backend, info, take(backend, info, log), log, wake)
        held.thread.start()
        with _held(held, backend, uri) as where:
            yield where


@contextmanager
def _held(held: Held, backend, uri: str | None):
    """The block of `run_lock` while `held` is kept: a lost lock ends it with a UserError."""
    where = f"{uri.rstrip('/')}/.capline.lock" if uri else str(backend.path)
    lost = lambda: UserError(f"{backend.where}: {held.lost}, so this run stopped writing; "  # noqa: E731
                             "see which run holds the folder now before starting again")
    try:
        yield where
    except (KeyboardInterrupt, SystemExit):
        if held.lost:
            raise lost() from None
        raise
    finally:
        held.release()
        if held.lost:
            from infra.storage import block_writes

            block_writes(None)
    if held.lost:   # the interrupt was taken by another handler (Ray Train aborts on SIGINT): still an error
        raise lost()
