"""Evaluation captions found in alt-text, on real COCO captions (val2017, tests/trainers/data)."""
import random
from pathlib import Path

from stages.dedup.caption_match import CaptionIndex, words

COCO = Path(__file__).resolve().parent.parent / "trainers" / "data" / "coco-val-captions.txt"


def test_words_are_normalised_as_alt_text_needs():
    assert words("A <b>Dog</b>, running!  ON the beach…") == ["a", "dog", "running", "on", "the", "beach"]
    assert words("Ｆｕｌｌ－width ＣＡＴ's toy") == ["full", "width", "cat's", "toy"]
    assert words(None) == [] and words("") == []


def test_planted_evaluation_captions_are_found_and_clean_alt_text_is_left():
    """2,000 COCO captions as the evaluation set, the other 2,000 as clean alt-text; 300 evaluation
    captions planted in alt-text exactly, re-cased, and inside longer text (a stock-photo title):
    recall >= 0.95; of the clean captions that are not word for word an evaluation caption (COCO's
    annotators wrote some captions identically for different images), < 0.5 % matched."""
    caps = COCO.read_text().splitlines()
    ev, clean = caps[:2000], caps[2000:]
    index = CaptionIndex()                    # the defaults: 10 words in common, whole captions of >= 6 words
    for i, c in enumerate(ev):
        index.add("coco", str(i), c)
    rng = random.Random(0)
    planted = rng.sample(range(len(ev)), 300)
    forms = [lambda c: c, lambda c: c.upper(),
             lambda c: f"Stock photo: {c.lower().rstrip('.')} | free download 1920x1080"]
    found = [index.match(forms[j % 3](ev[i])) for j, i in enumerate(planted)]
    # a hit names the planted caption, or one its annotators wrote word for word the same
    recall = sum(1 for f, i in zip(found, planted) if f and words(ev[int(f[1])]) == words(ev[i])) / len(planted)
    assert recall >= 0.95, recall
    hows = {f[2] for f in found if f}
    assert hows == {"whole caption", "caption inside the alt-text", "10 words in common"}, hows
    same = {tuple(words(c)) for c in ev}
    false = [c for c in clean if tuple(words(c)) not in same and index.match(c)]
    assert len(false) / len(clean) < 0.005, false[:5]
    short = CaptionIndex()
    short.add("s", "1", "a dog on a beach")   # five words: what every caption says, never matched
    assert short.captions == 0 and short.match("a dog on a beach") is None


def test_dedup_drops_or_flags_alt_text_holding_an_evaluation_caption(tmp_path):
    """The dedup stage's verdicts with a parquet evaluation set that has captions: drop (reason
    eval_caption, the set and caption named), flag (kept, its row naming the caption), a set without
    the caption column named in one line."""
    import dataclasses

    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    from infra.errors import UserError
    from infra.storage import Storage
    from stages.dedup.config import DedupConfig
    from stages.dedup.verdicts import _eval_captions, _verdicts
    from stages.dedup.eval_sets import EvalSetConfig, iter_captions

    caps = COCO.read_text().splitlines()
    pq.write_table(pa.table({"image": [b"x"] * 3, "id": ["i1", "i2", "i3"],
                             "captions": [[caps[0], caps[1]], [caps[5]], []]}), tmp_path / "eval.parquet")
    es = EvalSetConfig(name="coco", kind="parquet", path=str(tmp_path / "eval.parquet"), id_col="id", caption_col="captions")
    assert [i for i, _ in iter_captions(es)] == ["i1", "i1", "i2"]
    storage = Storage.local(tmp_path / "run")
    alt = {"k1": f"Buy now! {caps[1]} (photo 3 of 7)", "k2": caps[5].upper(), "k3": caps[3000], "k4": None}
    table = pa.table({"key": list(alt), "caption": list(alt.values())})
    storage.write_table("desc.parquet", pa.table({"key": list(alt), "ok": [True] * 4, "eval_set": [""] * 4,
                                                  "eval_id": [""] * 4, "eval_sim": [-1.0] * 4}))
    for mode, verdicts in (("drop", {"k1": "dropped", "k2": "dropped", "k3": "kept", "k4": "kept"}),
                           ("flag", {k: "kept" for k in alt})):
        cfg = DedupConfig(eval_sets=[es], caption_match=mode)
        captions = _eval_captions(storage, cfg)
        assert captions[2] == 3
        out, extra = _verdicts(table, "p0", 0, False, cfg, storage=storage, desc="desc.parquet", captions=captions)
        rows = {r["key"]: r for r in out.to_pylist()}
        assert {k: r["verdict"] for k, r in rows.items()} == verdicts
        assert rows["k1"]["match_set"] == "coco" and rows["k1"]["match_key"] == "i1"
        assert rows["k2"]["match_key"] == "i2" and extra["caption_matches"] == {"coco": 2}
        if mode == "drop":
            assert rows["k1"]["reason"] == "eval_caption" and "coco:i1" in rows["k1"]["detail"]
        else:
            assert rows["k1"]["detail"].startswith("flag: ")
    assert _eval_captions(storage, dataclasses.replace(cfg, caption_match="off")) is None
    with pytest.raises(UserError, match="has no column 'text'"):
        list(iter_captions(dataclasses.replace(es, caption_col="text")))


def test_a_worker_builds_the_caption_index_once_for_all_its_verdict_tasks(tmp_path, monkeypatch):
    """Every verdict task rebuilt the evaluation captions' index (an 11.6 MB caption: 11.8 s and
    554 MB a task); a worker process now builds it once per captions file and digest."""
    import pyarrow as pa

    from infra.storage import Storage
    from stages.dedup.config import DedupConfig
    from stages.dedup import verdicts

    storage = Storage.local(tmp_path)
    t = pa.table({"set": ["coco"], "id": ["1"], "caption": ["a man rides a red bicycle down a busy street"]})
    digest = storage.write_table(verdicts.CAPTIONS, t)[0][:16]
    reads = []
    real = storage.read_table
    monkeypatch.setattr(storage, "read_table", lambda *a, **k: reads.append(a) or real(*a, **k))
    cfg = DedupConfig()
    first = verdicts._caption_index(storage, (verdicts.CAPTIONS, digest, 1), cfg)
    assert verdicts._caption_index(storage, (verdicts.CAPTIONS, digest, 1), cfg) is first and len(reads) == 1
    assert first.match("photo: a man rides a red bicycle down a busy street")
    storage.write_table(verdicts.CAPTIONS, pa.table({"set": ["coco"], "id": ["2"],
                                                     "caption": ["two dogs sleep on a green sofa by the window"]}))
    other = verdicts._caption_index(storage, (verdicts.CAPTIONS, "another digest", 1), cfg)
    assert other is not first and len(reads) == 2 and other.match("two dogs sleep on a green sofa by the window")
