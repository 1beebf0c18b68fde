"""The basic filter: repair captions, then drop what no caption-quality or image-shape bound allows.

DataComp's "basic" baseline keeps captions of more than 2 words and 5 characters and images whose
shorter side is at least 200 px with an aspect ratio under 3; LAION drops alt-text under 5
characters. Those are the defaults; every bound is a config value.

Per sample, in this order (the first failing check names the reason):
  caption: cleaned (stages/filters/captions.py: ftfy, HTML entities, tags, control characters, whitespace);
    empty after cleaning -> `empty_caption`; mostly U+FFFD -> `undecodable_caption`;
    characters outside [min_chars, max_chars] -> `caption_too_short` / `caption_too_long`;
    words outside [min_words, max_words] -> `caption_too_few_words` / `caption_too_many_words`.
  image (its size as downloaded, before ingest resized it): shorter side < min_image_side ->
    `image_too_small`; long/short side > max_aspect_ratio -> `aspect_ratio`.
Kept samples carry their cleaned caption to every later stage (the partition's `caption` column); a
repaired caption's ledger detail is `repaired`. A task per partition does the work. `report.html` shows examples of every drop reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from infra.configtools import join, require

from ..base import DROPPED, KEPT, Filter, PartResult, StageContext, StageResult
from .captions import clean_caption
from ..examples import write_examples


@dataclass
class BasicConfig:
    enabled: bool = True  # false: every sample passes this stage
    min_chars: int = 5  # captions shorter than this are dropped (caption_too_short)
    max_chars: int = 1000  # captions longer than this are dropped (caption_too_long)
    min_words: int = 3  # captions with fewer words are dropped (too_few_words)
    max_words: int = 200  # captions with more words are dropped (too_many_words)
    min_image_side: int = 200  # images whose shorter original side is smaller are dropped (image_too_small)
    max_aspect_ratio: float = 3.0  # images longer than this many times their width, or wider, are dropped
    max_replacement_share: float = 0.2   # share of U+FFFD characters that makes a caption undecodable
    examples_per_reason: int = 20  # samples per drop reason shown in the stage's report
    def validate(self, prefix: str) -> None:
        require(0 <= self.min_chars <= self.max_chars, join(prefix, "min_chars"),
                f"need 0 <= min_chars <= max_chars, got {self.min_chars} and {self.max_chars}")
        require(0 <= self.min_words <= self.max_words, join(prefix, "min_words"),
                f"need 0 <= min_words <= max_words, got {self.min_words} and {self.max_words}")
        require(self.min_image_side >= 0, join(prefix, "min_image_side"), "must be >= 0")
        require(self.max_aspect_ratio >= 1, join(prefix, "max_aspect_ratio"),
                f"must be >= 1 (long side / short side), got {self.max_aspect_ratio}")
        require(0 < self.max_replacement_share <= 1, join(prefix, "max_replacement_share"), "must be in (0, 1]")
        require(self.examples_per_reason >= 0, join(prefix, "examples_per_reason"), "must be >= 0")


def judge_caption(text: str, cfg: BasicConfig) -> tuple[str, str, float | None]:
    """-> (cleaned caption, drop reason or "", score). Pure: the unit tests call it directly."""
    cleaned = clean_caption(text)
    if not cleaned:
        return cleaned, "empty_caption", None
    if cleaned.count("\ufffd") / len(cleaned) > cfg.max_replacement_share:
        return cleaned, "undecodable_caption", cleaned.count("\ufffd") / len(cleaned)
    n, words = len(cleaned), len(cleaned.split())
    if n < cfg.min_chars:
        return cleaned, "caption_too_short", n
    if n > cfg.max_chars:
        return cleaned, "caption_too_long", n
    if words < cfg.min_words:
        return cleaned, "caption_too_few_words", words
    if words > cfg.max_words:
        return cleaned, "caption_too_many_words", words
    return cleaned, "", None


def judge_image(width: int | None, height: int | None, cfg: BasicConfig) -> tuple[str, float | None]:
    if not width or not height:
        return "", None  # ingest decoded it; a size img2dataset did not record is no reason to drop
    short, long = min(width, height), max(width, height)
    if short < cfg.min_image_side:
        return "image_too_small", short
    if long / short > cfg.max_aspect_ratio:
        return "aspect_ratio", long / short
    return "", None


def judge(table: pa.Table, cfg: BasicConfig) -> tuple[pa.Table, dict]:
    """One partition: each caption cleaned and judged, then its image's original size."""
    out = {c: [] for c in ("key", "verdict", "reason", "score", "detail", "caption")}
    repaired = 0
    for key, raw, w, h in zip(*(table.column(c).to_pylist() for c in ("key", "caption", "width", "height"))):
        raw = raw or ""
        if not cfg.enabled:
            row = (key, KEPT, "", None, "", raw)
        else:
            cleaned, reason, score = judge_caption(raw, cfg)
            if not reason:
                reason, score = judge_image(w, h, cfg)
            if reason:
                row = (key, DROPPED, reason, score, cleaned[:300], cleaned)
            else:
                repaired += cleaned != raw
                row = (key, KEPT, "", None, "repaired" if cleaned != raw else "", cleaned)
        for c, v in zip(out, row):
            out[c].append(v)
    return pa.table(out, schema=pa.schema([("key", pa.string()), ("verdict", pa.string()), ("reason", pa.string()),
                                           ("score", pa.float64()), ("detail", pa.string()),
                                           ("caption", pa.string())])), {"repaired": repaired}


class BasicStage(Filter):
    name = "basic"
    config_key, config_class = "basic", BasicConfig
    reasons = ("empty_caption", "undecodable_caption", "caption_too_short", "caption_too_long",
               "caption_too_few_words", "caption_too_many_words", "image_too_small", "aspect_ratio")
    report = "basic/report.html"
    judge = staticmethod(judge)

    def finish(self, ctx: StageContext, parts: list[PartResult]) -> StageResult:
        cfg: BasicConfig = ctx.cfg
        repaired = sum(p.extra["repaired"] for p in parts)
        shown = write_examples(ctx, parts, cfg.examples_per_reason, "Basic filter")
        ctx.log(f"basic: {repaired} captions repaired; examples in {shown}")
        return StageResult(parts, {"enabled": cfg.enabled, "captions_repaired": repaired,
                                   "bounds": {k: v for k, v in vars(cfg).items() if k != "examples_per_reason"}},
                           artifacts={"report": "basic/report.html"})
