"""Word order and attributes (ARO / SugarCrepe style) on scenes with known objects.

For each scene with two or more objects: the true caption against (1) the two object phrases
swapped around the relation ("A left of B" -> "B left of A"), (2) the attributes (colours) of the
two objects swapped, (3) a plausible object added that is not in the scene. A scorer wins a case
when it scores the true caption strictly higher; a tie counts half (so a bag-of-words scorer gets
50 % on relation order by construction).
"""
from __future__ import annotations

from typing import Callable

from stages.synthetic import COLOURS, SHAPES, SIZES, Obj, Scene, caption_en


def hard_negatives(scene: Scene) -> dict[str, str]:
    a, b = scene.objects[0], scene.objects[1]
    swapped_order = caption_en(Scene((b, a) + scene.objects[2:], scene.background, scene.texture_seed))
    # keep the relation of the true scene, with the phrases exchanged
    true = caption_en(scene)
    pa, pb = f"a {a.size} {a.colour} {a.shape}", f"a {b.size} {b.colour} {b.shape}"
    relation_swap = true.replace(pa, "\0").replace(pb, pa).replace("\0", pb) if pa != pb else swapped_order
    a2 = Obj(a.shape, b.colour, a.size, a.x, a.y)
    b2 = Obj(b.shape, a.colour, b.size, b.x, b.y)
    attribute_swap = caption_en(Scene((a2, b2) + scene.objects[2:], scene.background, scene.texture_seed))
    present = {(o.shape, o.colour) for o in scene.objects}
    extra = next((s, c) for c in COLOURS for s in SHAPES if (s, c) not in present)
    added = true + f" and a {sorted(SIZES)[0]} {extra[1]} {extra[0]}"
    return {"relation_order": relation_swap, "attribute_swap": attribute_swap, "added_object": added}


def word_order_eval(scenes: list[Scene], score: Callable[[int, list[str]], list[float]]) -> dict:
    """score(i, captions) -> one score per caption for scene i. -> {category: accuracy, n}."""
    wins: dict[str, float] = {}
    counts: dict[str, int] = {}
    for i, sc in enumerate(scenes):
        if len(sc.objects) < 2 or sc.objects[0].colour == sc.objects[1].colour:
            continue
        negs = hard_negatives(sc)
        true = caption_en(sc)
        cats = [c for c, text in negs.items() if text != true]
        values = score(i, [true] + [negs[c] for c in cats])
        for c, v in zip(cats, values[1:]):
            wins[c] = wins.get(c, 0.0) + (1.0 if values[0] > v else 0.5 if values[0] == v else 0.0)
            counts[c] = counts.get(c, 0) + 1
    return {c: {"accuracy": wins[c] / counts[c], "n": counts[c]} for c in sorted(counts)}
