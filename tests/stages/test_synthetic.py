"""Unit: the demo generator is deterministic, plants what it says, and captions tell the truth."""
import hashlib

import numpy as np
import pyarrow.parquet as pq
import pytest

from stages.source import synthetic
from stages.source.stage import DefectFractions


def _digest(folder):
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _gen(path, seed=0, n=200):
    return synthetic.generate(path, n, 20, 48, seed, vars(DefectFractions()), 3000, 100_000)


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert _gen(a) == _gen(b)
    _gen(c, seed=1)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


@pytest.mark.slow   # 1-1.3 s: kept out of the fast set (under a minute)
def test_defects_planted_at_configured_counts(tmp_path):
    counts = _gen(tmp_path, n=1000)
    f = DefectFractions()
    assert counts["non_english"] == round(f.non_english * 1000)
    assert counts["http_404"] == round(f.http_404 * 1000)
    assert counts["huge_pixels"] == 2 and counts["huge_bytes"] == 2
    assert sum(counts.values()) == 1000
    gt = pq.read_table(tmp_path / "_ground_truth.parquet").to_pylist()
    urls = {r["key"]: r for r in pq.read_table(tmp_path / "urls.parquet").to_pylist()}
    for row in gt:
        url = urls[row["key"]]["url"]
        assert url.startswith(synthetic.SERVER_PLACEHOLDER)
        if row["defect"] == "http_404":
            assert "/status/404/" in url
        if row["defect"] == "non_english":
            assert urls[row["key"]]["caption"] != row["true_caption"]
        if row["defect"] == "clean":
            assert urls[row["key"]]["caption"] == row["true_caption"]


def test_captions_state_the_true_relation():
    a = synthetic.Obj("circle", "red", "large", 0.2, 0.5)
    b = synthetic.Obj("square", "blue", "small", 0.8, 0.5)
    scene = synthetic.Scene((a, b), (220, 220, 220), 0)
    assert synthetic.caption_en(scene) == "a large red circle to the left of a small blue square"
    flipped = synthetic.Scene((b, a), (220, 220, 220), 0)
    assert synthetic.caption_en(flipped) == "a small blue square to the right of a large red circle"
    assert synthetic.caption_foreign(scene, "de") == "ein großer roter Kreis links von ein kleiner blauer Quadrat"


def test_render_puts_the_colour_where_the_object_is():
    a = synthetic.Obj("square", "red", "large", 0.25, 0.5)
    img = np.asarray(synthetic.render(synthetic.Scene((a,), (230, 230, 230), 0), 64)).astype(int)
    left, right = img[28:36, 12:20].mean((0, 1)), img[28:36, 44:52].mean((0, 1))
    assert left[0] > 180 and left[2] < 100      # red where the square is
    assert abs(right[0] - right[2]) < 40         # background elsewhere


def test_eval_split_has_labels(tmp_path):
    _gen(tmp_path)
    ev = pq.read_table(tmp_path / "eval" / "eval.parquet").to_pylist()
    assert len(ev) == 20
    for r in ev:
        assert (tmp_path / "eval" / r["path"]).is_file()
        assert r["shape"] in synthetic.SHAPES and 1 <= r["count"] <= 3
        first = r["caption"].split(" to the ")[0].split(" above ")[0].split(" below ")[0]
        assert r["shape"] in first and r["colour"] in first


@pytest.mark.slow   # seconds: kept out of the fast set (its 45 s budget)
def test_evaluation_captions_planted_in_alt_text_and_the_leaks_by_chance_are_recorded(tmp_path):
    """The demo plants held-out captions in alt-text (exact, re-cased, inside longer text) from
    their own random stream, so every other defect lands where it did; a clean caption that holds
    a held-out caption of 6+ words by chance (the grammar is small) is recorded as the leak it is,
    and every caption still called clean holds none."""
    from stages.dedup.caption_match import words

    fractions = vars(DefectFractions())
    synthetic.generate(tmp_path / "a", 1000, 200, 48, 0, fractions, 3000, 300_000)
    synthetic.generate(tmp_path / "b", 1000, 200, 48, 0, {**fractions, "eval_caption": 0}, 3000, 300_000)
    gt = {r["key"]: r for r in pq.read_table(tmp_path / "a" / "_ground_truth.parquet").to_pylist()}
    without = {r["key"]: r for r in pq.read_table(tmp_path / "b" / "_ground_truth.parquet").to_pylist()}
    urls = {r["key"]: r["caption"] for r in pq.read_table(tmp_path / "a" / "urls.parquet").to_pylist()}
    held = {r["id"]: r["caption"] for r in pq.read_table(tmp_path / "a" / "eval" / "eval.parquet").to_pylist()}
    planted = [k for k, r in gt.items() if r["defect"] == "eval_caption" and not r["detail"].endswith("by chance")]
    assert len(planted) == round(fractions["eval_caption"] * 1000)
    assert {r["detail"].split(":")[1] for k, r in gt.items() if k in planted} == {"exact", "re-cased",
                                                                                   "inside longer text"}
    for k in planted:
        e, how = gt[k]["detail"].split(":")
        w, c = words(urls[k]), words(held[e])
        assert len(c) >= synthetic.HELDOUT_CAPTION_WORDS
        assert any(w[i:i + len(c)] == c for i in range(len(w) - len(c) + 1)), (urls[k], held[e])
        assert (urls[k] == held[e]) == (how == "exact")
    # the other defects are where they were without the plants
    for k, r in gt.items():
        if r["defect"] not in ("eval_caption", "clean"):
            assert without[k]["defect"] == r["defect"], k
    long_held = [f" {c} " for c in held.values() if len(c.split()) >= synthetic.HELDOUT_CAPTION_WORDS]
    chance = [k for k, r in gt.items() if r["detail"].endswith("by chance")]
    chance_without = [k for k, r in without.items() if r["detail"].endswith("by chance")]
    assert chance and set(chance) <= set(chance_without)
    clean = [k for k, r in gt.items() if r["defect"] == "clean"]
    assert not [k for k in clean if any(c in f" {urls[k]} " for c in long_held)]
    assert len(chance_without) / len(without) < 0.05
