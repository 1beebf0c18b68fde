"""What watches the stages without being one: called by the runner after every stage, run or skipped.

- the demo audit (pipeline/audit.py): a synthetic run's filters against its planted ground truth;
- the dataset card, `shard/README.md` (pipeline/dataset_card.py);
- the MLflow data-build run (pipeline/data_tracking.py): each stage's counts as it finishes, the
  dataset once the shards exist.
An observer never changes a stage's result; adding one is a class here and a line in OBSERVERS.
"""
from __future__ import annotations

from pathlib import Path


def _final(stage: str) -> bool:
    """The stage that writes the dataset (it declares `final_data`): what the card and the data run describe."""
    from stages.registry import by_name

    s = by_name(stage)
    return bool(s and s.final_data)


class DemoAudit:
    def after_stage(self, stage: str, run_dir: Path, cfg, storage, log=print, **_) -> None:
        from . import audit

        if cfg.source.kind != "synthetic" or storage.exists(f"{stage}/audit.json"):
            return   # only the demo has ground truth; audited already for this stage's result
        audit.after_stage(stage, run_dir, log, storage)


class DataBuildRun:
    def after_stage(self, stage: str, run_dir: Path, cfg, manifest, summary: dict, storage, log=print,
                    ran: bool = False, **_) -> None:
        if not cfg.track_data:
            return
        from .data_tracking import log_data_build, log_stage

        if _final(stage):
            log_data_build(run_dir, manifest, summary, cfg, log, shards=storage.uri("shard/shards"))
        elif ran and not any(_final(s) for s in summary if s != stage):
            log_stage(run_dir, manifest, stage, summary.get(stage), cfg, log)


class DatasetCard:
    def after_stage(self, stage: str, run_dir: Path, cfg, manifest, summary: dict, storage, **_) -> None:
        if not _final(stage):
            return
        from .dataset_card import card

        text = card(manifest.data, summary, cfg)
        storage.write_both(run_dir, f"{stage}/README.md", text.encode())   # the working copy's too


OBSERVERS = [DemoAudit(), DatasetCard(), DataBuildRun()]
