"""The Ray calls stage code makes, in one place: stages say what to compute and never import Ray
(tests/pipeline/test_house.py checks it), so how tasks, actors and objects are made is decided
here and in the executor (pipeline/executor.py), not in each stage.

What stages need beyond the executor's task groups: small actors that hold a run's shared state
(the URL registry, the pacer) on the driver's node, calls to them, objects put once and read by
reference, and the data a task's result stores for later tasks (`Stored`). A call to an actor that is gone (its node lost) raises `Gone`, which stages catch
to carry on without it.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_RAY_DATA_IMPORT = threading.RLock()


@contextmanager
def importing_ray_data():
    """Imports of Ray Data (or of Ray Train, which imports it) made inside are made under one lock
    of this process. Python lets a second thread import a submodule of a package that another
    thread is still importing (the half-built parent is in sys.modules already, so the second
    import does not wait for it): the driver's warm-up thread importing Ray Data
    (`Executor.warm_shuffles`) beside the main thread's first shuffle made Ray Data's own code read
    `ray.data._internal` before it existed (AttributeError; CI on bedb6a2). Every import of Ray
    Data's modules in the driver is made inside this (tests/pipeline/test_house.py checks it)."""
    with _RAY_DATA_IMPORT:
        yield


class Gone(Exception):
    """An actor (or the object it held) is no longer reachable: its node went, or it was ended."""


def start_here(cls: type, *args, max_concurrency: int | None = None):
    """`cls(*args)` as a zero-CPU actor on this process's node (the driver's, when the driver asks):
    a worker node lost mid-run does not take it along. None outside a Ray cluster."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        return None
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    options = {"num_cpus": 0, "scheduling_strategy": here}
    if max_concurrency:
        options["max_concurrency"] = max_concurrency
    return ray.remote(**options)(cls).remote(*args)


def stop(actor) -> None:
    """End an actor (and the objects it owns); one already gone is no error."""
    if actor is None:
        return
    import ray

    try:
        ray.kill(actor)
    except Exception:      # noqa: BLE001 - gone with its node: nothing left to end
        pass


def ask(actor, method: str, *args, timeout: float | None = None) -> Any:
    """`actor.method(*args)`'s result; `Gone` when the actor (or its node) is."""
    import ray

    try:
        return ray.get(getattr(actor, method).remote(*args), timeout=timeout)
    except ray.exceptions.RayError as err:
        raise Gone(str(err).splitlines()[0] if str(err) else type(err).__name__) from err


def put(obj) -> Any:
    """`obj` in the object store, once: a reference every task on a node reads without a copy."""
    import ray

    return ray.put(obj)


def get(ref) -> Any:
    """The value behind a reference; `Gone` when its owner (an actor, a node) is."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayError as err:
        raise Gone(str(err).splitlines()[0] if str(err) else type(err).__name__) from err


def lost(err: BaseException) -> bool:
    """Whether `err`, or an error it came from, says an object is gone (its owner or node died, or it
    could not be rebuilt): what a caller that has another way to the data may recover from."""
    import ray

    while err is not None:
        if isinstance(err, ray.exceptions.ObjectLostError):
            return True
        err = err.__cause__ or getattr(err, "cause", None)
    return False


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


@dataclass
class Stored:
    """Data a task's result hands to later tasks through Ray's object store, never through the driver
    (a partition's keys for the stage's key index, the rows a shard plan read for the shard writers).
    A result that has some declares a field `stored: Stored | None`; in the task it holds `data`. A
    task of the task window sends the data as its second return and the driver's copy holds only
    its reference, `ref`; a result that came back whole (a shuffle reducer's answer) still holds
    `data`. Later tasks are given `handle()`: either way, what they read."""
    data: Any = None
    ref: Any = None

    def handle(self):
        return self.ref if self.ref is not None else self.data

    @staticmethod
    def leaving(out):
        """In the task: `out`'s stored data taken off it, to be its task's second return (None: none)."""
        box = getattr(out, "stored", None)
        if not isinstance(box, Stored) or box.data is None:
            return None
        data, box.data = box.data, None
        return data

    @staticmethod
    def arrived(out, ref):
        """On the driver: `out` with its stored data's reference, the task's second return."""
        box = getattr(out, "stored", None)
        if isinstance(box, Stored) and box.data is None and box.ref is None:
            box.ref = ref
        return out
