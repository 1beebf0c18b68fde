"""Captioning metrics as the COCO caption evaluation computes them: PTB tokenization, then
pycocoevalcap's CIDEr-D and BLEU-4 scorers (pure Python), reported on the papers' ×100 scale
(CIDEr 117.5, not 1.175).

pycocoevalcap tokenizes with Stanford CoreNLP 3.4.1's PTBTokenizer (`-preserveLines -lowerCase`,
in Java) and then drops the tokens in its PUNCTUATIONS list. `ptb_tokenize` reimplements the rules
that matter for captions, in Python: contractions split (does n't, cat 's, they 're), hyphenated
words, decimals, thousands and times kept whole (black-and-white, 1,000-piece, 3.5, 10:30),
abbreviations kept with their period (u.s., mr., st.), quotes turned to `` '' ` ' and brackets to
-lrb- -rrb- (lower-cased, so pycocoevalcap's "-LRB-" filter misses them and they stay, as there),
$ % & * split off. Its agreement with the Java tokenizer is tested on tricky captions where Java
is installed (tests/trainers/test_textmetrics.py).
"""
from __future__ import annotations

import re

# pycocoevalcap/tokenizer/ptbtokenizer.py drops exactly these tokens after tokenizing
PUNCTUATIONS = {"''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".", "?", "!", ",", ":", "-", "--", "...", ";"}
SCALE = 100.0

_ABBREV = r"(?:[a-z]\.){2,}|(?:mr|mrs|ms|dr|st|jr|sr|vs|etc|inc|ltd|co|ave|mt|no|prof|gen|gov|sgt|capt|col|lt)\.(?![a-z])"
_PART = r"[a-z0-9_]+(?:[.,:][0-9]+)*(?:'(?!(?:s|re|ve|ll|d|m)\b)[a-z]+)*"
_WORD = rf"{_PART}(?:[-/]{_PART})*"
_EMAIL = r"[a-z0-9_.+-]+@[a-z0-9-]+(?:\.[a-z0-9-]+)+"
_DOMAIN = r"(?:[a-z0-9-]+\.)+(?:com|org|net|edu|gov|info|biz|de|fr|it|uk|nl|es|ru|jp|br|io)\b"
_TOKEN = re.compile(
    r"(?P<url>(?:https?|ftp)://[^\s\"<>]+)"
    rf"|(?P<email>{_EMAIL})|(?P<domain>{_DOMAIN})|(?P<abbr>{_ABBREV})"
    r"|(?P<neg>[a-z]+(?=n't\b))|(?P<nt>n't\b)"
    r"|(?P<clitic>(?<=[a-z0-9])'(?:s|re|ve|ll|d|m)\b)"
    rf"|(?P<word>{_WORD})"
    r"|(?P<ellipsis>\.\.\.+)|(?P<dashes>--+)"
    r"|(?P<dquote>\")|(?P<squote>['`])"
    r"|(?P<bracket>[()\[\]{}])"
    r"|(?P<other>[^\sa-z0-9])")
_BRACKETS = {"(": "-lrb-", ")": "-rrb-", "[": "-lsb-", "]": "-rsb-", "{": "-lcb-", "}": "-rcb-"}


def ptb_tokens(text: str) -> list[str]:
    """PTBTokenizer's tokens (lower-cased), before pycocoevalcap drops punctuation."""
    out: list[str] = []
    open_double = True
    for m in _TOKEN.finditer(text.lower().replace("\n", " ")):
        kind, tok = m.lastgroup, m.group()
        if kind == "dquote":
            tok, open_double = ("``" if open_double else "''"), not open_double
        elif kind == "squote":
            prev = text[m.start() - 1] if m.start() else " "
            tok = "`" if (tok == "`" or prev.isspace() or prev in "([{\"") else "'"
        elif kind == "bracket":
            tok = _BRACKETS[tok]
        out.append(tok)
    return out


def ptb_tokenize(text: str) -> str:
    """A caption as pycocoevalcap hands it to its scorers."""
    return " ".join(t for t in ptb_tokens(text) if t not in PUNCTUATIONS)


tokenize = ptb_tokenize


def caption_scores(references: dict[str, list[str]], candidates: dict[str, str]) -> dict:
    """{"cider": CIDEr-D ×100, "bleu4": BLEU-4 ×100}, both on PTB-tokenized text."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    gts = {k: [ptb_tokenize(r) for r in refs] for k, refs in references.items()}
    res = {k: [ptb_tokenize(candidates[k])] for k in references}
    cider, _ = Cider().compute_score(gts, res)
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    return {"cider": SCALE * float(cider), "bleu4": SCALE * float(bleu[3])}
