"""One run at a time per run folder: `<run_dir>/.capline.lock`, taken atomically, expiring with its holder.

The lock file holds the holder's host, pid and start time; a thread rewrites its `heartbeat` every
`HEARTBEAT` seconds. Another run finds it and refuses, naming the holder, unless the holder is gone:
on the same host its pid no longer runs (or is another process), on another host its heartbeat is
older than `STALE_AFTER`. A stale lock is taken over and the takeover is said out loud.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from trainers.errors import UserError

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


@contextmanager
def run_lock(run_dir: Path, log=print):
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".capline.lock"
    info = _holder()
    for _ in range(3):
        if _try_create(path, info):
            break
        try:
            other = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            other = {}
        if other and _alive(other):
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(other.get("since", 0)))
            raise UserError(f"{run_dir} is in use by another capline run (pid {other.get('pid')} on "
                            f"{other.get('host')}, since {since}); wait for it to finish, or run elsewhere")
        log(f"lock: taking over a stale lock of pid {other.get('pid')} on {other.get('host')} (no longer running)")
        path.unlink(missing_ok=True)
    else:
        raise UserError(f"{run_dir}: could not take the run lock {path}; another run keeps taking it")
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
