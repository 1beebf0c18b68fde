"""The stages, in order: the one list the runner, the CLI and the tools read.

Adding a stage is its module and one line here.
"""
from __future__ import annotations

from .basic import BasicStage
from .clip_score import ClipScoreStage
from .dedup import DedupStage
from .evaluate import EvalStage
from .ingest import IngestStage
from .language import LanguageStage
from .shard import ShardStage
from .source import SourceStage
from .tokenizer import TokenizerStage
from .train import TrainStage

STAGES = [SourceStage(), IngestStage(), DedupStage(), BasicStage(), LanguageStage(), ClipScoreStage(),
          TokenizerStage(), ShardStage(), TrainStage(), EvalStage()]
