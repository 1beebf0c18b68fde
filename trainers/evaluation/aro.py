"""ARO's COCO-Order / Flickr30k-Order cases, as ARO builds them (Yuksekgonul et al., ICLR 2023).

Every reference caption of every image is one case: the caption, normalised as ARO's pre_caption
does (lower case; . ! " ( ) * # : ; ~ removed; spaces collapsed; at most 30 words), against its four
perturbations, each made from the raw caption's tokens and then normalised the same way:
nouns shuffled among nouns and adjectives among adjectives; every other token shuffled; words
shuffled within each trigram; trigrams shuffled. As in ARO a perturbation may come out equal to
the caption and is kept (a caption with one noun and no adjective has nothing to shuffle).
Nouns and adjectives come from trainers/evaluation/postag.py (WordNet's lexicon, offline) where
ARO uses spaCy's en_core_web_sm.
"""
from __future__ import annotations

import random
import re

from .postag import tag, tokens

KINDS = ("shuffle_nouns_and_adj", "shuffle_allbut_nouns_and_adj", "shuffle_within_trigrams", "shuffle_trigrams")
MAX_WORDS = 30


def pre_caption(caption: str, max_words: int = MAX_WORDS) -> str:
    text = re.sub(r"([.!\"()*#:;~])", " ", caption.lower())
    text = re.sub(r"\s{2,}", " ", text).rstrip("\n").strip(" ")
    return " ".join(text.split(" ")[:max_words])


def _permute(items: list, idx: list[int], rng: random.Random) -> None:
    values = [items[i] for i in idx]
    rng.shuffle(values)
    for i, v in zip(idx, values):
        items[i] = v


def perturb(caption: str, kind: str, rng: random.Random) -> str:
    words = tokens(caption)
    if kind in ("shuffle_nouns_and_adj", "shuffle_allbut_nouns_and_adj"):
        tags = tag(words)
        out = list(words)
        if kind == "shuffle_nouns_and_adj":
            _permute(out, [i for i, t in enumerate(tags) if t == "N"], rng)
            _permute(out, [i for i, t in enumerate(tags) if t == "J"], rng)
        else:
            _permute(out, [i for i, t in enumerate(tags) if t == "O"], rng)
    elif kind == "shuffle_within_trigrams":
        out = []
        for k in range(0, len(words), 3):
            tri = words[k:k + 3]
            rng.shuffle(tri)
            out += tri
    elif kind == "shuffle_trigrams":
        tris = [words[k:k + 3] for k in range(0, len(words), 3)]
        rng.shuffle(tris)
        out = [w for t in tris for w in t]
    else:
        raise ValueError(f"unknown ARO perturbation {kind!r}; choose from {', '.join(KINDS)}")
    return pre_caption(" ".join(out))


def aro_case(caption: str, seed: int) -> tuple[str, dict[str, str]]:
    """-> (the normalised caption, {kind: normalised perturbation}) for one reference caption."""
    rng = random.Random(seed)
    return pre_caption(caption), {k: perturb(caption, k, rng) for k in KINDS}
