"""Captioning metrics: CIDEr and BLEU-4 with pycocoevalcap's scorers (pure Python, no Java).

pycocoevalcap's PTB tokenizer needs Java, so captions are tokenised here the simple way its
scorers expect: lower-cased, punctuation stripped, split on whitespace.
"""
from __future__ import annotations

import re


def tokenize(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def caption_scores(references: dict[str, list[str]], candidates: dict[str, str]) -> dict:
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    gts = {k: [tokenize(r) for r in refs] for k, refs in references.items()}
    res = {k: [tokenize(candidates[k])] for k in references}
    cider, _ = Cider().compute_score(gts, res)
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    return {"cider": float(cider), "bleu4": float(bleu[3])}
