"""The stage contract.

A stage declares its `name`, its config `section`, a `preflight` (checks that need no cluster), a
`fingerprint` (what besides the previous stage's output decides its result) and `run(ctx)`. It
reads the previous stage's kept samples through `ctx` (`ctx.upstream`: that stage's partitions;
`ctx.map_parts`: a Ray task per partition; `ctx.samples()`: the same rows as a Ray Dataset), and
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

from .dataplane import DROPPED, KEPT, PartTask, Storage, map_parts, one_to_one  # noqa: F401 - re-exported


@dataclass
class StageContext:
    name: str                        # this stage
    run_dir: Path
    stage_dir: Path
    config: Any                      # the whole typed run config
    storage: Storage                 # the run folder's filesystem, as workers reach it
    upstream: list[dict] | None      # the previous stage's PartResults (None for the first stage)
    artifacts: dict[str, dict] = field(default_factory=dict)   # finished stages' registered outputs
    log: Callable[[str], None] = print
    fingerprint: str = ""            # this stage's (Stage.fingerprint): with a partition's input, what decides it

    def map_parts(self, fn: Callable, tasks: list[PartTask] | None = None, num_cpus: float = 1.0,
                  num_gpus: float = 0.0, reuse: bool = False, **kwargs) -> list[dict]:
        """`fn(table, **kwargs) -> (verdicts, extra)` over each partition (default: one task per
        upstream partition, same name), in Ray tasks that write their own part files. `reuse`: for a
        pure `fn`, partitions computed by an earlier run from the same input are taken as they are."""
        return map_parts(self, fn, tasks if tasks is not None else one_to_one(self.upstream or [], **kwargs),
                         num_cpus=num_cpus, num_gpus=num_gpus, reuse=reuse)

    def samples(self, columns: list[str] | None = None):
        """The previous stage's kept samples as a Ray Dataset, read by the workers from storage."""
        import ray
        from ray.data.expressions import col

        files = [self.storage.path(u["file"]) for u in self.upstream or [] if u["kept"]]
        ds = ray.data.read_parquet(files, filesystem=self.storage.fs)
        ds = ds.filter(expr=col("verdict") == KEPT)
        return ds.select_columns(columns) if columns else ds

    def artifact(self, stage: str, key: str) -> str:
        """A file another stage registered (its StageResult.artifacts): its path in `storage`."""
        try:
            return self.artifacts[stage][key]
        except KeyError:
            raise RuntimeError(f"{self.name}: stage {stage} registered no artifact {key!r}") from None

    @property
    def n_in(self) -> int:
        return sum(u["kept"] for u in self.upstream or [])


@dataclass
class StageResult:
    parts: list[dict]                                    # PartResults, one per partition written
    extra_stats: dict = field(default_factory=dict)
    artifacts: dict = field(default_factory=dict)        # recorded in manifest.json (paths, checksums)
    files: dict = field(default_factory=dict)            # other outputs: run-relative path -> sha256


class Stage:
    """Subclasses set `name` and implement `section(config)` and `run(ctx)`."""

    name: str = ""
    # sub-paths of the stage folder that survive a change of input (content-addressed caches)
    preserve: tuple[str, ...] = ()

    def section(self, config) -> Any:
        raise NotImplementedError

    def preflight(self, config) -> None:
        """Checks that need no cluster (bad paths, unknown codes): fail in a second, not mid-run."""

    def fingerprint(self, config) -> str:
        """What, besides the upstream output, decides this stage's result (JSON text)."""
        section = self.section(config)
        data = dataclasses.asdict(section) if dataclasses.is_dataclass(section) else section
        return json.dumps({"stage": self.name, "section": data, "seed": config.seed}, sort_keys=True)

    def run(self, ctx: StageContext) -> StageResult:
        raise NotImplementedError


def _as_storage(where) -> Storage:
    return where if isinstance(where, Storage) else Storage.local(where)


def read_ledger(where, stage: str, columns: list[str] | None = None, filters=None) -> pa.Table:
    """A finished stage's ledger: all its partitions (for tools that inspect a run, not for stages).
    `where`: the run folder's Storage, or a local run folder."""
    storage = _as_storage(where)
    parts = storage.read_json(f"{stage}/parts.json")
    if parts is not None:
        files = [p["file"] for p in parts]
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
