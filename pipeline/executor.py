"""The executor: the one place that decides how capline's work runs on the cluster.

Stages say what to compute (a function and its calls, or a function over partitions); the executor
alone decides
- how many tasks are in flight: from the cluster's CPUs and each task's request, never a fixed
  small number (a stage that runs 2 tasks at a time on 100 nodes is the bug this module exists for);
- what a task asks for: never more CPUs than the largest alive node has (a request no node can meet
  would wait forever), and a request that still cannot be met anywhere (GPUs on a CPU cluster) is
  refused in one line naming the setting, before anything runs;
- reuse: a pure per-partition function whose input and fingerprint an earlier run saw is not run
  again (`map_parts(..., reuse=True)`);
- what is measured: per call of `run`, the tasks, how many ran at once (from the start and end time
  each task reports), and the cluster's CPUs, kept in `records` for the stage's stats;
- how a shuffle moves its pieces: the maps are its own tasks (windowed, named when they fail, reused
  as any task), the pieces then go through Ray Data's hash shuffle (`groupby().map_groups`: object
  store, spilled to the nodes' disks), each reducer one group (`shuffle_rows`);
- what stays in the object store: what a result sets aside for later tasks (its `aside`: a
  partition's keys for the stage's key index, the rows a shard plan read for the shard writers) is
  the task's second return; the driver holds its reference, never the data, and nothing reads it
  back from the bucket.

It runs every task through Ray; the driver holds only the calls and the small results.
"""
from __future__ import annotations

import functools
import math
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Callable

from infra.errors import UserError
from infra.progress import Progress
from infra.remote import importing_ray_data


@dataclass
class NodeShape:
    """What the alive nodes of the cluster declare: total CPUs, the largest node's CPUs and GPUs."""
    cpus: float
    largest_cpus: float
    largest_gpus: float
    nodes: int
    per_node: tuple = ()     # (CPUs, GPUs, memory bytes) of each alive node: how many actors fit

    @classmethod
    def now(cls) -> "NodeShape":
        import ray

        alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        cpus = [r.get("CPU", 0.0) for r in alive] or [1.0]
        gpus = [r.get("GPU", 0.0) for r in alive] or [0.0]
        return cls(cpus=sum(cpus), largest_cpus=max(cpus), largest_gpus=max(gpus), nodes=len(alive),
                   per_node=tuple((r.get("CPU", 0.0), r.get("GPU", 0.0), r.get("memory", 0.0)) for r in alive))


def actors_that_fit(num_cpus: float, num_gpus: float, memory: float, shape: NodeShape) -> int:
    """How many actors asking for `num_cpus`, `num_gpus` and `memory` bytes the alive nodes hold at
    once: each node's room counted on its own (two half-full nodes do not hold one more)."""
    total = 0
    for cpus, gpus, mem in shape.per_node:
        room = [math.floor(cpus / num_cpus + 1e-9) if num_cpus > 0 else 10 ** 6]
        if num_gpus:
            room.append(math.floor(gpus / num_gpus + 1e-9))
        if memory:
            room.append(math.floor(mem / memory))
        total += max(0, min(room))
    return total


CALLS_PER_ACTOR = 8    # the fewest calls a model's actor is started for (Executor._run_pool)


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


def fit_request(num_cpus: float, num_gpus: float, shape: NodeShape, what: str, setting: str | None = None) -> float:
    """The CPUs a task may ask for on this cluster: at most the largest node's. A GPU request that no
    node can meet is a UserError naming `setting`."""
    if num_gpus and num_gpus > shape.largest_gpus:
        where = f"set {setting} to 0 or " if setting else ""
        raise UserError(f"{what}: its tasks ask for {num_gpus:g} GPU(s) and no node of the cluster has "
                        f"{'any' if not shape.largest_gpus else f'more than {shape.largest_gpus:g}'}; "
                        f"{where}add a node with GPUs")
    return min(num_cpus, shape.largest_cpus) if num_cpus > 0 else num_cpus


