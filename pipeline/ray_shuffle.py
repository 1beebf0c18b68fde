"""A shuffle through Ray's object store, never the bucket: the maps are the executor's own tasks
(windowed, named when they fail, killed and retried as any task); each returns its pieces as one
table of rows (pipeline/shuffle_rows.py), the driver builds a Ray Dataset of them from the maps' own
metadata, and Ray Data's hash shuffle (`groupby().map_groups`: object store, spilled to the nodes'
disks) hands each reducer its group. Also here: the warm-up that starts Ray Data's shuffle workers
ahead of the first shuffle, and Ray Data kept quiet on the driver's terminal."""
from __future__ import annotations

import functools
import math
import os
import pickle
import time
from dataclasses import dataclass
from typing import Callable

from infra.errors import UserError
from infra.remote import Stored, importing_ray_data

from .sizing import NodeShape, fit_request, in_flight
from .task_results import ItemCounter, failpoint, task_error, timed, worker_died
from .task_window import Counted, TaskSlots

# how many times a map or a reducer runs before its failure ends the shuffle (a reducer's bound goes
# through Ray Data's deprecated `ray_remote_args`: README, "Layout", what a Ray upgrade must check)
TRIES = 3


@dataclass
class MapOut:
    """A shuffle map's answer: its pieces as one table of rows, stored for Ray Data's hash shuffle
    (`shuffle_rows`), and the table's rows and bytes (what Ray Data would otherwise start a task per
    map to learn; the driver makes its block metadata of them, so a map's worker never imports Ray
    Data: 0.4 s a process)."""
    rows: int
    nbytes: int
    stored: Stored


def _map_pieces(m: int, routes: list[int], fn: Callable, *args) -> MapOut:
    """Runs in the worker (through task_results.timed, as any task): a shuffle's map m, its pieces
    one per route (per reducer)."""
    from .shuffle_rows import pack_pieces

    out = list(fn(*args))
    if len(out) != len(routes):
        raise RuntimeError(f"a map returned {len(out)} pieces for {len(routes)} reducers")
    table = pack_pieces(m, out, routes)
    return MapOut(table.num_rows, table.nbytes, Stored(table))


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


def warm_shuffles(started: list) -> None:
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


def shuffle(executor, map_fn: Callable, calls: list[tuple], n_out: int, reduce_fn: Callable,
            reduce_calls: list[tuple], what: str, num_cpus: float = 1.0, unit: str = "buckets",
            sizes: list[int] | None = None, items_per_worker: int | None = None,
            items: int | None = None, item_unit: str = "URLs") -> list:
    """A shuffle through Ray's object store, never the bucket: `map_fn(*call)` returns `n_out`
    pieces (a sequence), one per reducer; reducer b runs `reduce_fn(*reduce_calls[b], *pieces)`
    with the b-th piece of every map, in map order. The maps are the executor's tasks (windowed,
    failures named as `Executor.run`'s); the pieces move by Ray Data's hash shuffle
    (`groupby().map_groups`, object store with spilling to the nodes' disks), each reducer a group.
    `sizes`, `items_per_worker`: the maps' window as `run`'s (all submitted at once without them:
    Ray schedules them, a CPU each), and the reducers' by the same rule, each taking an equal share
    of the rows. `items` (Executor.shuffle): the reducers count their items to a counter that ends
    each reducer's call. -> the reducers' results, in order."""
    import ray

    from .shuffle_rows import routes as routes_of

    counter = None
    if items is not None:
        counter = ray.remote(num_cpus=0)(ItemCounter).remote()
        reduce_calls = [(*c, counter) for c in reduce_calls]

    if not calls:
        return executor.run(reduce_fn, reduce_calls, what, num_cpus=num_cpus, unit=unit)
    shape = executor.shape()
    cpus = fit_request(num_cpus, 0, shape, what)
    routes = routes_of(n_out)
    remote = ray.remote(num_cpus=cpus, num_returns=2, max_retries=TRIES - 1)(timed)
    limit = in_flight(cpus, shape, sizes, items_per_worker)
    maps = TaskSlots(remote, what, _map_pieces, [(m, routes, map_fn, *c) for m, c in enumerate(calls)], None,
                     limit, lambda c: f"map task {c[0]}", TRIES)
    made = executor.drive(maps, len(calls), f"{what} (map)", cpus, shape, unit="tasks")
    pieces = _dataset_of([m.stored.ref for m in made], [_block_metadata(m.rows, m.nbytes) for m in made])
    share = [math.ceil(sum(sizes) / n_out)] * n_out if sizes is not None else None
    return _reduce(executor, pieces, n_out, reduce_fn, reduce_calls, what, cpus, shape, unit,
                   in_flight(cpus, shape, share, items_per_worker) if share is not None else None,
                   Counted(counter, items, item_unit) if counter is not None else None)


