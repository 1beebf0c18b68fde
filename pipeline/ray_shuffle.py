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
from typing import Callable

from infra.errors import UserError
from infra.progress import Progress
from infra.remote import importing_ray_data

from .sizing import NodeShape, fit_request, in_flight, spans
from .task_results import ItemCounter, failpoint, settle, task_error, worker_died

# how many times a map or a reducer runs before its failure ends the shuffle (a reducer's bound goes
# through Ray Data's deprecated `ray_remote_args`: README, "Layout", what a Ray upgrade must check)
TRIES = 3


def _map_pieces(what: str, m: int, routes: list[int], fn: Callable, *args):
    """Runs in the worker: a shuffle's map m, its pieces (one per route: per reducer) as one table of
    rows for Ray Data's hash shuffle (`shuffle_rows`), and as the second return when it ran and the
    table's rows and bytes (what Ray Data would otherwise start a task per map to learn; the driver
    makes its block metadata of them, so a map's worker never imports Ray Data: 0.4 s a process)."""
    from .shuffle_rows import pack_pieces

    failpoint(what)
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
    remote = ray.remote(num_cpus=cpus, num_returns=2, max_retries=TRIES - 1)(_map_pieces)
    limit = in_flight(cpus, shape, sizes, items_per_worker) if sizes is not None else len(calls)
    t0 = time.time()
    tables: list = [None] * len(calls)
    metadata: list = [None] * len(calls)
    nxt = 0
    progress = Progress(f"{what} (map)", len(calls), executor.log, unit="tasks")
    intervals, pending = [], {}
    while nxt < len(calls) or pending:
        while nxt < len(calls) and len(pending) < limit:
            tables[nxt], timing = remote.remote(what, nxt, routes, map_fn, *calls[nxt])
            pending[timing] = nxt
            nxt += 1
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=executor.poll_seconds)
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
                settle(tables[i])
                failure = task_error(err, what, f"map task {i}", tries=TRIES)
                raise failure from (None if isinstance(failure, UserError) else err)
            progress.update(len(intervals))
    progress.close()
    executor.records.append({"what": f"{what} (map)", "tasks": len(calls), **spans(intervals, t0),
                             "cpus_per_task": cpus, "cluster_cpus": shape.cpus, "nodes": shape.nodes,
                             "seconds": round(time.time() - t0, 3)})
    share = [math.ceil(sum(sizes) / n_out)] * n_out if sizes is not None else None
    return _reduce(executor, _dataset_of(tables, metadata), n_out, reduce_fn, reduce_calls, what, cpus, shape, unit,
                   in_flight(cpus, shape, share, items_per_worker) if share is not None else None,
                   (counter, items, item_unit) if counter is not None else None)


def _reduce(executor, pieces, n_out: int, reduce_fn: Callable, reduce_calls: list[tuple], what: str,
            cpus: float, shape: NodeShape, unit: str, limit: int | None, counted: tuple | None = None) -> list:
    """The reducers of `shuffle`, as groups of Ray Data's hash shuffle over the maps' rows (the
    Dataset `pieces`), grouped by route: a partition each; a reducer's exception said in one
    line naming it, as `run` says a task's. `counted` (counter, items, unit): the progress counts
    the reducers' items, read from the counter every 2 s, and a stall is one of those too."""
    import ray

    from .shuffle_rows import reduce_group

    with importing_ray_data():
        import ray.data
    t0 = time.time()
    groups = pieces.groupby("route", num_partitions=n_out)
    answers = groups.map_groups(functools.partial(reduce_group, what=what, reduce_fn=reduce_fn,
                                                  calls_ref=ray.put(list(reduce_calls)), failpoint=failpoint),
                                batch_format="pyarrow", num_cpus=cpus, max_retries=TRIES - 1,
                                # never wider than the reducers: Ray Data warns users of a window
                                # its input cannot fill (a bucket is one input)
                                compute=ray.data.TaskPoolStrategy(size=min(limit, n_out) if limit else None))
    results: dict[int, object] = {}
    intervals: list[tuple[float, float]] = []
    counter, items, item_unit = counted or (None, None, None)
    progress = (Progress(what, items, executor.log, unit=item_unit) if counter is not None
                else Progress(what, n_out, executor.log, unit=unit))
    failed = None
    watched = Watched(answers.iter_batches(batch_size=None, batch_format="pyarrow"),
                      2.0 if counter is not None else executor.poll_seconds)
    last = time.time()
    ended = False
    done_items = 0
    try:
        while (batch := watched.next()) is not Watched.END:
            if counter is not None:
                now_done = min(items, ray.get(counter.get.remote()))
                if now_done > done_items:
                    done_items, last = now_done, time.time()
                    progress.update(done_items)
                if batch is None and time.time() - last < executor.poll_seconds:
                    continue
            if batch is None:          # nothing answered for a while: said, and the cluster checked
                progress.stalled(time.time() - last, n_out - len(results))
                executor.check_still_feasible(cpus, 0, what, None)
                continue
            for row in batch.to_pylist():
                if row["error"] is not None:
                    failed = task_error(pickle.loads(row["error"]), what, f"task {row['bucket']}")
                    break
                results[row["bucket"]] = pickle.loads(row["result"])
                intervals.append((row["t0"], row["t1"]))
            if failed is not None:
                break
            last = time.time()
            if counter is None:
                progress.update(len(intervals))
        else:
            ended = True
    except UserError:
        raise
    except Exception as err:   # Ray Data's own failure (a node lost past its retries): said in one line
        failure = task_error(err, what, "a reducer" if worker_died(err) else "reducers", tries=TRIES)
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
    executor.records.append({"what": what, "tasks": n_out, **spans(intervals, t0), "cpus_per_task": cpus,
                             "cluster_cpus": shape.cpus, "nodes": shape.nodes, "seconds": round(time.time() - t0, 3)})
    return [results[b] for b in range(n_out)]
