"""Word order and attributes (ARO / SugarCrepe style): the true caption against its perturbations.

A case is (true caption, {category: perturbed caption}) for one image; a scorer wins a case when it
scores the true caption strictly higher; a tie counts half (so a bag-of-words scorer gets 50 % on
any pure reordering by construction). The perturbations come from the datasets: the demo's
relation, attribute and added-object swaps (written by its source stage), or ARO's shuffled
trigrams and words within trigrams (trainers/evaluation/datasets.py: aro_negatives).
"""
from __future__ import annotations

from typing import Callable


def word_order_eval(cases: list[tuple[str, dict[str, str]]], score: Callable[[int, list[str]], list[float]]) -> dict:
    """score(i, captions) -> one score per caption for case i. -> {category: {accuracy, n}}."""
    wins: dict[str, float] = {}
    counts: dict[str, int] = {}
    for i, (true, negs) in enumerate(cases):
        cats = [c for c, text in negs.items() if text != true]
        if not cats:
            continue
        values = score(i, [true] + [negs[c] for c in cats])
        for c, v in zip(cats, values[1:]):
            wins[c] = wins.get(c, 0.0) + (1.0 if values[0] > v else 0.5 if values[0] == v else 0.0)
            counts[c] = counts.get(c, 0) + 1
    return {c: {"accuracy": wins[c] / counts[c], "n": counts[c]} for c in sorted(counts)}
