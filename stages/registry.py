"""The stages, in order: the one list the runner, the config, the CLI and the tools read.

Adding a stage is its module and one line here; what the rest of capline knows of a stage (its
kind, config section, drop reasons, report, the names of its notes, its demo audits, whether its
section is a filter's thresholds, whether it writes the dataset) it declares on its class
(stages/base.py: Stage).
"""
from __future__ import annotations

from .base import Stage
from .filters.basic import BasicStage
from .filters.clip_score import ClipScoreStage
from .dedup import DedupStage
from .evaluate import EvalStage
from .ingest import IngestStage
from .filters.language import LanguageStage
from .shard.stage import ShardStage
from .source.stage import SourceStage
from .tokenizer import TokenizerStage
from .train import TrainStage

STAGES: list[Stage] = [SourceStage(), IngestStage(), DedupStage(), BasicStage(), LanguageStage(), ClipScoreStage(),
                       TokenizerStage(), ShardStage(), TrainStage(), EvalStage()]


def by_name(name: str) -> Stage | None:
    return next((s for s in STAGES if s.name == name), None)


def judging() -> list[Stage]:
    """The stages that decide per sample from the data (filters and decisions): the report's pages."""
    return [s for s in STAGES if s.kind in ("filter", "decide")]


def with_thresholds() -> list[Stage]:
    """The stages whose section is a filter's thresholds (the dataset card lists them)."""
    return [s for s in STAGES if s.thresholds]


def audited() -> dict[str, tuple]:
    """stage -> its demo audits: (planted defect, the reason prefix that catches it)."""
    return {s.name: s.audits for s in STAGES if s.audits}


def sections() -> list[tuple[str, type]]:
    """The `stages:` config sections, in stage order: (key, dataclass)."""
    return [(s.config_key, s.config_class) for s in STAGES if s.config_key]
