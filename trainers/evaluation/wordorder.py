"""Word order and attributes (ARO / SugarCrepe style): the true caption against its perturbations.

A case is (true caption, {category: perturbed caption}) for one image. The headline is ARO's:
precision@1, the share of cases where the true caption scores highest among itself and all its
perturbations; ties go to the true caption, as np.argmax over [true, perturbations...] gives them
in ARO's code (so a perturbation that came out identical to the caption cannot lose a case).
The pairwise score per category is kept beside it: true against that one perturbation, a tie
counting half, identical perturbations left out (so a bag-of-words scorer gets 50 % on any pure
reordering by construction). The perturbations come from the datasets: the demo's relation,
attribute and added-object swaps (written by its source stage), or ARO's four
(trainers/evaluation/aro.py).
"""
from __future__ import annotations

from typing import Callable


def word_order_eval(cases: list[tuple[str, dict[str, str]]], score: Callable[[int, list[str]], list[float]]) -> dict:
    """score(i, captions) -> one score per caption for case i.
    -> {"precision_at_1": {accuracy, n}, "pairwise": {category: {accuracy, n}}}."""
    wins: dict[str, float] = {}
    counts: dict[str, int] = {}
    top, n = 0, 0
    for i, (true, negs) in enumerate(cases):
        cats = list(negs)
        if not cats:
            continue
        values = score(i, [true] + [negs[c] for c in cats])
        n += 1
        top += int(max(range(len(values)), key=lambda j: (values[j], -j)) == 0)
        for c, v in zip(cats, values[1:]):
            if negs[c] == true:
                continue
            wins[c] = wins.get(c, 0.0) + (1.0 if values[0] > v else 0.5 if values[0] == v else 0.0)
            counts[c] = counts.get(c, 0) + 1
    return {"precision_at_1": {"accuracy": top / n if n else 0.0, "n": n},
            "pairwise": {c: {"accuracy": wins[c] / counts[c], "n": counts[c]} for c in sorted(counts)}}
