"""Nouns and adjectives in a caption, offline: what ARO's noun/adjective perturbations need.

ARO tags with spaCy's en_core_web_sm, which installs from neither PyPI nor Debian. This tagger uses
WordNet's lexicon (Debian `wordnet-base`, /usr/share/wordnet): a word's possible parts of speech
and how often each was seen in WordNet's tagged corpus, after WordNet's own morphology (exception
lists and suffix rules). Closed-class words (determiners, prepositions, pronouns, auxiliaries,
numbers) come from a list; a few context rules decide between the rest, e.g. after a determiner a
word is not a verb, and a participle after a noun is one. Tags are Penn's folded to three:
"N" (NN*), "J" (JJ*), "O" (everything else). Agreement with hand labels on COCO-style captions:
tests/trainers/data/pos_captions.txt, measured in tests/trainers/test_aro.py.
"""
from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

from infra.errors import UserError

WORDNET_DIR = Path(os.environ.get("CAPLINE_WORDNET", "/usr/share/wordnet"))

# Penn tags these determiners-like words JJ: they are shuffled with the adjectives in ARO
_J_CLOSED = {"several", "many", "few", "other", "same", "next", "such", "much", "more", "most", "less", "own"}
_DET = {"a", "an", "the", "this", "that", "these", "those", "his", "her", "its", "their", "my", "your", "our",
        "some", "each", "every", "any", "no", "another", "both", "all", "either", "neither"} | _J_CLOSED
