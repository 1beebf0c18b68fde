"""What a task of the executor hands back and how its failure is said: the result with when it ran,
the data it stores for later tasks (`Stored`: a second return the driver passes on by reference), the fault
injection the fault tests use, the small actor a run's tasks count their items on, and the one-line
wording of a failed task (the input's fault, a full disk, a node without the bucket's credentials).
Shared by the task window (pipeline/task_window.py) and its slots (Ray tasks, a model's pool, the
shuffle's reducers)."""
from __future__ import annotations

import os
import time
from typing import Callable

from infra.errors import UserError
from infra.remote import Stored


FAILPOINTS = "CAPLINE_FAILPOINTS"


def failpoint(what: str) -> None:
    """Fault injection for the fault tests (as etcd's and databases' failpoints): with
    CAPLINE_FAILPOINTS=<folder> in the workers' environment, the first task of every group of
    tasks kills its own worker process (SIGKILL, as the OOM killer would), once per group; Ray
    runs the task again elsewhere. Unset, this is one environment lookup."""
    folder = os.environ.get(FAILPOINTS)
    if not folder:
        return
    import hashlib
    import signal

    marker = os.path.join(folder, hashlib.sha256(what.encode()).hexdigest()[:16])
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return
    os.write(fd, f"{what}\n".encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def timed(what: str, fn: Callable, *args, **kwargs):
    """Runs in the worker: the result and when it ran (this node's clock), and the data it stores for
    later tasks as a second return (`Stored.leaving`). The call's arguments stay top-level arguments of
    the task, so Ray resolves any ObjectRef among them (an index put once, a plan's rows stored)."""
    failpoint(what)
    t0 = time.time()
    out = fn(*args, **kwargs)
    return (t0, time.time(), out), Stored.leaving(out)


def settle(ref) -> None:
    """A failed call's second return holds its error too: read it here, so Ray does not log it as
    an unhandled error when the reference is dropped."""
    import ray

    try:
        ray.get(ref, timeout=10)
    except Exception:   # noqa: BLE001 - the error was the first return's, and is reported from there
        pass


class ItemCounter:
    """A Ray actor the tasks of one `run` add the items they finished to (no CPU of its own)."""

    def __init__(self):
        self.n = 0

    def add(self, n: int) -> None:
        self.n += n

    def get(self) -> int:
        return self.n


# how an object store says a node's credentials are missing or wrong (pyarrow's S3 codes, boto's)
REFUSED_CREDENTIALS = ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "AccessDenied",
                       "InvalidAccessKeyId", "SignatureDoesNotMatch", "Unable to locate credentials",
                       "MISSING_AUTHENTICATION_TOKEN", "EXPIRED_TOKEN", "ExpiredToken")


def worker_died(err: Exception) -> bool:
    """Whether a task failed because its worker process died under it (the kernel's or Ray's OOM
    killer, a crash in a native library) rather than by an exception of its own."""
    return type(err).__name__ in ("WorkerCrashedError", "OutOfMemoryError")


def died(label: str, tries: int, process: str = "worker") -> str:
    """A task's label when its process (a task's worker, a pool's actor) died under it on every try:
    what the user can change is its memory, not the input."""
    return f"{label} (its {process} died {tries} times running it: out of memory?)"


def task_error(err: Exception, what: str, label: str, tries: int | None = None) -> Exception:
    """`err` of the task `label` of `what` in one line: a UserError where the input or the setup is at
    fault (said as such), else a RuntimeError naming the task. `tries`: how many times it ran, said
    when its worker died every time (what the user can change is its memory, not the input)."""
    # a task's UserError arrives as Ray's wrapper (an instance of UserError too, saying a traceback):
    # its `cause` is the error itself; a model pool's call hands the error itself
    cause = getattr(err, "cause", None)
    if cause is None and isinstance(err, UserError):
        cause = err
    if isinstance(cause, UserError):   # the input's fault, said in one line: not a crash
        return UserError(f"{what}: {label}: {cause}")
    text = str(err).strip()
    if "No space left on device" in text or "[errno 28]" in text.lower():
        return UserError(f"{what}: {label}: no space left on the run folder's disk; free space or move --run-dir "
                         "elsewhere, then rerun the same command to resume")
    code = next((c for c in REFUSED_CREDENTIALS if c in text), None)
    if code:   # one node without the bucket's credentials: name it, not a traceback
        import re

        found = re.search(r"\bip=([0-9A-Fa-f.:]+)\)", text)   # Ray's header line: (pid=..., ip=...)
        node = getattr(err, "ip", None) or (found.group(1) if found else "of unknown address")
        return UserError(f"{what}: {label}: the object store refused node {node} ({code}); give that node the "
                         "run folder's credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment of "
                         "its `ray start`, or an instance role), then rerun to resume")
    if type(err).__name__ == "OutOfMemoryError":     # Ray's memory monitor: its own retries, its count
        label = f"{label} (Ray killed its worker: the node ran out of memory)"
    elif tries and worker_died(err):
        label = died(label, tries)
    return RuntimeError(f"{what}: {label} failed: {type(err).__name__}: "
                        f"{text.splitlines()[-1][:300] if text else ''}")
