"""A model's actor pool: the calls of one `Executor.run(model=...)` on Ray actors that each load the
model once (fastText, a scorer, dedup's descriptor) and then run partitions, two queued on each so
that an actor never waits for the driver. An actor killed mid-call (the OOM killer) comes back with
its model and its calls are sent again, each alone; a call blamed only when its actor dies under it
three times while it ran alone, named as the task window names a failed task.

Why capline's own and not Ray Data's `ActorPoolStrategy`: benchmarks/results/scaling-history.md, "Session 23 asked Ray Data for capline's semantics" (Ray Data's pool
retries a partition that kills its actor without end unless bounded through a deprecated parameter).
"""
from __future__ import annotations

import math
import time
from typing import Callable

from infra.errors import UserError
from infra.remote import Stored

from .sizing import NodeShape, actors_that_fit
from .task_results import died, failpoint, settle, task_error
from .task_window import RefSlots

CALLS_PER_ACTOR = 8    # the fewest calls a model's actor is started for (run_pool)


class PoolQueue:
    """Which call an actor of a model's pool runs next, and what an actor's death says about a call.

    An actor runs its queued calls one after another, and a killed actor fails every call queued on
    it, including one that had finished but whose answer had not left the process yet. So a death
    only blames a call that was running alone: a call that died beside others is sent again alone (no
    other call queued on its actor until it returns), and is blamed only when its third death comes
    while it ran alone."""

    def __init__(self, n_calls: int, n_actors: int, per_actor: int = 2, tries: int = 3):
        self.n_calls, self.per_actor, self.max_tries = n_calls, per_actor, tries
        self.nxt = 0
        self.again: list[int] = []          # calls to send again, before any new one
        self.alone: set[int] = set()        # calls that run with nothing else on their actor
        self.queued = [0] * n_actors
        self.holding = [False] * n_actors   # an actor running an `alone` call takes nothing else
        self.deaths = [0] * n_calls

    def next_for(self, a: int) -> int | None:
        """The call to send to actor `a` now, or None (it is full, held, or nothing is left to send)."""
        if self.holding[a] or self.queued[a] >= self.per_actor:
            return None
        if self.again:
            if self.again[0] in self.alone and self.queued[a]:
                return None                 # it waits for an actor with nothing queued
            i = self.again.pop(0)
        elif self.nxt < self.n_calls:
            i, self.nxt = self.nxt, self.nxt + 1
        else:
            return None
        self.queued[a] += 1
        self.holding[a] = i in self.alone
        return i

    def returned(self, i: int, a: int) -> None:
        """Call `i`'s answer (or its failure) came back from actor `a`."""
        self.queued[a] -= 1
        if i in self.alone:
            self.holding[a] = False

    def resend(self, i: int) -> None:
        """Send `i` again as it was sent (it reached an actor that was coming back: not a try)."""
        self.again.insert(0, i)

    def died(self, i: int) -> bool:
        """Call `i`'s actor died under it: True when that is its last try (it is to blame), else it is
        queued to run again, alone."""
        self.deaths[i] += 1
        if i in self.alone and self.deaths[i] >= self.max_tries:
            return True
        self.alone.add(i)
        self.again.append(i)
        return False