_NUM = {"one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "dozen", "hundred", "thousand"}
_CLOSED = _DET | _NUM | {
    # prepositions and particles
    "of", "in", "on", "at", "by", "with", "without", "from", "to", "into", "onto", "over", "under", "above",
    "below", "near", "beside", "besides", "behind", "between", "among", "through", "across", "along",
    "around", "about", "against", "toward", "towards", "inside", "outside", "up", "down", "off", "out",
    "for", "during", "while", "after", "before", "past", "underneath", "beneath", "atop", "upon", "via",
    "like", "as", "than", "throughout", "within", "beyond",
    # conjunctions, pronouns, wh-words
    "and", "or", "but", "nor", "so", "yet", "if", "because", "although", "though", "then", "there", "here",
    "he", "she", "it", "they", "we", "i", "you", "him", "them", "us", "me", "who", "whom", "whose", "which",
    "what", "where", "when", "why", "how", "someone", "something", "somebody", "everyone", "everything",
    "anyone", "nothing", "one's", "himself", "herself", "itself", "themselves",
    # auxiliaries and very common verbs WordNet also lists as nouns
    "is", "are", "was", "were", "be", "been", "being", "am", "has", "have", "had", "having", "do", "does",
    "did", "can", "could", "will", "would", "shall", "should", "may", "might", "must", "not", "n't", "'s",
    "very", "too", "also", "just", "almost", "together", "away", "back", "still", "only", "even",
}
_AUX = {"is", "are", "was", "were", "be", "been", "being", "am", "seems", "looks", "appears", "very", "too", "so"}

# WordNet's detachment rules (morphy)
_RULES = {"n": [("s", ""), ("ses", "s"), ("xes", "x"), ("zes", "z"), ("ches", "ch"), ("shes", "sh"),
                ("men", "man"), ("ies", "y")],
          "v": [("s", ""), ("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""), ("ing", "e"),
                ("ing", "")],
          "a": [("er", ""), ("est", ""), ("er", "e"), ("est", "e")]}
_FILES = {"n": "noun", "v": "verb", "a": "adj", "r": "adv"}


@lru_cache(maxsize=1)
def _lexicon() -> tuple[dict, dict]:
    """-> ({pos: {lemma: tagged sense count}}, {pos: {inflected: lemma}})."""
    if not (WORDNET_DIR / "index.noun").is_file():
        raise UserError(f"ARO's noun/adjective perturbations need WordNet's lexicon at {WORDNET_DIR}: install the "
                        "Debian package wordnet-base (make install does, as root), or set CAPLINE_WORDNET to a "
                        "folder holding index.noun, index.verb, index.adj and index.adv")
    index, exc = {}, {}
    for pos, name in _FILES.items():
        counts = {}
        with open(WORDNET_DIR / f"index.{name}", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(" "):
                    continue
                cells = line.split()
                p_cnt = int(cells[3])
                counts[cells[0]] = int(cells[5 + p_cnt])     # tagsense_cnt
        index[pos] = counts
        table = {}
        path = WORDNET_DIR / f"{name}.exc"
        if path.is_file():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                cells = line.split()
                if len(cells) >= 2:
                    table.setdefault(cells[0], cells[1])
        exc[pos] = table
    return index, exc


def _lemma(word: str, pos: str) -> str | None:
    index, exc = _lexicon()
    if word in index[pos]:
        return word
    if word in exc[pos] and exc[pos][word] in index[pos]:
        return exc[pos][word]
    for suffix, repl in _RULES.get(pos, ()):
        if word.endswith(suffix) and len(word) > len(suffix) + 1:
            base = word[: len(word) - len(suffix)] + repl
            if base in index[pos]:
                return base
    return None


def _weights(word: str) -> dict[str, float]:
    """{pos: weight} for every part of speech WordNet knows the word as (weight: tagged senses + 1)."""
    index, _ = _lexicon()
    out = {}
    for pos in _FILES:
        lemma = _lemma(word, pos)
        if lemma is not None:
            # an inflected form is weaker evidence for an adjective ("tracks" is not "track" the adjective)
            out[pos] = index[pos][lemma] + 1.0 if lemma == word or pos != "a" else 0.5
    return out


def _guess(word: str) -> str:
    """A word WordNet does not know: by its ending; unknown words in captions are mostly names."""
    if word.endswith("ly"):
        return "O"
    if word.endswith(("ing", "ed")):
        return "O"
    if word.endswith(("ous", "ful", "ive", "able", "ible", "ish", "less", "ic", "ical", "y")):
        return "J"
    return "N"


def tokens(caption: str) -> list[str]:
    """Words and punctuation as separate tokens, split as spaCy's English tokenizer (ARO's) splits
    them: contractions and possessives as n't / 's ("dog's" -> dog 's), hyphens as tokens of their
    own ("well-stuffed" -> well - stuffed); other apostrophes stay inside a word ("o'clock")."""
    return re.findall(r"n't|'s\b|[A-Za-z0-9]+(?=n't)|[A-Za-z0-9]+(?:'(?!s\b)[A-Za-z0-9]+)*|[^\sA-Za-z0-9]", caption)


def tag(words: list[str]) -> list[str]:
    """One of "N", "J", "O" per token."""
    low = [w.lower() for w in words]
    out: list[str] = []
    for i, w in enumerate(low):
        prev = low[i - 1] if i else ""
        prev_tag = out[-1] if out else "O"
        nxt = low[i + 1] if i + 1 < len(low) else ""
        if not re.search(r"[a-z]", w) or w in _CLOSED:
            # "next" is an adjective ("the next day") except in "next to", where it is a preposition's part
            out.append("J" if w in _J_CLOSED and not (w == "next" and nxt == "to") else "O")
            continue
        weights = _weights(w.replace("-", "_"))
        if not weights:
            out.append(_guess(w))
            continue
        nominal = prev in _DET or prev_tag == "J" or (prev in _NUM)
        nxt_noun = bool(nxt) and nxt not in _CLOSED and "n" in _weights(nxt) and re.search(r"[a-z]", nxt)
        if w.endswith("ing") and "v" in weights and not nominal:
            out.append("O")                 # "a man riding", "are walking"
            continue
        if w.endswith("ed") and "v" in weights and _lemma(w, "v") != w and not (nominal and "a" in weights):
            out.append("O")                 # "parked on", "filled with"; "a crowded street" stays J
            continue
        if prev == "to" and "v" in weights:
            out.append("O")
            continue
        if prev in _AUX and "a" in weights:
            out.append("J")                 # "is green"
            continue
        if prev_tag == "N" and "v" in weights and w.endswith("s") and not nxt_noun and \
                weights["v"] >= weights.get("n", 0):
            out.append("O")                 # "a man holds a", "a cat sits on"
            continue
        if "n" in weights and "v" in weights and (_lemma(w, "v") == w or (prev.endswith("ing") and prev_tag == "O")):
            weights.pop("v")                # captions inflect their verbs; an -ing verb's object is a noun
        if nominal:
            weights.pop("v", None)
            weights.pop("r", None)
        if "a" in weights and "n" in weights:
            # before a noun an adjective-or-noun word modifies it: adjective when WordNet says so as often
            out.append("J" if nxt_noun and weights["a"] >= 0.5 * weights["n"] else "N" if not nxt_noun and nominal
                       else "J" if weights["a"] >= weights["n"] else "N")
            continue
        if not weights:                     # only verb or adverb readings, ruled out above: neither N nor J
            out.append("O")                 # ("that includes", "a rather small", "the fully furnished")
            continue
        best = max(weights, key=lambda p: (weights[p], p == "n"))
        out.append({"n": "N", "a": "J"}.get(best, "O"))
    return out
