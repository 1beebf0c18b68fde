"""The stage contract.

A stage declares its `name`, its config `section`, a `preflight` (checks that need no cluster), a
`fingerprint` (what besides the previous stage's output decides its result) and `run(ctx)`. It
reads the previous stage's kept samples through `ctx` (`ctx.upstream`: that stage's partitions;
`ctx.map_parts`: a Ray task per partition), and
other stages' outputs only through the artifacts they registered (`ctx.artifact`). Its per-sample
results are partitions written by the workers (stages/dataplane.py); `run` returns their
PartResults, never rows. The runner (pipeline/runner.py) checks in = kept + dropped from those,
writes `parts.json`, `stats.json` and, last, `_SUCCESS`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from .dataplane import DROPPED, KEPT, PartResult, PartTask, Storage, one_to_one  # noqa: F401 - re-exported


@dataclass
class StageContext:
    """What a stage gets: its own config section (`cfg`), the seed and run name, its input (the
    previous judging stage's partitions), the artifacts earlier stages registered, and the executor.
    Never the whole run config: stages meet through the registry and artifacts, not each other's
    sections."""
    name: str                        # this stage
    run_dir: Path                    # the driver's working copy of the run folder
    stage_dir: Path
    cfg: Any                         # this stage's config section (Stage.section)
    seed: int
    run_name: str
    storage: Storage                 # the run folder's filesystem, as workers reach it
    upstream: list[PartResult] | None  # the previous judging stage's PartResults (None for the first stage)
    artifacts: dict[str, dict] = field(default_factory=dict)   # finished stages' registered outputs
    log: Callable[[str], None] = print
    fingerprint: str = ""            # this stage's (Stage.fingerprint): with a partition's input, what decides it
    executor: Any = None             # pipeline/executor.py: how tasks run (stages never import pipeline/)
    notes: tuple = (None, None)      # what this stage's score and detail are called in a kept sample's json

    def map_parts(self, fn: Callable, tasks: list[PartTask] | None = None, num_cpus: float = 1.0,
                  num_gpus: float = 0.0, reuse: bool = False, setting: str | None = None, model=None,
                  pick: tuple | None = None, **kwargs) -> list[PartResult]:
        """`fn(table, **kwargs) -> (verdicts, extra)` over each partition (default: one task per
        upstream partition, same name), in Ray tasks that write their own part files. `reuse`: for a
        pure `fn`, partitions computed by an earlier run from the same input are taken as they are.
        `model` (stages/shared_model.py): the partitions run on an actor pool that loads it once per actor.
        `pick` (per_reason, cut): each task picks the stage's examples from the rows it writes."""
        return self.executor.map_parts(self, fn, tasks if tasks is not None else one_to_one(self.upstream or [], **kwargs),
                                       num_cpus=num_cpus, num_gpus=num_gpus, reuse=reuse, setting=setting,
                                       model=model, pick=(pick[0], self.seed, pick[1]) if pick else None)

    def run(self, fn: Callable, calls: list[tuple], what: str | None = None, **options) -> list:
        """`fn(*call)` for every call, in tasks the executor sizes and runs; results in call order."""
        return self.executor.run(fn, calls, what or self.name, **options)

    def call(self, fn: Callable, *args, what: str | None = None, **options):
        """One task's result (a model to train): the executor fits its request to the cluster."""
        return self.executor.call(fn, *args, what=what or self.name, **options)

    def put(self, obj):
        """`obj` in Ray's object store once: a reference every task on a node reads without a copy."""
        return self.executor.put(obj)

    def shuffle(self, map_fn: Callable, calls: list[tuple], n_out: int, reduce_fn: Callable,
                reduce_calls: list[tuple], what: str | None = None, **options) -> list:
        """Map pieces to `n_out` reducers through Ray's object store (Executor.shuffle)."""
        return self.executor.shuffle(map_fn, calls, n_out, reduce_fn, reduce_calls, what or self.name, **options)

    def cluster_cpus(self) -> float:
        """The CPUs the alive nodes declare now: how many tasks a stage's reduce side can keep busy."""
        return self.executor.shape().cpus

    def artifact(self, stage: str, key: str) -> str:
        """A file another stage registered (its StageResult.artifacts): its path in `storage`."""
        try:
            return self.artifacts[stage][key]
        except KeyError:
            raise RuntimeError(f"{self.name}: stage {stage} registered no artifact {key!r}") from None

    @property
    def n_in(self) -> int:
        return sum(u.kept for u in self.upstream or [])


@dataclass
class StageResult:
    parts: list[PartResult]                              # PartResults, one per partition written
    extra_stats: dict = field(default_factory=dict)
    artifacts: dict = field(default_factory=dict)        # recorded in manifest.json (paths, checksums)
    files: dict = field(default_factory=dict)            # other outputs: run-relative path -> sha256
    consumed: tuple[int, int] | None = None              # a sink: (samples read, their key-set checksum)


KINDS = ("source", "filter", "decide", "sink")


class Stage:
    """What every kind declares. The registry (stages/registry.py) is the one list of stages; the
    runner, config, report, dataset card, audit and observers read these declarations."""

    name: str = ""
    kind: str = ""                       # one of KINDS
    config_key: str | None = None        # its section: `stages.<config_key>` (None: a top-level section)
    config_class: type | None = None
    reasons: tuple[str, ...] = ()        # the drop reasons it gives (a `reason:<x>` family by its prefix)
    report: str | None = None            # its report page, run-relative
    notes: tuple[str | None, str | None] | None = None   # its score and detail in a kept sample's json
    audits: tuple[tuple[str, str], ...] = ()   # (demo defect, the reason prefix that catches it)
    thresholds: bool = False             # its section is a filter's thresholds (the dataset card lists them)
    final_data: bool = False             # it writes the dataset (observers of a finished dataset wait for it)
    trains: bool = False                 # it runs Ray Train (a local cluster then starts Ray's dashboard)
    # a sink that reads only the last judge's samples, none of the sinks run since (the shard stage
    # never reads the tokenizer): it runs beside the sink before it, and its input leaves that out
    reads_sinks_before: bool = True
    preserve: tuple[str, ...] = ()       # sub-paths of its folder that survive a change of input
    # its scores fall on one axis the run report draws as a histogram, with these settings of its
    # section as the cuts (None: no such axis, e.g. basic's lengths and ratios)
    score_cuts: tuple[str, ...] | None = None
    # a run stops after this stage when it keeps nothing, or when this share of its input is
    # dropped for one reason (None: only when it keeps nothing); `remedies` names the setting to
    # change for a reason (its prefix), in that stop's one line
    dead_end_share: float | None = None
    remedies: dict[str, str] = {}

    def section(self, config) -> Any:
        if self.config_key is None:
            raise NotImplementedError
        return getattr(config.stages, self.config_key)

    def dead_end(self, counts: dict) -> str | None:
        """Why the run cannot go on after this stage's counts (in, kept, dropped by reason), or None."""
        n, dropped = counts.get("in", 0), counts.get("dropped", {})
        if not n or not dropped:
            return None
        reason, most = max(dropped.items(), key=lambda kv: kv[1])
        if counts.get("kept", 0) > 0 and (self.dead_end_share is None or most < self.dead_end_share * n):
            return None
        fix = next((v for k, v in self.remedies.items() if reason == k or reason.startswith(k + ":")), None)
        what = "kept nothing" if not counts.get("kept") else f"dropped {most} of {n} ({100 * most / n:.0f}%) as {reason}"
        return (f"{self.name} {what}" + (f" (most as {reason}: {most} of {n})" if not counts.get("kept") else "")
                + (f"; {fix}" if fix else f"; see `capline explain` for a sample, and {self.report or 'its ledger'}")
                + "; the run stops here rather than run the later stages on this")

    def cut_lines(self, section: dict, stats: dict) -> list[tuple[str, float | None]]:
        """(label, score) of each cut the run report draws on this stage's score histogram."""
        return [(name, section.get(name)) for name in self.score_cuts or ()]

    def declares(self, section) -> dict:
        """Artifacts that follow from the stage's config alone (registered whether it runs or is
        skipped): what a later stage needs of this one's settings, typed, instead of its section."""
        return {}

    def note_names(self) -> tuple[str | None, str | None]:
        return self.notes if self.notes is not None else (f"{self.name}_score", f"{self.name}_detail")

    def preflight(self, config) -> None:
        """Checks that need no cluster (bad paths, unknown codes): fail in a second, not mid-run."""

    def complete(self, config, stats: dict) -> bool:
        """Whether a finish with the same fingerprint (its stats.json: `stats`) is all that `config`
        asks: a stage with a how-setting that can ask for more (train.steps) says no."""
        return True

    def fingerprint(self, config) -> str:
        """What, besides the upstream output, decides this stage's result (JSON text): its section less
        the settings it declares as how the work runs (`HOW`)."""
        section = self.section(config)
        data = deciding(section) if dataclasses.is_dataclass(section) else section
        return json.dumps({"stage": self.name, "section": data, "seed": config.seed}, sort_keys=True)

    def run(self, ctx: StageContext) -> StageResult:
        raise NotImplementedError


def deciding(section) -> dict:
    """A config section as a dict, without the settings its class names in `HOW`."""
    how = set(getattr(type(section), "HOW", ()))
    return {k: v for k, v in dataclasses.asdict(section).items() if k not in how}


class Source(Stage):
    """Rows in (a URL list, images), keyed samples out, each with a verdict."""
    kind = "source"


class Filter(Stage):
    """A verdict per sample, from the sample alone: `judge(table, cfg) -> (verdicts, extra)`, a pure
    function the executor maps over partitions (reusing partitions an earlier run judged from the
    same input), writing the ledger and counting. `finish` turns the parts into stats and a report."""
    kind = "filter"
    thresholds = True
    preserve = ("reuse", "examples")      # partitions judged, and their examples picked, before: by content

    @staticmethod
    def judge(table, cfg):
        raise NotImplementedError

    def cpus(self, cfg) -> float:
        return float(getattr(cfg, "cpus_per_worker", 1.0))

    def example_cut(self, cfg) -> float | None:
        """The score its examples page shows samples nearest to (None: in a seeded order)."""
        return None

    def model(self, cfg):
        """The model `judge` needs (a stages.shared_model.SharedModel), loaded once per actor of a
        pool; None: `judge` needs none and runs as plain tasks."""
        return None

    def run(self, ctx: StageContext) -> StageResult:
        per_reason = int(getattr(ctx.cfg, "examples_per_reason", 0) or 0)
        parts = ctx.map_parts(type(self).judge, num_cpus=self.cpus(ctx.cfg), reuse=True, model=self.model(ctx.cfg),
                              pick=(per_reason, self.example_cut(ctx.cfg)) if per_reason else None, cfg=ctx.cfg)
        return self.finish(ctx, parts)

    def finish(self, ctx: StageContext, parts: list[PartResult]) -> StageResult:
        return StageResult(parts)


class Decide(Stage):
    """A verdict per sample that depends on all samples: the workers compute a statistic
    (`measure`: candidate pairs, scores), the driver makes one small decision from it (`decide`:
    clusters' keepers, a cut), the workers write the verdicts (`apply`). Nothing per-sample reaches
    the driver beyond what the decision needs."""
    kind = "decide"
    thresholds = True

    def measure(self, ctx: StageContext):
        raise NotImplementedError

    def decide(self, ctx: StageContext, measured):
        raise NotImplementedError

    def apply(self, ctx: StageContext, measured, decision) -> StageResult:
        raise NotImplementedError

    def run(self, ctx: StageContext) -> StageResult:
        measured = self.measure(ctx)
        return self.apply(ctx, measured, self.decide(ctx, measured))


class Sink(Stage):
    """Consumes the kept samples and writes artifacts (a tokenizer, shards, a model, an evaluation).
    It writes no ledger of its own unless it places samples (the shard stage's index of samples to
    shards); the runner checks what it says it consumed against what the stages before it kept."""
    kind = "sink"


def _as_storage(where) -> Storage:
    return where if isinstance(where, Storage) else Storage.local(where)


def read_ledger(where, stage: str, columns: list[str] | None = None, filters=None) -> pa.Table:
    """A finished stage's ledger: all its partitions (for tools that inspect a run, not for stages).
    `where`: the run folder's Storage, or a local run folder."""
    storage = _as_storage(where)
    parts = storage.read_json(f"{stage}/parts.json")
    if parts is not None:
        files = [p["file"] for p in parts]   # the file's JSON: tools read a finished run
    else:   # a stage still running: what its workers have written so far
        files = storage.list(f"{stage}/ledger", ".parquet")
    if not files:
        from .dataplane import SAMPLE_SCHEMA

        schema = SAMPLE_SCHEMA if columns is None else pa.schema([SAMPLE_SCHEMA.field(c) for c in columns])
        return schema.empty_table()
    return pq.read_table([storage.path(f) for f in files], columns=columns, filters=filters,
                         filesystem=storage.fs)


def has_ledger(where, stage: str) -> bool:
    storage = _as_storage(where)
    return storage.exists(f"{stage}/parts.json") or bool(storage.list(f"{stage}/ledger", ".parquet"))