def run_pool(executor, fn: Callable, calls: list[tuple], kwargs: list[dict] | None, what: str, cpus: float,
             gpus: float, model, shape: NodeShape, describe: Callable | None, unit: str, quiet: bool) -> list:
    """`Executor.run` on an actor pool: each actor loads `model` once (its constructor), then runs
    calls, two queued at a time so it never waits for the driver; the pool has as many actors as
    the nodes hold (CPUs, GPUs, the model's declared memory), one for CALLS_PER_ACTOR calls at most.
    A failed call is named as `run` names it; a killed actor is restarted (its model loaded
    again) and its calls run again; the actors are ended when the calls are done."""
    import ray

    room = actors_that_fit(cpus, gpus, model.memory_bytes, shape)
    if room < 1:
        raise UserError(f"{what}: one copy of {model.name} asks for {cpus:g} CPU(s), {gpus:g} GPU(s) and "
                        f"{model.memory_mb:,.0f} MB of memory, and no alive node has that much free to Ray"
                        + (f"; change {model.setting} or add a larger node" if model.setting else
                           "; add a larger node"))
    # an actor is a new process (imports, then the model): on a 2-core machine declaring 16 CPUs,
    # 20 actors for 20 small partitions took 11-13 s where warm task workers took 0.1-0.3 s;
    # so at least CALLS_PER_ACTOR partitions an actor, the start paid over several
    size = max(1, min(room, math.ceil(len(calls) / CALLS_PER_ACTOR)))
    # an actor killed mid-call (the OOM killer, a failpoint) comes back with its model and its
    # calls are sent again, each alone (PoolQueue); a call whose actor dies 3 times under it, the
    # last times alone, fails, as a task does after 3 tries; the calls that shared its actor do not
    actor = ray.remote(num_cpus=cpus, num_gpus=gpus or None, memory=model.memory_bytes or None,
                       max_restarts=-1, max_task_retries=0)(PoolWorker)
    actors = [actor.remote(what, fn, model.load, *model.args) for _ in range(size)]

    def end(finished: bool) -> None:
        for a in actors:
            ray.kill(a, no_restart=True)

    slots = PoolSlots(actors, what, calls, kwargs, describe or (lambda c: ""), model.name)
    return executor.drive(slots, len(calls), what, cpus, shape, unit=unit, quiet=quiet, close=end,
                          on_stall=lambda: executor.check_still_feasible(cpus, gpus, what, model.setting),
                          actors=size, model=model.name)


class PoolSlots(RefSlots):
    """The task window's slots on a model's actors (task_window.drive): which call goes where is
    PoolQueue's; a call whose actor died under it is sent again, or blamed when that was its last try."""

    def __init__(self, actors: list, what: str, calls: list[tuple], kwargs: list[dict] | None,
                 describe: Callable[[tuple], str], model_name: str):
        self.actors, self.what, self.calls, self.kwargs = actors, what, calls, kwargs
        self.describe, self.model_name = describe, model_name
        self.queue = PoolQueue(len(calls), len(actors))
        self.stored: list = [None] * len(calls)
        self.pending: dict = {}           # a call's ref -> (call index, actor index)

    def submit(self) -> None:
        for a in range(len(self.actors)):
            while (i := self.queue.next_for(a)) is not None:
                ref, self.stored[i] = self.actors[a].call.options(num_returns=2).remote(
                    *self.calls[i], **(self.kwargs[i] if self.kwargs else {}))
                self.pending[ref] = (i, a)

    def take(self, ref) -> list[tuple[int, float, float, object]]:
        import ray

        i, a = self.pending.pop(ref)
        self.queue.returned(i, a)
        label = self.describe(self.calls[i]) or f"task {i}"
        try:
            t0, t1, out, err = ray.get(ref)
        except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError) as dead:
            settle(self.stored[i])
            if "creation task" in str(dead):      # restarts are unlimited: its model never loaded
                err, label = dead, f"loading {self.model_name}"
            elif "is restarting" in str(dead):    # sent while it came back: not a try
                time.sleep(0.2)
                self.queue.resend(i)
                return []
            elif not self.queue.died(i):          # its actor was killed: again, once it is back
                return []
            else:
                err, label = dead, died(label, self.queue.max_tries, "actor")
        except Exception as lost:    # noqa: BLE001 - a result lost with its node: said as a task's is
            settle(self.stored[i])
            err = lost
        if err is not None:
            failure = task_error(err, self.what, label)
            raise failure from (None if isinstance(failure, UserError) else err)
        return [(i, t0, t1, Stored.arrived(out, self.stored[i]))]


class PoolWorker:
    """An actor of a model's pool (run_pool): the model loaded once, in the constructor;
    then calls. A call's exception comes back as its result, so the driver names the partition that
    failed as a task's failure is named."""

    def __init__(self, what: str, fn: Callable, load: Callable | None, *args):
        self.what, self.fn = what, fn
        if load is not None:
            load(*args)

    def call(self, *args, **kwargs):
        failpoint(self.what)
        t0 = time.time()
        try:
            out = self.fn(*args, **kwargs)
            return (t0, time.time(), out, None), Stored.leaving(out)
        except Exception as exc:       # noqa: BLE001 - reported by the driver, naming the call
            try:
                import ray

                exc.ip = ray.util.get_node_ip_address()    # a node the bucket refused is named
            except Exception:          # noqa: BLE001 - an exception that takes no attributes
                pass
            return (t0, time.time(), None, exc), None
