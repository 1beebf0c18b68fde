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
- what stays in the object store: the data a result stores for later tasks (`infra.remote.Stored`:
  a partition's keys for the stage's key index, the rows a shard plan read for the shard writers) is
  the task's second return; the driver holds its reference, never the data, and nothing reads it
  back from the bucket.

It runs every task through Ray; the driver holds only the calls and the small results. What it
decides with lives beside it: the one loop that keeps calls in flight (`task_window.py`), the
cluster's shape and the sizing rules (`sizing.py`), a task's returns and the wording of its failure
(`task_results.py`), the actor pool of a model's calls (`model_pool.py`), the shuffle
(`ray_shuffle.py`, its rows `shuffle_rows.py`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from infra.errors import UserError

from . import ray_shuffle
from .model_pool import run_pool
from .sizing import NodeShape, fit_request, in_flight
from .task_results import ItemCounter, timed
from .task_window import Counted, TaskSlots, drive, record


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

        thread = threading.Thread(target=ray_shuffle.warm_shuffles, args=(started if started is not None else [],),
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
            return run_pool(self, fn, calls, kwargs, what, cpus, num_gpus, model, shape, describe, unit, quiet)
        remote = ray.remote(num_cpus=cpus, num_gpus=num_gpus or None, max_retries=max_retries, num_returns=2)(timed)
        limit = in_flight(cpus, shape, sizes if sizes is not None else items, items_per_worker)
        counted = None
        if items is not None:
            counted = Counted(ray.remote(num_cpus=0)(ItemCounter).remote(), sum(items), item_unit, items)
            kwargs = [{**(kwargs[i] if kwargs else {}), "progress": counted.counter} for i in range(len(calls))]
        slots = TaskSlots(remote, what, fn, calls, kwargs, limit, describe or (lambda c: ""), max_retries + 1)
        return self.drive(slots, len(calls), what, cpus, shape, unit=unit, quiet=quiet, counted=counted,
                          on_stall=lambda: self.check_still_feasible(cpus, num_gpus, what, setting))

    def drive(self, slots, n_calls: int, title: str, cpus: float, shape: NodeShape, unit: str = "partitions",
              quiet: bool = False, counted: Counted | None = None, on_stall=None, close=None, **more) -> list:
        """The task window (task_window.drive) over `slots`, recorded under `title`; -> the results."""
        t_start = time.time()
        results, intervals = drive(slots, n_calls, title, (lambda m: None) if quiet else self.log, self.poll_seconds,
                                   unit=unit, counted=counted, on_stall=on_stall, close=close)
        if n_calls:
            self.records.append(record(title, n_calls, intervals, t_start, cpus, shape, **more))
        return results

    def shuffle(self, map_fn: Callable, calls: list[tuple], n_out: int, reduce_fn: Callable,
                reduce_calls: list[tuple], what: str, num_cpus: float = 1.0, unit: str = "buckets",
                sizes: list[int] | None = None, items_per_worker: int | None = None,
                items: int | None = None, item_unit: str = "URLs") -> list:
        """A shuffle through Ray's object store (pipeline/ray_shuffle.py): `map_fn(*call)` returns
        `n_out` pieces, reducer b runs `reduce_fn(*reduce_calls[b], *pieces)` with the b-th piece of
        every map, in map order. `items`: how many `item_unit` the reducers work through in all; then
        each reducer's call ends with a counter it adds to as it goes (`ItemCounter`), and the
        progress counts those, with an ETA, not buckets. -> the reducers' results, in order."""
        return ray_shuffle.shuffle(self, map_fn, calls, n_out, reduce_fn, reduce_calls, what, num_cpus, unit,
                                   sizes, items_per_worker, items, item_unit)

    def put(self, obj):
        """`obj` in Ray's object store, once; the reference is what tasks get."""
        from infra.remote import put

        return put(obj)

    def call(self, fn: Callable, *args, what: str, num_cpus: float = 1.0, num_gpus: float = 0.0,
             setting: str | None = None, **kwargs):
        """One task (a model to train, a tokenizer): its result."""
        return self.run(fn, [args], what, num_cpus=num_cpus, num_gpus=num_gpus, quiet=True, setting=setting,
                        kwargs=[kwargs], unit="tasks")[0]

    def check_still_feasible(self, cpus: float, gpus: float, what: str, setting: str | None) -> None:
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
                  pick: tuple | None = None) -> list:
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