def in_flight(num_cpus: float, shape: NodeShape, items: list[int] | None = None,
              items_per_worker: int | None = None) -> int:
    """Tasks to keep submitted: every CPU busy, and as many again queued so none waits for the driver.
    With `items_per_worker`, also no more than one task per that many of the `items` (URLs, rows) the
    calls work through: each task Ray starts at once may be a new worker process (seconds of start
    and imports), worth it only for that much work. An append of 80 URLs in 20 shards on a head
    declaring 16 CPUs started 16 processes for 1.2 s of downloads each, 13 s a shard on 2 real cores."""
    per_task = num_cpus if num_cpus > 0 else 0.25
    most = max(2, int(2 * math.ceil(shape.cpus / per_task)))
    if items is not None and items_per_worker:
        return max(1, min(most, math.ceil(sum(items) / items_per_worker)))
    return most


def spans(intervals: list[tuple[float, float]], t_start: float) -> dict:
    """Where a group of tasks' time went: the most running at once, how long the first waited to
    start (worker processes starting, a busy cluster), and the median and longest task."""
    if not intervals:
        return {"at_once": 0}
    took = sorted(t1 - t0 for t0, t1 in intervals)
    return {"at_once": max_overlap(intervals), "first_start_s": round(min(t0 for t0, _ in intervals) - t_start, 3),
            "task_s_median": round(took[len(took) // 2], 3), "task_s_max": round(took[-1], 3)}


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that hold at one instant (an end at t comes before a start at t)."""
    events = sorted([(t0, 1) for t0, _ in intervals] + [(t1, -1) for _, t1 in intervals], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


FAILPOINTS = "CAPLINE_FAILPOINTS"


def _failpoint(what: str) -> None:
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


def _timed(what: str, fn: Callable, *args, **kwargs):
    """Runs in the worker: the result and when it ran (this node's clock), and what the result set
    aside as a second return (`_aside`). The call's arguments stay top-level arguments of the task,
    so Ray resolves any ObjectRef among them (an index put once, a plan's rows set aside)."""
    _failpoint(what)
    t0 = time.time()
    out = fn(*args, **kwargs)
    return (t0, time.time(), out), _aside(out)


ASIDE = "in the object store"    # what a result's `aside` says on its way to the driver


def _aside(out):
    """What a result set aside for later tasks (`out.aside`: a partition's keys, a plan's rows), taken
    off it: the task's second return, which the driver hands on by reference, never fetching it."""
    data = getattr(out, "aside", None)
    if data is None or isinstance(data, str):
        return None
    out.aside = ASIDE
    return data


def _settle(ref) -> None:
    """A failed call's second return holds its error too: read it here, so Ray does not log it as
    an unhandled error when the reference is dropped."""
    import ray

    try:
        ray.get(ref, timeout=10)
    except Exception:   # noqa: BLE001 - the error was the first return's, and is reported from there
        pass


def _with_aside(out, ref):
    """The result as the driver keeps it: its `aside` the reference to the task's second return."""
    if isinstance(getattr(out, "aside", None), str):
        out.aside = ref
    return out


def _map_pieces(what: str, m: int, routes: list[int], fn: Callable, *args):
    """Runs in the worker: a shuffle's map m, its pieces (one per route: per reducer) as one table of
    rows for Ray Data's hash shuffle (`shuffle_rows`), and as the second return when it ran and the
    table's rows and bytes (what Ray Data would otherwise start a task per map to learn; the driver
    makes its block metadata of them, so a map's worker never imports Ray Data: 0.4 s a process)."""
    from .shuffle_rows import pack_pieces

    _failpoint(what)
    t0 = time.time()
    out = list(fn(*args))
    if len(out) != len(routes):
        raise RuntimeError(f"{what}: a map returned {len(out)} pieces for {len(routes)} reducers")
    table = pack_pieces(m, out, routes)
    return table, (t0, time.time(), table.num_rows, table.nbytes)


def _block_metadata(rows: int, nbytes: int):
    """Ray Data's metadata of a map's table (`shuffle_rows.PIECES`), as `BlockMetadataWithSchema.from_block`
    makes it of the table itself (its rows, `nbytes`, the schema)."""
    import dataclasses

    return dataclasses.replace(_empty_block_metadata(), num_rows=rows, size_bytes=nbytes)


@functools.lru_cache(maxsize=1)
def _empty_block_metadata():
    from .shuffle_rows import PIECES

    with importing_ray_data():
        from ray.data.block import BlockMetadataWithSchema

    return BlockMetadataWithSchema.from_block(PIECES.empty_table())


def _dataset_of(tables: list, metadata: list):
    """The maps' tables as one Ray Dataset. `ray.data.from_arrow_refs` starts a task per table to read
    its metadata (2,000 tasks for 2,000 maps, seconds on a small cluster); each map returned its
    own, so the dataset is built from them as from_arrow_refs builds it (Ray 2.60's FromArrow plan)."""
    with importing_ray_data():
        import ray.data
    quiet_ray_data()    # before the context is copied into the dataset
    try:
        with importing_ray_data():
            from ray.data._internal.logical.interfaces import LogicalPlan
            from ray.data._internal.logical.operators.from_operators import FromArrow
            from ray.data._internal.stats import DatasetStats
            from ray.data.context import DataContext
            from ray.data.dataset import MaterializedDataset
    except ImportError:      # another Ray: its public way, a task per table
        return ray.data.from_arrow_refs(tables)
    context = DataContext.get_current().copy()
    # Ray Data reserves half the cluster for its operators in shares, so a shuffle's reducers ran at
    # most 4 at once on 16 CPUs (8 reducers of a CPU); here the reducers are the only operator
    # that computes, and the executor's window (`concurrency`) bounds them
    context.op_resource_reservation_enabled = False
    return MaterializedDataset(LogicalPlan(FromArrow(tables, metadata), context), context,
                               DatasetStats(metadata={"FromArrow": metadata}, parent=None))


def shuffle_worker_envs() -> list[dict]:
    """The runtime environments Ray Data runs its shuffle's map and reduce tasks in (Ray 2.60: an
    environment variable each, so that those tasks get worker processes of their own); [] on a Ray
    that names none."""
    envs = []
    for module, name in (("ray.data._internal.execution.operators.hash_shuffle_v2", "_SHUFFLE_MAP_RUNTIME_ENV"),
                         ("ray.data._internal.execution.operators.shuffle_operators.shuffle_reduce_operator",
                          "_SHUFFLE_REDUCE_RUNTIME_ENV")):
        try:
            with importing_ray_data():
                env = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
        if isinstance(env, dict):
            envs.append(env)
    return envs


def _warm_worker(names: list[str]) -> dict:
    """Runs in a worker of a shuffle's runtime environment: the modules its tasks will need, imported.
    -> its environment's values of `names` (the variables that environment sets)."""
    import ray.data  # noqa: F401

    return {name: os.environ.get(name) for name in names}


def _warm_shuffles(started: list) -> None:
    """Runs in a thread of the driver: Ray Data imported there, a worker started in each runtime
    environment of its shuffle tasks; their references appended to `started`."""
    import ray

    if not ray.is_initialized():        # never one started here
        return
    try:
        envs = shuffle_worker_envs()
        remote = ray.remote(num_cpus=0, max_retries=0)(_warm_worker)
        started.extend(remote.options(runtime_env=env).remote(sorted(env.get("env_vars", {}))) for env in envs)
    except Exception:   # noqa: BLE001 - a head start only: the first shuffle starts what this could not
        pass


class Watched:
    """An iterator that blocks until its next item (Ray Data's `iter_batches`), read in a thread of its
    own so that the reader can do something while none comes: `next()` -> the next item, None when
    none came within `timeout` seconds, `Watched.END` after the last; the iterator's own exception
    raised. `stop()`: the iterator is closed at its next item (or its end), never read further."""

    END = object()

    def __init__(self, items, timeout: float):
        import queue
        import threading

        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._timeout = timeout
        self._thread = threading.Thread(target=self._pump, args=(items,), name="capline-watched", daemon=True)
        self._thread.start()

    def _pump(self, items) -> None:
        it = iter(items)
        try:
            for item in it:
                if self._stop.is_set():
                    return
                self._queue.put((True, item))
            self._queue.put((True, self.END))
        except BaseException as err:   # noqa: BLE001 - raised again by the reader, in its thread
            self._queue.put((False, err))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def next(self):
        import queue

        try:
            ok, item = self._queue.get(timeout=self._timeout)
        except queue.Empty:
            return None
        if not ok:
            raise item
        return item

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """-> whether the iterator is done (ended, failed or closed) within `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _stop_execution(dataset) -> None:
    """Ray Data's execution of `dataset` stopped now (its tasks still running cancelled), from any
    thread: Ray 2.60 keeps the executor of a dataset being iterated on the dataset, to shut it
    down when the dataset is collected. Another Ray: it stops when its iterator is next read."""
    executor = getattr(dataset, "_current_executor", None)
    if executor is not None and hasattr(executor, "shutdown"):
        executor.shutdown(force=True)


def quiet_ray_data() -> None:
    """Ray Data in this driver without its own progress bars and plan printouts: capline says each
    step's progress itself, one line per step."""
    import logging

    with importing_ray_data():
        from ray.data.context import DataContext

    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)   # "Progress bars disabled ..."

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.enable_auto_log_stats = False


@dataclass
class Executor:
    log: Callable[[str], None] = print
    poll_seconds: float = 10.0
    records: list[dict] = field(default_factory=list)   # one per `run`: what, tasks, at once, CPUs

    def warm_shuffles(self, started: list | None = None):
        """Start, without waiting, what a command's first shuffle would otherwise start: Ray Data
        imported in this driver (~0.5 s) and a worker process in each runtime environment Ray Data's
        shuffle tasks run in (~1.4 s each to start and import Ray Data here), in a thread while the
        command goes on. Measured on 2 cores: a command's first shuffle took 3.3 s on warm capline
        workers, 1.1 s after this. A worker Ray reaps as idle before the shuffle only costs that
        shuffle its start, as before. `started` gets the warm-up tasks' references. -> the thread."""
        import threading

        thread = threading.Thread(target=_warm_shuffles, args=(started if started is not None else [],),
                                  name="capline-warm-shuffles", daemon=True)
        thread.start()
        return thread

    def tasks_at_once(self, num_cpus: float, items: list[int] | None = None, items_per_worker: int | None = None) -> int:
        """The most tasks of `num_cpus` that `run` may have running at once: its window (a task
        blocked in ray.get gives its CPU back, and Ray starts a queued one)."""
        return in_flight(num_cpus, self.shape(), items, items_per_worker)

    def shape(self) -> NodeShape:
        return NodeShape.now()

    # -- running tasks -----------------------------------------------------------------------------
    def run(self, fn: Callable, calls: list[tuple], what: str, num_cpus: float = 1.0, num_gpus: float = 0.0,
            describe: Callable[[tuple], str] | None = None, unit: str = "partitions", max_retries: int = 2,
            quiet: bool = False, setting: str | None = None, kwargs: list[dict] | None = None,
            items: list[int] | None = None, item_unit: str = "URLs", model=None,
            items_per_worker: int | None = None, sizes: list[int] | None = None) -> list:
        """`fn(*call)` for every call, in Ray tasks; results in call order. Progress with rate and ETA
        (a bar on a terminal); a stall is reported, not waited out silently; a task's failure names
        it, and a UserError raised in a task is said in one line. `items`: how many `item_unit` each
        call works through; then each call gets `progress=` a counter it adds to as it goes, and the
        progress counts those (a list of one shard still shows its URLs and an ETA);
        `items_per_worker`: no more tasks at once than one per that many items (`in_flight`), counted
        in `sizes` (the work of each call, rows of a partition) when given, else in `items`. `model` (a
        stages.shared_model.SharedModel): the calls run on an actor pool that loads it once per actor."""
        import ray

        shape = self.shape()
        cpus = fit_request(num_cpus, num_gpus, shape, what, setting)
        if model is not None and calls:
            if items is not None:
                raise ValueError(f"{what}: a run on a model's actor pool counts partitions, not items")
            return self._run_pool(fn, calls, kwargs, what, cpus, num_gpus, model, shape, describe, unit, quiet)
        remote = ray.remote(num_cpus=cpus, num_gpus=num_gpus or None, max_retries=max_retries, num_returns=2)(_timed)
        limit = in_flight(cpus, shape, sizes if sizes is not None else items, items_per_worker)
        describe = describe or (lambda c: "")
        total = len(calls)
        results: list = [None] * total
        asides: list = [None] * total
        intervals: list[tuple[float, float]] = []
        pending: dict = {}
        nxt = done = 0
        counter = None
        if items is not None:
            counter = ray.remote(num_cpus=0)(ItemCounter).remote()
            kwargs = [{**(kwargs[i] if kwargs else {}), "progress": counter} for i in range(total)]
            progress = Progress(what, sum(items), (lambda m: None) if quiet else self.log, unit=item_unit)
        else:
            progress = Progress(what, total, (lambda m: None) if quiet else self.log, unit=unit)
        counted = finished = 0
        last_done = time.time()
        t_start = time.time()
        while done < total:
            while nxt < total and len(pending) < limit:
                ref, asides[nxt] = remote.remote(what, fn, *calls[nxt], **(kwargs[nxt] if kwargs else {}))
                pending[ref] = nxt
                nxt += 1
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=2.0 if counter else self.poll_seconds)
            if counter is not None:
                now_counted = min(progress.total, ray.get(counter.get.remote()))
                if now_counted > counted:
                    counted, last_done = now_counted, time.time()
                    progress.update(counted)
                if not ready and time.time() - last_done < self.poll_seconds:
                    continue
            if not ready:
                progress.stalled(time.time() - last_done, len(pending))
                self._check_still_feasible(cpus, num_gpus, what, setting)
                continue
            for ref in ready:
                i = pending.pop(ref)
                try:
                    t0, t1, out = ray.get(ref)
                    results[i] = _with_aside(out, asides[i])
                except Exception as err:
                    progress.close()
                    _settle(asides[i])
                    failure = _task_error(err, what, describe(calls[i]) or f"task {i}")
                    raise failure from (None if isinstance(failure, UserError) else err)
                intervals.append((t0, t1))
                done += 1
                last_done = time.time()
                if counter is None:
                    progress.update(done)
                else:
                    finished += items[i]        # what finished tasks did, whatever their reports said
                    counted = max(counted, min(progress.total, finished))
                    progress.update(counted)
        progress.close()
        if total:
            self.records.append({"what": what, "tasks": total, **spans(intervals, t_start),
                                 "cpus_per_task": cpus, "cluster_cpus": shape.cpus, "nodes": shape.nodes,
                                 "seconds": round(time.time() - t_start, 3)})
        return results

    def _run_pool(self, fn: Callable, calls: list[tuple], kwargs: list[dict] | None, what: str, cpus: float,
                  gpus: float, model, shape: NodeShape, describe: Callable | None, unit: str, quiet: bool) -> list:
        """`run` on an actor pool: each actor loads `model` once (its constructor), then runs calls,
        two queued at a time so it never waits for the driver; the pool has as many actors as the
        nodes hold (CPUs, GPUs, the model's declared memory), one for CALLS_PER_ACTOR calls at most. A
        failed call is named as `run` names it; a killed actor is restarted (its model loaded
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
                           max_restarts=-1, max_task_retries=0)(_PoolWorker)
        actors = [actor.remote(what, fn, model.load, *model.args) for _ in range(size)]
        progress = Progress(what, len(calls), (lambda m: None) if quiet else self.log, unit=unit)
        describe = describe or (lambda c: "")
        results: list = [None] * len(calls)
        intervals: list[tuple[float, float]] = []
        pending: dict = {}                      # call's ref -> (call index, actor index)
        queue = PoolQueue(len(calls), size)
        t_start, last_done = time.time(), time.time()

        asides: list = [None] * len(calls)

        def send(i: int, a: int) -> None:
            ref, asides[i] = actors[a].call.options(num_returns=2).remote(*calls[i], **(kwargs[i] if kwargs else {}))
            pending[ref] = (i, a)

        try:
            while len(intervals) < len(calls):
                for a in range(size):
                    while (i := queue.next_for(a)) is not None:
                        send(i, a)
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=self.poll_seconds)
                if not ready:
                    progress.stalled(time.time() - last_done, len(pending))
                    continue
                for ref in ready:
                    i, a = pending.pop(ref)
                    queue.returned(i, a)
                    try:
                        t0, t1, out, err = ray.get(ref)
                    except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError) as died:
                        _settle(asides[i])
                        if "creation task" in str(died):      # restarts are unlimited: its model never loaded
                            err, label = died, f"loading {model.name}"
                        elif "is restarting" in str(died):    # sent while it came back: not a try
                            time.sleep(0.2)
                            queue.resend(i)
                            continue
                        elif not queue.died(i):               # its actor was killed: again, once it is back
                            continue
                        else:
                            err = died
                            label = f"{describe(calls[i]) or f'task {i}'} (its actor died 3 times running it: out of memory?)"
                    except Exception as lost:    # noqa: BLE001 - a result lost with its node: said as a task's is
                        _settle(asides[i])
                        err, label = lost, describe(calls[i]) or f"task {i}"
                    else:
                        label = describe(calls[i]) or f"task {i}"
                    if err is not None:
                        progress.close()
                        failure = _task_error(err, what, label)
                        raise failure from (None if isinstance(failure, UserError) else err)
                    results[i] = _with_aside(out, asides[i])
                    intervals.append((t0, t1))
                    last_done = time.time()
                    progress.update(len(intervals))
        finally:
            for a in actors:
                ray.kill(a, no_restart=True)
        progress.close()
        self.records.append({"what": what, "tasks": len(calls), **spans(intervals, t_start),
                             "cpus_per_task": cpus, "cluster_cpus": shape.cpus, "nodes": shape.nodes,
                             "actors": size, "model": model.name, "seconds": round(time.time() - t_start, 3)})
        return results

    def shuffle(self, map_fn: Callable, calls: list[tuple], n_out: int, reduce_fn: Callable,
                reduce_calls: list[tuple], what: str, num_cpus: float = 1.0, unit: str = "buckets",
                sizes: list[int] | None = None, items_per_worker: int | None = None) -> list:
        """A shuffle through Ray's object store, never the bucket: `map_fn(*call)` returns `n_out`
        pieces (a sequence), one per reducer; reducer b runs `reduce_fn(*reduce_calls[b], *pieces)`
        with the b-th piece of every map, in map order. The maps are this executor's tasks (windowed,
        failures named as `run`'s); the pieces move by Ray Data's hash shuffle
        (`groupby().map_groups`, object store with spilling to the nodes' disks), each reducer a group.
        `sizes`, `items_per_worker`: the maps' window as `run`'s (all submitted at once without them:
        Ray schedules them, a CPU each), and the reducers' by the same rule, each taking an equal share
        of the rows. -> the reducers' results, in order."""
        import ray

        from .shuffle_rows import routes as routes_of

        if not calls:
            return self.run(reduce_fn, reduce_calls, what, num_cpus=num_cpus, unit=unit)
        shape = self.shape()
        cpus = fit_request(num_cpus, 0, shape, what)
        routes = routes_of(n_out)
        remote = ray.remote(num_cpus=cpus, num_returns=2, max_retries=2)(_map_pieces)
        limit = in_flight(cpus, shape, sizes, items_per_worker) if sizes is not None else len(calls)
        t0 = time.time()
        tables: list = [None] * len(calls)
        metadata: list = [None] * len(calls)
        nxt = 0
        progress = Progress(f"{what} (map)", len(calls), self.log, unit="tasks")
        intervals, pending = [], {}
        while nxt < len(calls) or pending:
            while nxt < len(calls) and len(pending) < limit:
                tables[nxt], timing = remote.remote(what, nxt, routes, map_fn, *calls[nxt])
                pending[timing] = nxt
                nxt += 1
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=self.poll_seconds)
            if not ready:
                progress.stalled(time.time() - t0, len(pending))
                continue
            for ref in ready:
                i = pending.pop(ref)
                try:
                    start, end, rows, nbytes = ray.get(ref)
                    metadata[i] = _block_metadata(rows, nbytes)
                    intervals.append((start, end))
                except Exception as err:
                    progress.close()
                    _settle(tables[i])
                    failure = _task_error(err, what, f"map task {i}")
                    raise failure from (None if isinstance(failure, UserError) else err)
                progress.update(len(intervals))
        progress.close()
        self.records.append({"what": f"{what} (map)", "tasks": len(calls), **spans(intervals, t0),
                             "cpus_per_task": cpus, "cluster_cpus": shape.cpus, "nodes": shape.nodes,
                             "seconds": round(time.time() - t0, 3)})
        share = [math.ceil(sum(sizes) / n_out)] * n_out if sizes is not None else None
        return self._reduce(_dataset_of(tables, metadata), n_out, reduce_fn, reduce_calls, what, cpus, shape, unit,
                            in_flight(cpus, shape, share, items_per_worker) if share is not None else None)

    def _reduce(self, pieces, n_out: int, reduce_fn: Callable, reduce_calls: list[tuple], what: str,
                cpus: float, shape: NodeShape, unit: str, limit: int | None) -> list:
        """The reducers of `shuffle`, as groups of Ray Data's hash shuffle over the maps' rows (the
        Dataset `pieces`), grouped by route: a partition each; a reducer's exception said in one
        line naming it, as `run` says a task's."""
        import ray

        from .shuffle_rows import reduce_group

        with importing_ray_data():
            import ray.data
        t0 = time.time()
        groups = pieces.groupby("route", num_partitions=n_out)
        answers = groups.map_groups(functools.partial(reduce_group, what=what, reduce_fn=reduce_fn,
                                                      calls_ref=ray.put(list(reduce_calls)), failpoint=_failpoint),
                                    batch_format="pyarrow", num_cpus=cpus, max_retries=2,
                                    # never wider than the reducers: Ray Data warns users of a window
                                    # its input cannot fill (a bucket is one input)
                                    compute=ray.data.TaskPoolStrategy(size=min(limit, n_out) if limit else None))
        results: dict[int, object] = {}
        intervals: list[tuple[float, float]] = []
        progress = Progress(what, n_out, self.log, unit=unit)
        failed = None
        watched = Watched(answers.iter_batches(batch_size=None, batch_format="pyarrow"), self.poll_seconds)
        last = time.time()
        ended = False
        try:
            while (batch := watched.next()) is not Watched.END:
                if batch is None:          # nothing answered for a while: said, and the cluster checked
                    progress.stalled(time.time() - last, n_out - len(results))
                    self._check_still_feasible(cpus, 0, what, None)
                    continue
                for row in batch.to_pylist():
                    if row["error"] is not None:
                        failed = _task_error(pickle.loads(row["error"]), what, f"task {row['bucket']}")
                        break
                    results[row["bucket"]] = pickle.loads(row["result"])
                    intervals.append((row["t0"], row["t1"]))
                if failed is not None:
                    break
                last = time.time()
                progress.update(len(intervals))
            else:
                ended = True
        except UserError:
            raise
        except Exception as err:   # Ray Data's own failure (a node lost past its retries): said in one line
            failure = _task_error(err, what, "reducers")
            raise failure from (None if isinstance(failure, UserError) else err)
        finally:
            watched.stop()
            if not ended:           # a reducer failed, or the cluster cannot run them: the rest stop now,
                _stop_execution(answers)       # before the command goes on (or Ray stops under them)
                watched.join(timeout=30)
            progress.close()
        if failed is not None:
            raise failed
        if len(results) != n_out:
            missing = sorted(set(range(n_out)) - set(results))
            raise RuntimeError(f"{what}: {len(missing)} of {n_out} reducers gave no answer (buckets {missing[:5]})")
        self.records.append({"what": what, "tasks": n_out, **spans(intervals, t0), "cpus_per_task": cpus,
                             "cluster_cpus": shape.cpus, "nodes": shape.nodes, "seconds": round(time.time() - t0, 3)})
        return [results[b] for b in range(n_out)]

    def put(self, obj):
        """`obj` in Ray's object store, once; the reference is what tasks get."""
        from infra.remote import put

        return put(obj)

    def dataset(self, files: list[str], fs, equal: dict, columns: list[str] | None = None):
        """Parquet files as a Ray Dataset, rows whose columns equal `equal`'s values, `columns` kept."""
        with importing_ray_data():
            import ray.data
            from ray.data.expressions import col

        ds = ray.data.read_parquet(files, filesystem=fs)
        for name, value in equal.items():
            ds = ds.filter(expr=col(name) == value)
        return ds.select_columns(columns) if columns else ds

    def call(self, fn: Callable, *args, what: str, num_cpus: float = 1.0, num_gpus: float = 0.0,
             setting: str | None = None, **kwargs):
        """One task (a model to train, a tokenizer): its result."""
        return self.run(fn, [args], what, num_cpus=num_cpus, num_gpus=num_gpus, quiet=True, setting=setting,
                        kwargs=[kwargs], unit="tasks")[0]

    def _check_still_feasible(self, cpus: float, gpus: float, what: str, setting: str | None) -> None:
        """While nothing finishes: a node may have gone, leaving the request larger than any node."""
        shape = self.shape()
        if cpus > shape.largest_cpus or (gpus and gpus > shape.largest_gpus):
            raise UserError(f"{what}: its tasks ask for {cpus:g} CPU(s){f' and {gpus:g} GPU(s)' if gpus else ''} "
                            f"and no alive node has that much now ({shape.nodes} nodes, largest "
                            f"{shape.largest_cpus:g} CPUs, {shape.largest_gpus:g} GPUs)"
                            + (f"; lower {setting} or add a larger node" if setting else "; add a larger node"))

    # -- per-partition functions -----------------------------------------------------------------
    def map_parts(self, ctx, fn: Callable, tasks: list, num_cpus: float = 1.0, num_gpus: float = 0.0,
                  what: str | None = None, reuse: bool = False, setting: str | None = None, model=None,
                  pick: tuple | None = None) -> list[dict]:
        """`fn` over partitions (stages/dataplane.py: PartTask), in tasks that write their own results;
        -> PartResults. `reuse` (a pure function of the partition and the stage's config): a partition
        whose input and the stage's fingerprint are those of an earlier run is taken as it is, even
        when other partitions changed (a scheduled run that appended a URL list file). `pick`
        (per_reason, seed, cut): each task picks the examples page's samples from the rows it wrote."""
        from stages.dataplane import REUSE, PartResult, reuse_key, reused_or_run, run_part

        what = what or ctx.name
        label = lambda c: f"partition {c[3].part}"   # noqa: E731
        if not reuse:
            return self.run(run_part, [(ctx.storage, ctx.name, fn, t, None, None, ctx.notes, pick) for t in tasks], what, num_cpus=num_cpus,
                            num_gpus=num_gpus, describe=label, setting=setting, model=model)
        # the one reuse mechanism (stages/dataplane.reused_or_run), keyed by the partition's input
        # and the stage's fingerprint, its records under <stage>/_reuse
        results, _ = reused_or_run(
            ctx, run_part, f"{ctx.name}/{REUSE}", lambda t: reuse_key(ctx.fingerprint, t),
            lambda t, out: (ctx.storage, ctx.name, fn, t, f"{out}.parquet" if out else None,
                            f"{out}.json" if out else None, ctx.notes, pick),
            what, "unchanged since an earlier run", "compute", items=tasks, encode=PartResult.to_json,
            decode=PartResult.from_json, num_cpus=num_cpus, num_gpus=num_gpus, describe=label, setting=setting,
            model=model)
        return results


class _PoolWorker:
    """An actor of a model's pool (Executor._run_pool): the model loaded once, in the constructor;
    then calls. A call's exception comes back as its result, so the driver names the partition that
    failed as a task's failure is named."""

    def __init__(self, what: str, fn: Callable, load: Callable | None, *args):
        self.what, self.fn = what, fn
        if load is not None:
            load(*args)

    def call(self, *args, **kwargs):
        _failpoint(self.what)
        t0 = time.time()
        try:
            out = self.fn(*args, **kwargs)
            return (t0, time.time(), out, None), _aside(out)
        except Exception as exc:       # noqa: BLE001 - reported by the driver, naming the call
            try:
                import ray

                exc.ip = ray.util.get_node_ip_address()    # a node the bucket refused is named
            except Exception:          # noqa: BLE001 - an exception that takes no attributes
                pass
            return (t0, time.time(), None, exc), None


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


def _task_error(err: Exception, what: str, label: str) -> Exception:
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
    return RuntimeError(f"{what}: {label} failed: {type(err).__name__}: "
                        f"{text.splitlines()[-1][:300] if text else ''}")
