"""The language stage: keep captions in the configured languages.

Per caption the backend (stages/filters/langid.py; fastText's lid.176 by default) gives the most likely
languages with probabilities. The caption's confidence is the probability of the allowed
`languages` together; it is kept when that is >= `min_confidence`. That confidence is every
caption's score, kept or dropped, so one histogram against one cut shows the stage's decision. A
dropped caption's reason is `language` when it was taken for another language (its detail names
the code; the stage's stats count every code detected), or `language_low_confidence` when that
language is allowed but too uncertain.

Identification runs on an actor pool (stages/shared_model.py): each actor loads the backend once
and judges partitions one after another; memory declared to Ray per copy (MODEL_MB).
Short alt-text is hard: fastText gives "a small yellow circle" only 0.19 English (and calls it
Persian). The default 0.1 is measured (benchmarks/language_threshold.py, on openclipart titles and
short German, Spanish, Italian, Portuguese, Polish and Czech lines): it drops 12.5 % of English
titles and 94.9 % of the others; 0.25 would drop 26 % of the English for 97.8 %, 0.5 56 % for 99.3 %.
"""
from __future__ import annotations

import functools
from typing import ClassVar
from dataclasses import dataclass, field
from typing import Literal

import pyarrow as pa

from infra.configtools import join, require
from infra.errors import UserError

from ..base import DROPPED, KEPT, Filter, StageContext, StageResult
from ..examples import write_examples
from .langid import fasttext_model_path, load_backend
from ..shared_model import WORKER_MB, SharedModel
from infra.hashing import file_sha256


@dataclass
class LanguageConfig:
    # how the work is cut or run, never what is decided: left out of the fingerprint and the card
    HOW: ClassVar[tuple] = ("cpus_per_worker",)
    REMOVED: ClassVar[dict] = {"num_workers": "the executor sizes parallelism from the cluster's CPUs",
                               "batch_size": "never read: a task judges its partition's captions together"}
    enabled: bool = True  # false: every sample passes this stage
    backend: Literal["fasttext", "langid"] = "fasttext"  # the language identifier (fastText's lid.176, shipped in the package)
    languages: list[str] = field(default_factory=lambda: ["en"])  # captions in other languages are dropped (language)
    min_confidence: float = 0.1      # measured: see the module's docstring
    cpus_per_worker: float = 0.5  # CPUs a language task asks Ray for
    examples_per_reason: int = 20  # samples per drop reason shown in the stage's report
    def validate(self, prefix: str) -> None:
        require(bool(self.languages), join(prefix, "languages"), "list at least one language code, e.g. [en]")
        require(0 <= self.min_confidence <= 1, join(prefix, "min_confidence"),
                f"must be in [0, 1], got {self.min_confidence}")


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
    """-> (verdict reason or "", top language, score: P(allowed languages), whatever the verdict). Pure."""
    top = max(probs, key=probs.get) if probs else "unknown"
    allowed = sum(p for lang, p in probs.items() if lang in languages)
    if allowed >= min_confidence and allowed > 0:
        return "", top, allowed
    if top in languages:
        return "language_low_confidence", top, allowed
    return "language", top, allowed


# A loaded backend's resident memory (measured: fastText's lid.176.ftz 23 MB, langid.py 54 MB,
# each after its first prediction), with room for a partition's captions.
MODEL_MB = {"fasttext": 64.0, "langid": 96.0}


@functools.lru_cache(maxsize=2)
def _backend(name: str):
    return load_backend(name)   # once per actor of the pool (or per worker process, run as tasks)


def shared_backend(cfg: LanguageConfig) -> SharedModel | None:
    """The backend as the pool's actors load it (None when the stage passes everything)."""
    if not cfg.enabled:
        return None
    return SharedModel(f"the {cfg.backend} language identifier", _backend, (cfg.backend,),
                       memory_mb=WORKER_MB + MODEL_MB[cfg.backend], setting="stages.language.cpus_per_worker")


def identify(table: pa.Table, cfg: LanguageConfig) -> tuple[pa.Table, dict]:
    """One partition: each caption's language, kept when the allowed ones are likely enough."""
    keys, caps = table.column("key").to_pylist(), table.column("caption").to_pylist()
    if not cfg.enabled:
        n = len(keys)
        return pa.table({"key": keys, "verdict": [KEPT] * n, "reason": [""] * n}), {"detected": {}}
    lid = _backend(cfg.backend)
    verdicts, reasons, scores, tops = [], [], [], []
    found: dict[str, int] = {}
    for text in caps:
        reason, top, score = decide(lid.predict(str(text or "")), cfg.languages, cfg.min_confidence)
        verdicts.append(DROPPED if reason else KEPT)
        reasons.append(reason)
        scores.append(float(score))
        tops.append(str(top))
        found[str(top)] = found.get(str(top), 0) + 1
    return pa.table({"key": keys, "verdict": verdicts, "reason": reasons, "score": pa.array(scores, pa.float64()),
                     "detail": tops}), {"detected": found}


class LanguageStage(Filter):
    name = "language"
    config_key, config_class = "language", LanguageConfig
    reasons = ("language_low_confidence", "language")   # language: taken for another (detail: its code)
    report = "language/report.html"
    notes = ("language_score", "language")
    score_cuts = ("min_confidence",)
    audits = (("non_english", "language"),)
    judge = staticmethod(identify)

    def preflight(self, config) -> None:
        preflight(config.stages.language)

    def example_cut(self, cfg: LanguageConfig) -> float | None:
        return cfg.min_confidence

    def model(self, cfg: LanguageConfig) -> SharedModel | None:
        return shared_backend(cfg)

    def finish(self, ctx: StageContext, parts: list[dict]) -> StageResult:
        cfg: LanguageConfig = ctx.cfg
        if not cfg.enabled:
            return StageResult(parts, {"enabled": False})
        found: dict[str, int] = {}
        for p in parts:
            for lang, n in p.extra["detected"].items():
                found[lang] = found.get(lang, 0) + n
        model = fasttext_model_path() if cfg.backend == "fasttext" else None   # the workers loaded it; name it only
        shown = write_examples(ctx, parts, cfg.examples_per_reason, "Language filter", cut=self.example_cut(cfg))
        ctx.log(f"language: {cfg.backend} backend, keeping {', '.join(cfg.languages)} at confidence >= "
                f"{cfg.min_confidence}; examples in {shown}")
        top_found = dict(sorted(found.items(), key=lambda kv: -kv[1])[:20])
        return StageResult(parts, {"enabled": True, "backend": cfg.backend,
                                   "model": str(model) if model else "langid (bundled)",
                                   "model_sha256": file_sha256(model) if model else None,
                                   "languages": cfg.languages, "min_confidence": cfg.min_confidence,
                                   "detected": top_found},
                           artifacts={"report": "language/report.html"})
