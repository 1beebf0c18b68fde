"""Captions as later stages must see them: cleaned by the basic stage when it ran, else as the source had them.

The basic stage writes `basic/captions.parquet` (key, caption) for the samples it keeps; every stage
after it (language, clip_score, tokenizer, shard) reads captions through `caption_map`, so a caption
is repaired once and used the same way everywhere.
"""
from __future__ import annotations

import html
import re
import unicodedata
from pathlib import Path

import pyarrow.parquet as pq

_SPACE = re.compile(r"\s+")
_TAG = re.compile(r"<[^>]{1,200}>")


def clean_caption(text: str) -> str:
    """Repair mojibake (ftfy), unescape HTML entities, drop tags and control characters, fold whitespace."""
    import ftfy

    text = ftfy.fix_text(text, unescape_html=False)
    for _ in range(2):                 # "&amp;amp;" occurs: alt-text escaped twice
        unescaped = html.unescape(text)
        if unescaped == text:
            break
        text = unescaped
    text = _TAG.sub(" ", text)
    text = "".join(c if unicodedata.category(c)[0] != "C" else " " for c in text)
    return _SPACE.sub(" ", text).strip()


def captions_path(upstream: dict[str, Path]) -> Path:
    """The file holding the current captions: the basic stage's cleaned ones, else the source's."""
    if "basic" in upstream and (upstream["basic"] / "captions.parquet").is_file():
        return upstream["basic"] / "captions.parquet"
    return upstream["source"] / "urls.parquet"


def caption_map(upstream: dict[str, Path]) -> dict[str, str]:
    t = pq.read_table(captions_path(upstream), columns=["key", "caption"]).to_pydict()
    return dict(zip(t["key"], t["caption"]))
