"""The language stage: keep captions in the configured languages.

Per caption the backend (stages/langid.py; fastText's lid.176 by default) gives the most likely
languages with probabilities. The caption's confidence is the probability of the allowed
`languages` together; it is kept when that is >= `min_confidence`. A dropped caption's reason is
`language:<code>` for the language it was taken for (its probability as score), or
`language_low_confidence` when that language is allowed but too uncertain.

Identification runs as a Ray Data actor pool over the captions (each actor loads the model once).
Short alt-text is hard: fastText gives "a small yellow circle" only 0.19 English (and calls it
Persian), so the demo sets a low `min_confidence`; on web alt-text 0.25-0.5 is usual.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow as pa

from trainers.configtools import join, require
from trainers.errors import UserError

from .actor_map import collect, map_actors, table_dataset
from .base import Ledger, Stage, StageContext, StageResult
from .captions import caption_map
from .examples import write_examples
from .langid import fasttext_model_path, load_backend
from .source import file_sha256


@dataclass
class LanguageConfig:
    enabled: bool = True
    backend: Literal["fasttext", "langid"] = "fasttext"
    languages: list[str] = field(default_factory=lambda: ["en"])
    min_confidence: float = 0.25
    num_workers: int = 2
    cpus_per_worker: float = 0.5
    batch_size: int = 1024
    examples_per_reason: int = 20

    def validate(self, prefix: str) -> None:
        require(bool(self.languages), join(prefix, "languages"), "list at least one language code, e.g. [en]")
        require(0 <= self.min_confidence <= 1, join(prefix, "min_confidence"),
                f"must be in [0, 1], got {self.min_confidence}")
        require(self.num_workers >= 1, join(prefix, "num_workers"), "must be >= 1")
        require(self.batch_size >= 1, join(prefix, "batch_size"), "must be >= 1")


def preflight(cfg: LanguageConfig) -> None:
    """Load the backend once and check every configured code is one it can name."""
    if not cfg.enabled:
        return
    known = load_backend(cfg.backend).known()
    unknown = [c for c in cfg.languages if c not in known]
    if unknown:
        raise UserError(f"stages.language.languages: {', '.join(unknown)} unknown to the {cfg.backend} "
                        f"backend; it knows {len(known)} codes such as {', '.join(sorted(known)[:12])}")


def decide(probs: dict[str, float], languages: list[str], min_confidence: float) -> tuple[str, str, float]:
    """-> (verdict reason or "", top language, score). Pure."""
    top = max(probs, key=probs.get) if probs else "unknown"
    allowed = sum(p for lang, p in probs.items() if lang in languages)
    if allowed >= min_confidence and allowed > 0:
        return "", top, allowed
    if top in languages:
        return "language_low_confidence", top, allowed
    return f"language:{top}", top, probs.get(top, 0.0)


class _Identify:
    """Ray Data actor: identify a batch of captions' languages."""

    def __init__(self, backend: str, languages: list[str], min_confidence: float):
        self.lid = load_backend(backend)
        self.languages, self.min_confidence = languages, min_confidence

    def __call__(self, batch: dict) -> dict:
        reasons, tops, scores = [], [], []
        for text in batch["caption"]:
            reason, top, score = decide(self.lid.predict(str(text)), self.languages, self.min_confidence)
            reasons.append(reason)
            tops.append(top)
            scores.append(score)
        return {"key": batch["key"], "reason": np.array(reasons, dtype=object), "top": np.array(tops, dtype=object),
                "score": np.array(scores, np.float64)}


class LanguageStage(Stage):
    name = "language"

    def section(self, config) -> LanguageConfig:
        return config.stages.language

    def run(self, ctx: StageContext) -> StageResult:
        cfg: LanguageConfig = ctx.config.stages.language
        ledger = Ledger(self.name)
        keys = sorted(ctx.upstream_kept or [])
        captions = caption_map(ctx.upstream)
        if not cfg.enabled or not keys:
            for k in keys:
                ledger.keep(k)
            return StageResult(ledger, {"enabled": cfg.enabled})
        table = pa.table({"key": keys, "caption": [captions[k] for k in keys]})
        ds = map_actors(table_dataset(table, cfg.batch_size, cfg.num_workers), _Identify,
                        (cfg.backend, cfg.languages, cfg.min_confidence), cfg.num_workers, cfg.batch_size,
                        cfg.cpus_per_worker)
        out = collect(ds, ["key", "reason", "top", "score"])
        found: dict[str, int] = {}
        for key, reason, top, score in zip(out["key"], out["reason"], out["top"], out["score"]):
            found[str(top)] = found.get(str(top), 0) + 1
            if reason:
                ledger.drop(str(key), str(reason), score=float(score), detail=str(top))
            else:
                ledger.keep(str(key), score=float(score), detail=str(top))
        model = fasttext_model_path() if cfg.backend == "fasttext" else None   # the actors loaded it; name it only
        shown = write_examples(ctx, ledger.table(), captions, cfg.examples_per_reason, "Language filter")
        ctx.log(f"language: {cfg.backend} backend, keeping {', '.join(cfg.languages)} at confidence >= "
                f"{cfg.min_confidence}; examples in {shown}")
        top_found = dict(sorted(found.items(), key=lambda kv: -kv[1])[:20])
        return StageResult(ledger, {"enabled": True, "backend": cfg.backend,
                                    "model": str(model) if model else "langid (bundled)",
                                    "model_sha256": file_sha256(model) if model else None,
                                    "languages": cfg.languages, "min_confidence": cfg.min_confidence,
                                    "detected": top_found},
                           artifacts={"report": "language/report.html"})
