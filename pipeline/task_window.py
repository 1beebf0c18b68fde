"""The task window: the one loop that keeps a group of calls in flight on the cluster, waits for
them, says their progress with an ETA, says a stall and checks the cluster when nothing finishes,
and keeps the record of what ran (`Executor.records`).

What runs a call is a kind of slot, each a small class with four methods (`Slots`):
- `TaskSlots` (here): Ray tasks, as many submitted as the window allows (`Executor.run`, the maps of
  a shuffle);
- `PoolSlots` (model_pool.py): the actors of a model's pool, two calls queued on each;
- `ReducerSlots` (ray_shuffle.py): the groups of Ray Data's hash shuffle, answered as it finishes them.
The loop knows none of them; a slot knows nothing of progress, stalls or records.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

from infra.errors import UserError
from infra.progress import Progress
from infra.remote import Stored

from .sizing import NodeShape, spans
from .task_results import settle, task_error

COUNT_EVERY = 2.0     # seconds between reads of a run's item counter


class Slots(Protocol):
    def submit(self) -> None:
        """Send every call that may go now."""

    def wait(self, timeout: float) -> list:
        """What came back within `timeout` seconds (nothing, when none did)."""

    def take(self, ready) -> list[tuple[int, float, float, object]]:
        """(call, start, end, result) of what came back: none when the call was sent again; the
        call's failure raised in one line."""

    def running(self) -> int:
        """Calls sent and not yet back."""


@dataclass
class Counted:
    """A run whose calls count their items on `counter` (task_results.ItemCounter) as they go: the
    progress says items, not calls. `per_call`: each call's items, added when it finishes whatever it
    reported (None: only the counter says)."""
    counter: object
    total: int
    unit: str
    per_call: list[int] | None = None


def drive(slots: Slots, n_calls: int, title: str, log: Callable[[str], None], poll_seconds: float,
          unit: str = "partitions", counted: Counted | None = None,
          on_stall: Callable[[], None] | None = None, close: Callable[[bool], None] | None = None
          ) -> tuple[list, list[tuple[float, float]]]:
    """Every call of `slots` run: -> (results in call order, when each ran). A stall (nothing back
    for `poll_seconds`) is said and `on_stall` called (the cluster checked); `close(finished)` is
    called however the loop ends."""
    import ray

    progress = (Progress(title, counted.total, log, unit=counted.unit) if counted is not None
                else Progress(title, n_calls, log, unit=unit))
    results: list = [None] * n_calls
    intervals: list[tuple[float, float]] = []
    last_done = time.time()
    counted_now = finished_items = 0
    ended = False
    try:
        while len(intervals) < n_calls:
            slots.submit()
            ready = slots.wait(COUNT_EVERY if counted is not None else poll_seconds)
            if counted is not None:
                now = min(counted.total, ray.get(counted.counter.get.remote()))
                if now > counted_now:
                    counted_now, last_done = now, time.time()
                    progress.update(counted_now)
                if not ready and time.time() - last_done < poll_seconds:
                    continue
            if not ready:
                progress.stalled(time.time() - last_done, slots.running())
                if on_stall is not None:
                    on_stall()
                continue
            for thing in ready:
                for i, t0, t1, out in slots.take(thing):
                    results[i] = out
                    intervals.append((t0, t1))
                    last_done = time.time()
                    if counted is None:
                        progress.update(len(intervals))
                    elif counted.per_call is not None:
                        finished_items += counted.per_call[i]
                        counted_now = max(counted_now, min(counted.total, finished_items))
                        progress.update(counted_now)
        ended = True
    finally:
        if close is not None:
            close(ended)
        progress.close()
    return results, intervals


def record(title: str, n_calls: int, intervals: list, t_start: float, cpus: float, shape: NodeShape, **more) -> dict:
    """The record of one group of calls (Executor.records): how many, how many at once, the cluster."""
    return {"what": title, "tasks": n_calls, **spans(intervals, t_start), "cpus_per_task": cpus,
            "cluster_cpus": shape.cpus, "nodes": shape.nodes, **more, "seconds": round(time.time() - t_start, 3)}


class RefSlots:
    """Slots whose calls come back as Ray object references (`pending`: reference -> what the slot
    keeps of its call): waited for one at a time."""
    pending: dict

    def wait(self, timeout: float) -> list:
        import ray

        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        return ready

    def running(self) -> int:
        return len(self.pending)


class TaskSlots(RefSlots):
    """Ray tasks (`remote`, made of task_results.timed: two returns), at most `limit` submitted at a
    time. A failed task is named by `describe(call)`, said in one line (task_results.task_error)."""

    def __init__(self, remote, what: str, fn: Callable, calls: list[tuple], kwargs: list[dict] | None, limit: int,
                 describe: Callable[[tuple], str], tries: int):
        self.remote, self.what, self.fn, self.calls, self.kwargs = remote, what, fn, calls, kwargs
        self.limit, self.describe, self.tries = limit, describe, tries
        self.stored: list = [None] * len(calls)
        self.pending: dict = {}
        self.nxt = 0

    def submit(self) -> None:
        while self.nxt < len(self.calls) and len(self.pending) < self.limit:
            i = self.nxt
            ref, self.stored[i] = self.remote.remote(self.what, self.fn, *self.calls[i], **(self.kwargs[i] if self.kwargs else {}))
            self.pending[ref] = i
            self.nxt += 1

    def take(self, ref) -> list[tuple[int, float, float, object]]:
        import ray

        i = self.pending.pop(ref)
        try:
            t0, t1, out = ray.get(ref)
        except Exception as err:
            settle(self.stored[i])
            failure = task_error(err, self.what, self.describe(self.calls[i]) or f"task {i}", tries=self.tries)
            raise failure from (None if isinstance(failure, UserError) else err)
        return [(i, t0, t1, Stored.arrived(out, self.stored[i]))]
