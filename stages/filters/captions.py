"""Caption repair: what the basic stage applies, once, to every caption.

The cleaned caption travels in the partitions' `caption` column (stages/dataplane.py), so every
stage after basic (language, clip_score, tokenizer, shard) sees it the same way.
"""
from __future__ import annotations

import html
import re
import unicodedata

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
