"""Captioning metrics as the COCO caption evaluation computes them: PTB tokenization, then
pycocoevalcap's CIDEr-D and BLEU-4 scorers (pure Python), reported on the papers' ×100 scale
(CIDEr 117.5, not 1.175).

pycocoevalcap tokenizes with Stanford CoreNLP 3.4.1's PTBTokenizer (`-preserveLines -lowerCase`,
in Java) and then drops the tokens in its PUNCTUATIONS list. `ptb_tokenize` reimplements the rules
that matter for captions, in Python: contractions split (does n't, cat 's, they 're), hyphenated
words, decimals, thousands and times kept whole (black-and-white, 1,000-piece, 3.5, 10:30),
abbreviations kept with their period (u.s., mr., st.), quotes turned to `` '' ` ' and brackets to
-lrb- -rrb- (lower-cased, so pycocoevalcap's "-LRB-" filter misses them and they stay, as there),
$ % & * split off; letters of any script kept in their words (café, São), curly quotes read as
Java reads them (“ ” as `` '', ’ as an apostrophe), … — – £ € ¢ ½ normalised, gonna/gotta/wanna/
lemme/gimme/cannot split in two. Its agreement with the Java tokenizer is tested on tricky
captions and the shared COCO captions where Java is installed (tests/trainers/test_textmetrics.py,
benchmarks/ptb_agreement.py).
"""
from __future__ import annotations

import re

# pycocoevalcap/tokenizer/ptbtokenizer.py drops exactly these tokens after tokenizing
PUNCTUATIONS = {"''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".", "?", "!", ",", ":", "-", "--", "...", ";"}
SCALE = 100.0

_ABBREV = r"(?:[a-z]\.){2,}|(?<![\w.])[a-z]\.(?=[\"\u201d])|(?:mr|mrs|ms|dr|st|jr|sr|vs|etc|inc|ltd|co|ave|mt|no|prof|gen|gov|sgt|capt|col|lt)\.(?![a-z])"
_APOS = "['\u2019]"                       # ' and the right single quote, which Java reads as one
_CLITIC = r"(?:s|re|ve|ll|d|m)\b"
# \w: any letter (café, São), as Java; letters joined by a period stay one token (stove.and), and
# so does a period right before a comma or semicolon (bat.,)
_PART = rf"\w+(?:[.,:][0-9]+|\.(?=[^\W\d_])\w+)*(?:{_APOS}(?!{_CLITIC})\w+)*(?:\.(?=[,;]))?"
_WORD = rf"{_PART}(?:[-/\u2011]{_PART})*"
_EMAIL = r"[a-z0-9_.+-]+@[a-z0-9-]+(?:\.[a-z0-9-]+)+"
_DOMAIN = r"(?:[a-z0-9-]+\.)+(?:com|org|net|edu|gov|info|biz|de|fr|it|uk|nl|es|ru|jp|br|io)\b"
_TOKEN = re.compile(
    r"(?P<url>(?:https?|ftp)://[^\s\"<>]+)"
    rf"|(?P<email>{_EMAIL})|(?P<domain>{_DOMAIN})|(?P<abbr>{_ABBREV})"
    rf"|(?P<tis>(?:(?<=\s)|^){_APOS}t(?=(?:is|was)\b))|(?P<yall>\by{_APOS}(?=all\b))"
    rf"|(?P<neg>\w+(?=n{_APOS}t\b))|(?P<nt>n{_APOS}t\b)"
    rf"|(?P<clitic>(?:(?<=\w)|(?<=\s)|^){_APOS}{_CLITIC})"
    rf"|(?P<word>{_WORD})"
    r"|(?P<ellipsis>\.\.\.+)|(?P<dashes>--+)"
    r"|(?P<dquote>[\"\u201c\u201d])|(?P<squote>['`\u2018\u2019])"
    r"|(?P<bracket>[()\[\]{}])"
    r"|(?P<other>[^\s\w])")
_BRACKETS = {"(": "-lrb-", ")": "-rrb-", "[": "-lsb-", "]": "-rsb-", "{": "-lcb-", "}": "-rcb-"}
# characters PTBTokenizer normalises before it splits (checked against CoreNLP 3.4.1)
_NORMAL = str.maketrans({"\u2026": "...", "\u2014": " -- ", "\u2013": " -- ", "\u00a3": "#", "\u20ac": "$",
                         "\u00a2": " cents ", "\u00bd": "1/2", "\u00bc": "1/4", "\u00be": "3/4",
                         "\u00a0": " "})
_FRACTION = re.compile(r"[0-9]+/[0-9]+")
# words PTBTokenizer splits in two (its multi-word rules): gon na, can not, ...
_SPLIT = {"gonna": ("gon", "na"), "gotta": ("got", "ta"), "wanna": ("wan", "na"), "lemme": ("lem", "me"),
          "gimme": ("gim", "me"), "cannot": ("can", "not")}


def ptb_tokens(text: str) -> list[str]:
    """PTBTokenizer's tokens (lower-cased), before pycocoevalcap drops punctuation."""
    out: list[str] = []
    open_double = True
    text = text.lower().replace("\n", " ").translate(_NORMAL)
    for m in _TOKEN.finditer(text):
        kind, tok = m.lastgroup, m.group()
        if kind == "dquote":
            if tok == '"':
                tok, open_double = ("``" if open_double else "''"), not open_double
            else:
                tok = "``" if tok == "\u201c" else "''"
        elif kind == "squote":
            prev = text[m.start() - 1] if m.start() else " "
            tok = "`" if (tok in "`\u2018" or prev.isspace() or prev in "([{\"\u201c") else "'"
        elif kind == "bracket":
            tok = _BRACKETS[tok]
        elif kind in ("clitic", "nt", "tis", "yall"):
            tok = tok.replace("\u2019", "'")
        elif kind == "word" and tok in _SPLIT:
            out.extend(_SPLIT[tok])
            continue
        if kind == "word" and _FRACTION.fullmatch(tok) and out and out[-1].isdigit() and text[m.start() - 1] == " ":
            out[-1] += "\u00a0" + tok        # "22 3/4" is one token, its space a no-break space (as Java)
            continue
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
