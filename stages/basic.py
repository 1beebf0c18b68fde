"""The basic filter: repair captions, then drop what no caption-quality or image-shape bound allows.

DataComp's "basic" baseline keeps captions of more than 2 words and 5 characters and images whose
shorter side is at least 200 px with an aspect ratio under 3; LAION drops alt-text under 5
characters. Those are the defaults; every bound is a config value.

Per sample, in this order (the first failing check names the reason):
  caption: cleaned (stages/captions.py: ftfy, HTML entities, tags, control characters, whitespace);
    empty after cleaning -> `empty_caption`; mostly U+FFFD -> `undecodable_caption`;
    characters outside [min_chars, max_chars] -> `caption_too_short` / `caption_too_long`;
    words outside [min_words, max_words] -> `caption_too_few_words` / `caption_too_many_words`.
  image (its size as downloaded, before ingest resized it): shorter side < min_image_side ->
    `image_too_small`; long/short side > max_aspect_ratio -> `aspect_ratio`.
Kept samples' cleaned captions go to `basic/captions.parquet`; a repaired caption's ledger detail is
`repaired`. `report.html` shows examples of every drop reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from trainers.configtools import join, require

from .base import Ledger, Stage, StageContext, StageResult
from .captions import caption_map, clean_caption
from .examples import write_examples


@dataclass
class BasicConfig:
    enabled: bool = True
    min_chars: int = 5
    max_chars: int = 1000
    min_words: int = 3
    max_words: int = 200
    min_image_side: int = 200
    max_aspect_ratio: float = 3.0
    max_replacement_share: float = 0.2   # share of U+FFFD characters that makes a caption undecodable
    examples_per_reason: int = 20

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


def original_sizes(ingest_dir) -> dict[str, tuple[int, int]]:
    from .ingest import shard_paths

    sizes = {}
    for tar in shard_paths(ingest_dir):
        t = pq.read_table(tar.with_suffix(".parquet"), columns=["uid", "status", "original_width", "original_height"])
        for r in t.to_pylist():
            if r["status"] == "success":
                sizes[r["uid"]] = (r["original_width"], r["original_height"])
    return sizes


class BasicStage(Stage):
    name = "basic"

    def section(self, config) -> BasicConfig:
        return config.stages.basic

    def run(self, ctx: StageContext) -> StageResult:
        cfg: BasicConfig = ctx.config.stages.basic
        captions = caption_map(ctx.upstream)
        sizes = original_sizes(ctx.upstream["ingest"])
        ledger = Ledger(self.name)
        kept_keys, kept_caps, repaired = [], [], 0
        for key in sorted(ctx.upstream_kept or []):
            raw = captions[key]
            if not cfg.enabled:
                ledger.keep(key)
                kept_keys.append(key)
                kept_caps.append(raw)
                continue
            cleaned, reason, score = judge_caption(raw, cfg)
            if not reason:
                reason, score = judge_image(*sizes.get(key, (None, None)), cfg)
            if reason:
                ledger.drop(key, reason, score=score, detail=cleaned[:300])
                continue
            changed = cleaned != raw
            repaired += changed
            ledger.keep(key, detail="repaired" if changed else "")
            kept_keys.append(key)
            kept_caps.append(cleaned)
        pq.write_table(pa.table({"key": kept_keys, "caption": kept_caps}), ctx.stage_dir / "captions.parquet")
        shown = write_examples(ctx, ledger.table(), {**captions, **dict(zip(kept_keys, kept_caps))},
                               cfg.examples_per_reason, "Basic filter")
        ctx.log(f"basic: {repaired} captions repaired; examples in {shown}")
        return StageResult(ledger, {"enabled": cfg.enabled, "captions_repaired": repaired,
                                    "bounds": {k: v for k, v in vars(cfg).items() if k != "examples_per_reason"}},
                           artifacts={"captions": "basic/captions.parquet", "report": "basic/report.html"})
