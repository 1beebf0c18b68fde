"""Evaluation captions found in alt-text: caption-side decontamination.

A training sample whose alt-text is an evaluation caption teaches the answer, whatever its image.
Captions are compared as normalised word sequences (Unicode NFKC, case folded, punctuation and
markup dropped): an alt-text matches an evaluation caption when it contains the whole caption as a
run of words (a caption of at least `min_words` words; exact, re-cased, or inside longer text), or
shares a run of `ngram` words with one (a caption quoted in part, or with a word changed at its
end). Short captions ("a dog") match nothing: they are what every caption says. `ngram` 0 matches
whole captions only: for text from a small grammar (the demo's), where a third of all captions
share a 10-word run with some held-out caption without holding it.

The index holds 64-bit hashes of word runs: whole captions of up to `ngram` words by length, and
every `ngram`-word run of longer ones; an alt-text of w words costs about w x (distinct caption
lengths + 1) lookups.
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass, field

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*", re.UNICODE)
_TAG = re.compile(r"<[^>]{0,200}>")


def words(text: str | None) -> list[str]:
    """The normalised words of a caption: NFKC, case folded, markup and punctuation dropped."""
    if not text:
        return []
    text = unicodedata.normalize("NFKC", _TAG.sub(" ", str(text))).casefold()
    return _WORD.findall(text)


def _h(run) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(run).encode(), digest_size=8).digest(), "little")


@dataclass
class CaptionIndex:
    ngram: int = 10
    min_words: int = 6
    whole: dict[int, dict[int, tuple[str, str]]] = field(default_factory=dict)   # length -> hash -> (set, id)
    grams: dict[int, tuple[str, str]] = field(default_factory=dict)              # hash of an ngram run -> (set, id)
    captions: int = 0

    def add(self, set_name: str, caption_id: str, caption: str) -> None:
        w = words(caption)
        if len(w) < self.min_words:
            return
        self.captions += 1
        if self.ngram == 0 or len(w) <= self.ngram:     # ngram 0: whole captions only
            self.whole.setdefault(len(w), {}).setdefault(_h(w), (set_name, caption_id))
        else:
            for i in range(len(w) - self.ngram + 1):
                self.grams.setdefault(_h(w[i:i + self.ngram]), (set_name, caption_id))

    def match(self, text: str | None) -> tuple[str, str, str] | None:
        """(set, caption id, how) of the first evaluation caption `text` holds, or None."""
        w = words(text)
        for length, table in self.whole.items():
            for i in range(len(w) - length + 1):
                hit = table.get(_h(w[i:i + length]))
                if hit:
                    return (*hit, "whole caption" if length == len(w) else "caption inside the alt-text")
        if self.grams:
            for i in range(len(w) - self.ngram + 1):
                hit = self.grams.get(_h(w[i:i + self.ngram]))
                if hit:
                    return (*hit, f"{self.ngram} words in common")
        return None
