"""The stage contract.

A stage has a `name`, picks its config section out of the run config, and `run(ctx)` reads the
previous stage's output (`ctx.upstream`) and writes its own under `ctx.stage_dir`. It returns a
StageResult whose ledger holds one row per sample that entered it: kept, or dropped with a reason.
The runner (pipeline/runner.py) does the rest: it checks in = kept + dropped against the upstream
stage's kept keys, writes `ledger.parquet`, `stats.json` and, last, `_SUCCESS`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

KEPT, DROPPED = "kept", "dropped"

LEDGER_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("stage", pa.string()),
    ("verdict", pa.string()),
    ("reason", pa.string()),
    ("score", pa.float64()),
    ("detail", pa.string()),
])


class Ledger:
    """Collects one verdict per sample key for one stage."""

    def __init__(self, stage: str):
        self.stage = stage
        self._rows: dict[str, tuple[str, str, float | None, str]] = {}

    def keep(self, key: str, score: float | None = None, detail: str = "") -> None:
        self._add(key, KEPT, "", score, detail)

    def drop(self, key: str, reason: str, score: float | None = None, detail: str = "") -> None:
        if not reason:
            raise ValueError(f"stage {self.stage}: dropping {key} needs a reason")
        self._add(key, DROPPED, reason, score, detail)

    def _add(self, key, verdict, reason, score, detail):
        if key in self._rows:
            raise ValueError(f"stage {self.stage}: sample {key} got two verdicts")
        self._rows[key] = (verdict, reason, None if score is None else float(score), detail or "")

    def __len__(self) -> int:
        return len(self._rows)

    def kept_keys(self) -> list[str]:
        return [k for k, v in self._rows.items() if v[0] == KEPT]

    def table(self) -> pa.Table:
        keys = sorted(self._rows)
        rows = [self._rows[k] for k in keys]
        return pa.table({
            "key": keys,
            "stage": [self.stage] * len(keys),
            "verdict": [r[0] for r in rows],
            "reason": [r[1] for r in rows],
            "score": [r[2] for r in rows],
            "detail": [r[3] for r in rows],
        }, schema=LEDGER_SCHEMA)


@dataclass
class StageContext:
    run_dir: Path
    stage_dir: Path
    config: Any                      # the whole typed run config
    upstream: dict[str, Path]        # finished earlier stages: name -> their folder
    upstream_kept: list[str] | None  # keys the previous stage kept (None for the first stage)
    log: Callable[[str], None] = print
    # for a run folder in object storage: relative path -> its URI there (None: a local run)
    location: Callable[[str], Any] | None = None


@dataclass
class StageResult:
    ledger: Ledger
    extra_stats: dict = field(default_factory=dict)
    artifacts: dict = field(default_factory=dict)   # recorded in manifest.json (paths, checksums)


class Stage:
    """Subclasses set `name` and implement `section(config)` and `run(ctx)`."""

    name: str = ""
    # sub-paths of the stage folder that survive a change of input (content-addressed caches)
    preserve: tuple[str, ...] = ()

    def section(self, config) -> Any:
        raise NotImplementedError

    def fingerprint(self, config) -> str:
        """What, besides the upstream output, decides this stage's result (JSON text)."""
        section = self.section(config)
        data = dataclasses.asdict(section) if dataclasses.is_dataclass(section) else section
        return json.dumps({"stage": self.name, "section": data, "seed": config.seed}, sort_keys=True)

    def run(self, ctx: StageContext) -> StageResult:
        raise NotImplementedError


def read_ledger(stage_dir: Path) -> pa.Table:
    return pq.read_table(stage_dir / "ledger.parquet")
