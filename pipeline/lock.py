"""One run at a time per run folder: `.capline.lock` in it, taken atomically, expiring with its holder.

The lock holds the holder's host, pid and start time; a thread rewrites its `heartbeat` every
`HEARTBEAT` seconds. Another run finds it and refuses, naming the holder, unless the holder is gone:
on the same host its pid no longer runs (or is another process), on another host its heartbeat is
older than `STALE_AFTER`. A stale lock is taken over and the takeover is said out loud.

Where it lives: a local run folder's lock is a file created with O_EXCL; a stale one is taken over
by renaming it away (only one taker can move a given file) and creating a new one. An `s3://` run
folder's lock is an object in the bucket, created with a conditional put (`If-None-Match: *`) so
two machines cannot both take it; the holder refreshes and releases it only while its ETag is the
one it wrote (`If-Match`), and a stale one is replaced under `If-Match` of the stale ETag.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from infra.errors import UserError

HEARTBEAT = 20.0
STALE_AFTER = 120.0


def _holder() -> dict:
    import psutil

    me = psutil.Process()
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": me.create_time(),
            "since": time.time(), "heartbeat": time.time()}


def _alive(info: dict) -> bool:
    import psutil

    if info.get("host") != socket.gethostname():
        return time.time() - float(info.get("heartbeat", 0)) < STALE_AFTER
    try:
        proc = psutil.Process(int(info["pid"]))
        return abs(proc.create_time() - float(info.get("pid_started", 0))) < 1.0  # not a reused pid
    except (psutil.NoSuchProcess, KeyError, ValueError):
        return False


def _try_create(path: Path, info: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    return True


def _refuse(where, other: dict) -> None:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(other.get("since", 0)))
    raise UserError(f"{where} is in use by another capline run (pid {other.get('pid')} on "
                    f"{other.get('host')}, since {since}); wait for it to finish, or run elsewhere")


def _take_local(path: Path, info: dict, log) -> None:
    for _ in range(5):
        if _try_create(path, info):
            return
        try:
            other = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, json.JSONDecodeError):
            other = {}
        if other and _alive(other):
            _refuse(path.parent, other)
        moved = path.with_name(f"{path.name}.stale-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.rename(path, moved)   # atomic: of two runs taking over, one moves it, the other finds none
        except FileNotFoundError:
            continue
        try:
            taken = json.loads(moved.read_text())
        except (OSError, json.JSONDecodeError):
            taken = {}
        if taken != other:           # a run took it over between our read and the rename: give it back
            try:
                os.link(moved, path)
            except FileExistsError:
                pass
            moved.unlink(missing_ok=True)
            continue
        moved.unlink(missing_ok=True)
        log(f"lock: taking over a stale lock of pid {other.get('pid')} on {other.get('host')} (no longer running)")
    raise UserError(f"{path.parent}: could not take the run lock {path}; another run keeps taking it")


@contextmanager
def _local_lock(run_dir: Path, log):
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".capline.lock"
    info = _holder()
    _take_local(path, info, log)
    stop = threading.Event()

    def beat():
        while not stop.wait(HEARTBEAT):
            info["heartbeat"] = time.time()
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(info))
            os.replace(tmp, path)

    thread = threading.Thread(target=beat, name="capline-lock-heartbeat", daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join(timeout=5)
        path.unlink(missing_ok=True)


class BucketLock:
    """The lock object of an s3:// run folder, through boto3's conditional writes."""

    def __init__(self, uri: str):
        import boto3

        bucket, _, prefix = uri.split("://", 1)[1].partition("/")
        self.bucket, self.key = bucket, f"{prefix.rstrip('/')}/.capline.lock".lstrip("/")
        self.uri = uri
        self.client = boto3.client("s3")
        self.etag = None

    def _failed(self, err) -> bool:
        code = getattr(err, "response", {}).get("Error", {}).get("Code", "")
        return code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")

    def _read(self) -> tuple[dict, str | None]:
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.NoSuchKey:
            return {}, None
        try:
            return json.loads(got["Body"].read()), got["ETag"]
        except json.JSONDecodeError:
            return {}, got["ETag"]

    def take(self, info: dict, log) -> None:
        from botocore.exceptions import ClientError

        for _ in range(5):
            try:
                self.etag = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=json.dumps(info).encode(),
                                                   IfNoneMatch="*")["ETag"]
                return
            except ClientError as err:
                if not self._failed(err):
                    raise
            other, etag = self._read()
            if etag is None:
                continue
            if other and _alive(other):
                _refuse(self.uri, other)
            try:   # replace exactly the stale object we judged; a concurrent taker's put fails this
                self.etag = self.client.put_object(Bucket=self.bucket, Key=self.key, IfMatch=etag,
                                                   Body=json.dumps(info).encode())["ETag"]
                log(f"lock: taking over a stale lock of pid {other.get('pid')} on {other.get('host')} "
                    "(its heartbeat stopped)")
                return
            except ClientError as err:
                if not self._failed(err):
                    raise
        raise UserError(f"{self.uri}: could not take the run lock; another run keeps taking it")

    def beat(self, info: dict) -> None:
        from botocore.exceptions import ClientError

        try:
            self.etag = self.client.put_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag,
                                               Body=json.dumps(info).encode())["ETag"]
        except ClientError:
            pass    # taken over (we looked stale) or unreachable: the next beat tries again

    def release(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)
        except ClientError:
            pass    # another run holds it now: not ours to remove


@contextmanager
def _bucket_lock(uri: str, log):
    lock = BucketLock(uri)
    info = _holder()
    lock.take(info, log)
    stop = threading.Event()

    def beat():
        while not stop.wait(HEARTBEAT):
            info["heartbeat"] = time.time()
            lock.beat(info)

    thread = threading.Thread(target=beat, name="capline-lock-heartbeat", daemon=True)
    thread.start()
    try:
        yield f"{uri.rstrip('/')}/.capline.lock"
    finally:
        stop.set()
        thread.join(timeout=5)
        lock.release()


@contextmanager
def run_lock(run_dir: Path, log=print, uri: str | None = None):
    """Hold the run folder's lock for the block: in the bucket for an s3:// run folder, else a file."""
    with (_bucket_lock(uri, log) if uri else _local_lock(run_dir, log)) as where:
        yield where