def _reduce(executor, pieces, n_out: int, reduce_fn: Callable, reduce_calls: list[tuple], what: str,
            cpus: float, shape: NodeShape, unit: str, limit: int | None, counted: Counted | None = None) -> list:
    """The reducers of `shuffle`, as groups of Ray Data's hash shuffle over the maps' rows (the
    Dataset `pieces`), grouped by route: a partition each, run through the task window
    (`ReducerSlots`); a reducer's exception said in one line naming it, as `run` says a task's."""
    import ray

    from .shuffle_rows import reduce_group

    with importing_ray_data():
        import ray.data
    groups = pieces.groupby("route", num_partitions=n_out)
    answers = groups.map_groups(functools.partial(reduce_group, what=what, reduce_fn=reduce_fn,
                                                  calls_ref=ray.put(list(reduce_calls)), failpoint=failpoint),
                                batch_format="pyarrow", num_cpus=cpus, max_retries=TRIES - 1,
                                # never wider than the reducers: Ray Data warns users of a window
                                # its input cannot fill (a bucket is one input)
                                compute=ray.data.TaskPoolStrategy(size=min(limit, n_out) if limit else None))
    slots = ReducerSlots(answers, what, n_out)
    return executor.drive(slots, n_out, what, cpus, shape, unit=unit, counted=counted, close=slots.close,
                          on_stall=lambda: executor.check_still_feasible(cpus, 0, what, None))


class ReducerSlots:
    """The task window's slots on Ray Data's execution of a shuffle's reducers: nothing to submit (Ray
    Data runs them); their answers read as it gives them (`iter_batches`), in a thread of its own so
    that the window can say progress and stalls while none comes. A reducer's exception is its answer,
    said in one line; Ray Data's own failure (a node lost past its retries) too."""

    def __init__(self, answers, what: str, n_out: int):
        import queue
        import threading

        self.answers, self.what, self.n_out = answers, what, n_out
        self.got = 0
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="capline-reducers", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        it = iter(self.answers.iter_batches(batch_size=None, batch_format="pyarrow"))
        try:
            for batch in it:
                if self._stop.is_set():
                    return
                self._queue.put((True, batch))
            self._queue.put((True, None))
        except BaseException as err:   # noqa: BLE001 - raised again by the window, in its thread
            self._queue.put((False, err))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def submit(self) -> None:
        pass

    def running(self) -> int:
        return self.n_out - self.got

    def wait(self, timeout: float) -> list:
        import queue

        try:
            ok, batch = self._queue.get(timeout=timeout)
        except queue.Empty:
            return []
        if not ok:
            failure = task_error(batch, self.what, "a reducer" if worker_died(batch) else "reducers", tries=TRIES)
            raise failure from (None if isinstance(failure, UserError) else batch)
        if batch is None:
            missing = self.n_out - self.got
            raise RuntimeError(f"{self.what}: {missing} of {self.n_out} reducers gave no answer")
        return [batch]

    def take(self, batch) -> list[tuple[int, float, float, object]]:
        out = []
        for row in batch.to_pylist():
            if row["error"] is not None:
                raise task_error(pickle.loads(row["error"]), self.what, f"task {row['bucket']}")
            out.append((row["bucket"], row["t0"], row["t1"], pickle.loads(row["result"])))
        self.got += len(out)
        return out

    def close(self, finished: bool) -> None:
        """The reader stopped; unless every reducer answered (a reducer failed, or the cluster cannot
        run them), the rest stop now, before the command goes on (or Ray stops under them)."""
        self._stop.set()
        if not finished:
            _stop_execution(self.answers)
            self._thread.join(timeout=30)
