"""Dedup: near-copies of evaluation images are caught (demo, a random transform set, real photos),
clean images are not, results do not depend on worker count, bad evaluation sets are clear errors."""
import io
import json
from pathlib import Path

import numpy as np
import pytest

from stages.base import read_ledger
from PIL import Image

from pipeline.config import load_config
from pipeline.runner import run_pipeline
from stages.source import synthetic
from stages.dedup.eval_sets import EvalSetConfig, build_reference, iter_images
from stages.dedup.imagehash import describe, to_rgb_array
from stages.dedup.neardup import NearDupIndex
from stages.source.stage import DefectFractions
from infra.errors import UserError

PARAMS = {"descriptor": "thumb16-v2", "bits": 256, "colour_tol": 12.0}
THRESHOLD = 0.92  # DedupConfig.eval_threshold


def _matches(index, images):
    vecs, means = map(np.stack, zip(*(describe(im) for im in images)))
    idx, sim = index.search(vecs, means)
    return [(index.ids[i] if i >= 0 else None, s) for i, s in zip(idx, sim)]


def _jpeg(arr, q):
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=q)
    return to_rgb_array(buf.getvalue())


def random_transform(arr, rng, degrees=4.0, crop=0.15, quality=30):
    """Rotation by a few degrees, a crop of up to 15 %, JPEG quality 30, resized to 64 px."""
    im = Image.fromarray(arr)
    w, h = im.size
    im = im.rotate(float(rng.uniform(-degrees, degrees)), resample=Image.BILINEAR,
                   fillcolor=tuple(int(c) for c in arr[0, 0]))
    cw, ch = int(w * rng.uniform(1 - crop, 1.0)), int(h * rng.uniform(1 - crop, 1.0))
    x0, y0 = int(rng.uniform(0, w - cw)), int(rng.uniform(0, h - ch))
    im = im.crop((x0, y0, x0 + cw, y0 + ch)).resize((64, 64), Image.BICUBIC)
    return _jpeg(np.asarray(im), quality)


@pytest.mark.slow   # a few seconds of training or many images: not in the fast set
def test_random_transform_set_on_demo_scenes(tmp_path):
    """A second transform set, drawn at random, to show the method is not tuned to the demo's own."""
    fr = {k: 0 for k in vars(DefectFractions())}
    synthetic.generate(tmp_path / "demo", 1500, 200, 96, 11, fr, 100, 100)
    es = EvalSetConfig(name="demo", kind="builtin", path="demo_heldout")
    # the builtin reads <run_dir>/source/eval, so lay the generated split out that way
    (tmp_path / "run" / "source").mkdir(parents=True)
    (tmp_path / "run" / "source" / "eval").symlink_to(tmp_path / "demo" / "eval")
    path, stats = build_reference(es, tmp_path / "run", tmp_path / "cache", PARAMS, log=lambda m: None)
    assert stats["images"] == 200 and not stats["cached"]
    assert build_reference(es, tmp_path / "run", tmp_path / "cache", PARAMS, log=lambda m: None)[1]["cached"]
    index = NearDupIndex.load(path)
    rng = np.random.default_rng(2026)
    evals = [to_rgb_array(img) for _, img in iter_images(es, tmp_path / "run")]
    copies = [random_transform(a, rng) for a in evals]
    found = _matches(index, copies)
    recall = np.mean([m == f"eval{i:05d}" and s >= THRESHOLD for i, (m, s) in enumerate(found)])
    clean = [_jpeg(to_rgb_array(p.read_bytes()), 90) for p in sorted((tmp_path / "demo" / "www" / "img").glob("*.jpg"))]
    false = np.mean([s >= THRESHOLD for _, s in _matches(index, clean)])
    print(f"random transform set: recall {recall:.3f}, false matches among {len(clean)} clean {100 * false:.2f}%")
    assert recall >= 0.98
    assert false <= 0.005


def _photos():
    from skimage import data
    from sklearn.datasets import load_sample_images

    photos = list(load_sample_images().images)
    for name in ("astronaut", "coffee", "chelsea", "rocket", "camera", "moon", "coins", "immunohistochemistry"):
        photos.append(to_rgb_array(getattr(data, name)()))
    return photos


@pytest.mark.slow   # a few seconds of training or many images: not in the fast set
def test_real_photos_near_copies_caught_and_others_not(tmp_path):
    photos = _photos()
    folder = tmp_path / "photos"
    folder.mkdir()
    refs, others = photos[::2], photos[1::2]
    for i, p in enumerate(refs):
        Image.fromarray(p).save(folder / f"p{i}.png")
    es = EvalSetConfig(name="photos", kind="folder", path=str(folder))
    index = NearDupIndex.load(build_reference(es, None, tmp_path / "cache", PARAMS, log=lambda m: None)[0])
    rng = np.random.default_rng(0)
    variants = []
    for p in refs:
        h, w = p.shape[:2]
        variants += [
            np.asarray(Image.fromarray(p).resize((w // 3, h // 3), Image.BICUBIC)),     # resized
            _jpeg(p, 25),                                                                # re-encoded
            p[int(h * .08):h - int(h * .08), int(w * .08):w - int(w * .08)],             # cropped
            random_transform(p, rng, degrees=0, crop=0.08, quality=40),                  # crop + resize + JPEG
        ]
    found = _matches(index, variants)
    for k, (m, s) in enumerate(found):
        assert m == f"p{k // 4}_png" and s >= THRESHOLD, (k, m, s)
    for m, s in _matches(index, others):
        assert s < THRESHOLD, (m, s)


@pytest.mark.slow   # 4.6 s of indexing: not in the fast set
def test_a_set_whose_images_look_alike_is_measured_and_warned_of(tmp_path):
    """The thumbnail descriptor cannot tell small grey digits apart: a set of them drops digits it does
    not hold. Its likeness is measured when it is indexed, kept with the cached index (and measured for
    an index cached before); where such a set dropped samples the stage warns, naming the settings.
    Real photos are not alike."""
    from stages.dedup.stage import ALIKE_WARN, _alike
    from trainers.evaluation.datasets import digits

    def png(arr):
        buf = io.BytesIO()
        Image.fromarray(np.asarray(arr, np.uint8)).save(buf, "PNG")
        return buf.getvalue()

    imgs = digits()[0]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": [png(a) for a in imgs[:300]]}), tmp_path / "digits.parquet")
    es = EvalSetConfig(name="digits300", kind="parquet", path=str(tmp_path / "digits.parquet"))
    path, stats = build_reference(es, None, tmp_path / "cache", PARAMS, log=lambda m: None)
    assert len(stats["nearest_other"]) == 300 and stats["nearest_other"] == sorted(stats["nearest_other"])
    out = _alike("digits300", stats, THRESHOLD, matched=0)       # it dropped nothing: measured, no warning
    assert out["alike"] > 0.3 and "nearest_other" not in out and "warning" not in out, out
    said = _alike("digits300", stats, THRESHOLD, matched=12)["warning"]
    assert said.startswith("evaluation set digits300: ") and "of the 12 samples dropped as its duplicates" in said
    assert "stages.dedup.encoder_checkpoint an image-copy descriptor" in said and "stages.dedup.eval_threshold (0.92)" in said
    with_encoder = _alike("digits300", stats, THRESHOLD, matched=12, encoder=True)["warning"]
    assert "raise stages.dedup.eval_threshold so that stages.dedup.encoder_checkpoint decides" in with_encoder
    # what it warns of: digits the set does not hold, dropped as its duplicates
    index = NearDupIndex.load(path)
    dropped = np.mean([s >= THRESHOLD for _, s in _matches(index, [to_rgb_array(a) for a in imgs[1000:1400]])])
    assert dropped > ALIKE_WARN, dropped
    # an index cached before the measure: measured once on its next use, the same figures
    meta = path.with_suffix(".json")
    meta.write_text(json.dumps({k: v for k, v in stats.items() if k not in ("nearest_other", "cached")}))
    again = build_reference(es, None, tmp_path / "cache", PARAMS, log=lambda m: None)[1]
    assert again["cached"] and again["nearest_other"] == stats["nearest_other"]
    assert "nearest_other" in json.loads(meta.read_text())
    # real photos, none like another: measured, nothing said
    folder = tmp_path / "photos"
    folder.mkdir()
    for i, p in enumerate(_photos()):
        Image.fromarray(p).save(folder / f"p{i}.png")
    photos = build_reference(EvalSetConfig(name="photos", kind="folder", path=str(folder)), None, tmp_path / "cache",
                             PARAMS, log=lambda m: None)[1]
    assert _alike("photos", photos, THRESHOLD, matched=12) == {**{k: v for k, v in photos.items() if k != "nearest_other"},
                                                               "alike": 0.0, "alike_warn": ALIKE_WARN}


@pytest.mark.slow   # 1.6-5.5 s: kept out of the fast set (under a minute)
def test_bad_evaluation_sets(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        build_reference(EvalSetConfig(name="x", kind="folder", path=str(tmp_path / "nope")), None, tmp_path, PARAMS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no readable images"):
        build_reference(EvalSetConfig(name="x", kind="folder", path=str(tmp_path / "empty")), None, tmp_path, PARAMS)
    (tmp_path / "mixed").mkdir()
    Image.fromarray(_photos()[0]).save(tmp_path / "mixed" / "ok.png")
    (tmp_path / "mixed" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    logs = []
    _, stats = build_reference(EvalSetConfig(name="m", kind="folder", path=str(tmp_path / "mixed")), None,
                               tmp_path / "c", PARAMS, log=logs.append)
    assert stats["images"] == 1 and stats["skipped_unreadable"] == 1
    assert any("skipped unreadable image broken_jpg" in m for m in logs)
    with pytest.raises(UserError, match="no such|unknown|choose one"):
        load_config(None, ["stages.dedup.eval_sets=[{name: a, kind: builtin, path: imagenet}]"])


def test_builtin_sets_read_offline():
    digits = list(iter_images(EvalSetConfig(name="d", kind="builtin", path="digits"), None))
    assert len(digits) == 1797 and digits[0][1].shape == (8, 8)
    from stages.dedup.eval_sets import FASHION_MNIST

    if not FASHION_MNIST.is_file():
        pytest.skip("Debian package dataset-fashion-mnist not installed (make install installs it)")
    fm = iter_images(EvalSetConfig(name="f", kind="builtin", path="fashion_mnist"), None)
    first = next(fm)
    assert first[0] == "test00000" and first[1].shape == (28, 28)


@pytest.mark.slow
def test_demo_dedup_meets_its_targets_and_is_deterministic(tmp_path, ray_local, monkeypatch):
    sets = "stages.dedup.eval_sets=[{name: demo, kind: builtin, path: demo_heldout}]"
    base = ["source.slow_seconds=3", "stages.ingest.timeout=2", "stages.ingest.samples_per_shard=250",
            f"stages.dedup.cache_dir={tmp_path / 'cache'}", sets]
    run_pipeline(load_config(None, base + ["stages.dedup.cpus_per_worker=0.5"]), tmp_path / "run", until="dedup", log=lambda m: None)
    audit = json.loads((tmp_path / "run" / "dedup" / "audit.json").read_text())
    print(audit)
    assert audit["eval_near_copy"]["recall"] >= 0.98
    assert audit["eval_near_copy"]["false_drop_rate"] <= 0.005
    assert audit["repeat_row"]["recall"] == 1.0 and audit["train_near_copy"]["recall"] >= 0.95

    def kept():
        t = read_ledger(tmp_path / "run", "dedup").to_pylist()
        return {r["key"] for r in t if r["verdict"] == "kept"}, {r["key"]: r["detail"] for r in t}

    first = kept()
    stats = json.loads((tmp_path / "run" / "dedup" / "stats.json").read_text())
    assert stats["reduce_tasks"] == {"group": 1, "fetch": 1, "verify": 1}       # small data: one bucket
    assert stats["eval_sets"]["demo"]["alike"] == 0.0 and "warning" not in stats["eval_sets"]["demo"]
    # one task at a time on 2 CPUs, the signatures cut into buckets of ~1,000 rows (a pair found in
    # several buckets is verified once, in its pair bucket): same verdicts, same duplicate_of, same counts
    cut = ["stages.dedup.cpus_per_worker=2", "stages.dedup.bucket_rows=1000"]
    logs = []
    # how the work is cut decides nothing (not in the fingerprint): run the stage again by hand,
    # without the pairs it found (else it carries them and searches nothing: below)
    import shutil

    (tmp_path / "run" / "dedup" / "_SUCCESS").unlink()
    shutil.rmtree(tmp_path / "run" / "dedup" / "edges")
    run_pipeline(load_config(None, base + cut), tmp_path / "run", until="dedup", log=logs.append)
    assert kept() == first
    # the signatures reached the group tasks through the object store: no merged or bucketed copies
    assert not list((tmp_path / "run" / "dedup").glob("_work/signatures*"))
    again = json.loads((tmp_path / "run" / "dedup" / "stats.json").read_text())
    assert again["reduce_tasks"]["group"] >= 9 and again["reduce_tasks"]["verify"] == -(-again["reduce_tasks"]["group"] // 64)
    assert again["pairs"] == stats["pairs"] and stats["pairs"]["near"] > 0 and stats["pairs"]["exact"] > 0
    (tmp_path / "run" / "dedup" / "_SUCCESS").unlink()
    run_pipeline(load_config(None, base + ["stages.dedup.cpus_per_worker=2"]), tmp_path / "run", until="dedup", log=lambda m: None)
    assert kept() == first                       # rerun: same again, every pair carried, nothing searched
    rerun = json.loads((tmp_path / "run" / "dedup" / "stats.json").read_text())
    assert rerun["reduce_tasks"]["group"] == 0 and rerun["edges"]["carried"] == rerun["edges"]["total"] > 0
    details = first[1]
    assert any(d.startswith("duplicate_of=s") for d in details.values())
    rows = read_ledger(tmp_path / "run", "dedup", ["key", "reason", "match_set", "match_key", "detail"]).to_pylist()
    evals = [r for r in rows if r["reason"] == "eval_duplicate"]
    assert evals and all(r["match_set"] == "demo" and r["match_key"].startswith("eval") for r in evals)
    dups = [r for r in rows if r["reason"] in ("exact_duplicate", "near_duplicate")]
    assert dups and all(r["detail"] == f"duplicate_of={r['match_key']}" and r["match_key"] < r["key"] for r in dups)
    # the data grew past a step of the band plan (as if 1,000x larger): the images are not described
    # again, only their signatures made for the wider bands, and the targets still hold
    import stages.dedup.stage as dedup_module
    from stages.dedup.lsh import band_plan

    monkeypatch.setattr(dedup_module, "band_plan", lambda n, t, bits: band_plan(n * 1000, t, bits))
    monkeypatch.setattr(dedup_module, "ALIKE_WARN", -1.0)     # as if the demo's set were alike: it matched samples
    (tmp_path / "run" / "dedup" / "_SUCCESS").unlink()
    logs = []
    run_pipeline(load_config(None, base + ["stages.dedup.cpus_per_worker=2"]), tmp_path / "run", until="dedup", log=logs.append)
    wider = band_plan(1000 * sum(1 for _ in first[1]), 0.97, 256)
    assert wider.width > 16
    assert any("dedup: 2 partitions described before with the same input, reused; 0 to describe" in m for m in logs), logs
    warned = [m for m in logs if m.startswith("dedup: warning: evaluation set demo: 0% of its images")]
    assert len(warned) == 1 and "stages.dedup.encoder_checkpoint" in warned[0], logs
    assert json.loads((tmp_path / "run" / "dedup" / "stats.json").read_text())["eval_sets"]["demo"]["warning"]
    assert not any("signed before" in m for m in logs), logs          # no partition had the wider plan's signatures
    audit = json.loads((tmp_path / "run" / "dedup" / "audit.json").read_text())
    assert audit["eval_near_copy"]["recall"] >= 0.98 and audit["train_near_copy"]["recall"] >= 0.95


def test_signature_buckets_grow_with_the_data_and_the_cluster():
    from stages.dedup.sign import bucket_count

    assert bucket_count(0, 10**6, 64, 17) == 1
    assert bucket_count(563, 10**6, 2, 17) == 1                  # the demo on 2 CPUs: one bucket of 9,571 rows
    assert bucket_count(2000, 10**6, 64, 17) == 1                # small data is not cut into 64 tiny tasks
    assert bucket_count(10**5, 10**6, 1600, 17) == 17            # a big cluster: >= 100,000 rows a task
    assert bucket_count(10**8, 10**6, 200, 33) == 3300           # by size: 10^6 rows a bucket
    assert bucket_count(10**8, 10**6, 5000, 33) == 5000          # by the cluster: every CPU busy
    assert bucket_count(10**9, 10**6, 3200, 42) == 42000         # grows with N, not capped at 64


def test_lsh_bands_widen_with_n_and_keep_recall_at_the_threshold():
    """A band value's expected group (random codes) stays near lsh.GROUP as N grows, and a pair
    exactly at the cosine threshold is found with probability >= lsh.RECALL; checked by drawing
    pairs at the threshold and counting those a band catches."""
    from stages.dedup.lsh import GROUP, RECALL, band_plan, band_values

    plans = {n: band_plan(n, 0.97, 256) for n in (10**3, 10**6, 10**7, 10**8, 10**9)}
    assert [p.width for p in plans.values()] == sorted(p.width for p in plans.values())
    for n, p in plans.items():
        assert n / 2 ** p.width <= GROUP or p.width == 16
        assert p.recall_at(0.97) >= RECALL
    plan = plans[10**7]
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (4000, 32), dtype=np.uint8)
    flips = rng.binomial(256, np.arccos(0.97) / np.pi, len(codes))        # SimHash bits a pair at 0.97 differs by
    twins = np.unpackbits(codes, axis=1)
    for t, k in zip(twins, flips):
        t[rng.choice(256, k, replace=False)] ^= 1
    caught = (band_values(codes, plan) == band_values(np.packbits(twins, axis=1), plan)).any(0)
    assert caught.mean() >= RECALL - 0.01 and abs(caught.mean() - plan.recall_at(0.97)) < 0.012, caught.mean()


def test_a_group_task_pairs_exact_and_near_signatures(tmp_path):
    """The signature rows of two partitions, through the real group task on a local run folder: a
    shared pixel hash pairs its samples as exact, a near copy (3 bits off) as a near candidate, a
    far code and a near code of another colour not at all."""
    from infra.storage import Storage
    from stages.dedup.config import DedupConfig
    from stages.dedup.group import _group_task
    from stages.dedup.layout import PAIR_DIR, PAIR_SCHEMA, WANTED_DIR
    from stages.dedup.sign import signature_table
    from stages.dedup.lsh import band_plan

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (6, 32), dtype=np.uint8)
    codes[1] = codes[0]
    codes[1, 5] ^= 0b10101                     # s1 is 3 bits from s0
    codes[3] = codes[2]
    codes[3, 0] ^= 1                           # s3 is 1 bit from s2 but of another colour
    means = np.zeros((6, 3), np.float32)
    means[3] = 80
    pixels = [bytes([i]) * 16 for i in range(6)]
    pixels[5] = pixels[4]                      # s4, s5: the same pixels
    storage, plan = Storage.local(tmp_path), band_plan(6, 0.97, 256)
    for part, rows in (("p0", [0, 2, 4]), ("p1", [1, 3, 5])):
        t = signature_table([f"s{i}" for i in rows], part, codes[rows], means[rows], [pixels[i] for i in rows],
                            [bytes([100 + i]) * 16 for i in rows], plan)
        from infra.shuffle import write_ranges
        write_ranges(storage, f"sig/{part}.parquet", t, "h32", 3)
    out = _group_task(storage, 0, DedupConfig(), ["sig/p0.parquet", "sig/p1.parquet"], 1, 1)   # one bucket: all rows
    got = storage.read_table(f"{PAIR_DIR}/000000.parquet").select(list(PAIR_SCHEMA.names[:5])).to_pylist()
    assert got == [{"a": "s0", "part_a": "p0", "b": "s1", "part_b": "p1", "kind": "near_duplicate"},
                   {"a": "s4", "part_a": "p0", "b": "s5", "part_b": "p1", "kind": "exact_duplicate"}]
    assert out.pairs == 2 and out.rows == 6 * (2 + plan.bands) and out.largest_group >= 2
    # the near candidate's two sides are asked of their partitions (the exact pair needs no descriptor)
    wanted = storage.read_table(f"{WANTED_DIR}/000000.parquet").select(["key", "part"]).to_pylist()
    assert wanted == [{"key": "s0", "part": "p0"}, {"key": "s1", "part": "p1"}]
    # an append adds p2, whose s6 has s4's pixels: only the groups p2 touches are searched, and only
    # pairs with a side in p2 are kept (s4-s5 and s0-s1 are the line's edges already)
    t = signature_table(["s6"], "p2", codes[[4]], means[[4]], [pixels[4]], [bytes([106]) * 16], plan)
    write_ranges(storage, "sig/p2.parquet", t, "h32", 3)
    files = ["sig/p0.parquet", "sig/p1.parquet", "sig/p2.parquet"]
    out = _group_task(storage, 0, DedupConfig(), files, 1, 1, fresh=frozenset({"p2"}))
    got = storage.read_table(f"{PAIR_DIR}/000000.parquet").select(list(PAIR_SCHEMA.names[:5])).to_pylist()
    assert got == [{"a": "s4", "part_a": "p0", "b": "s6", "part_b": "p2", "kind": k}      # its code too: a candidate
                   for k in ("exact_duplicate", "near_duplicate")]
    assert out.pairs == 2
    _group_task(storage, 0, DedupConfig(), files, 1, 1)              # everything searched
    got = storage.read_table(f"{PAIR_DIR}/000000.parquet").select(["a", "b", "kind"]).to_pylist()
    assert [(r["a"], r["b"], r["kind"][:4]) for r in got] == [("s0", "s1", "near"), ("s4", "s5", "exac"),
                                                                ("s4", "s6", "exac"), ("s4", "s6", "near")]


def test_an_appends_edges_are_the_lines_edges_between_old_partitions_and_its_own(tmp_path):
    """line_edges: the line's edges whose partitions both stayed are carried, the rest dropped; with
    this run's edges they are written sorted as the line's edges for the next run."""
    import pyarrow as pa

    from infra.storage import Storage
    from stages.dedup.components import line_edges
    from stages.dedup.layout import EDGE_SCHEMA

    def edges(rows):
        return pa.table({"a": [r[0] for r in rows], "part_a": [r[1] for r in rows], "b": [r[2] for r in rows],
                         "part_b": [r[3] for r in rows], "kind": ["near_duplicate"] * len(rows),
                         "cosine": [0.99] * len(rows)}, schema=EDGE_SCHEMA)

    storage = Storage.local(tmp_path)
    storage.write_table("line.parquet", edges([("c", "p0", "d", "p1"), ("a", "p0", "e", "p9")]))
    storage.write_table("new/0.parquet", edges([("b", "p2", "z", "p0")]))
    t, carried = line_edges(storage, ["new/0.parquet"], ("line.parquet", frozenset({"p0", "p1"})), "next.parquet")
    assert carried == 1                      # c-d; a-e lost its partition p9
    assert t.select(["a", "b"]).to_pylist() == [{"a": "b", "b": "z"}, {"a": "c", "b": "d"}]
    assert storage.read_table("next.parquet").equals(t)
    t, carried = line_edges(storage, [], None, None)
    assert (t.num_rows, carried) == (0, 0)


def test_an_append_searches_only_its_new_partitions_while_the_line_stands(tmp_path):
    """_fresh_since_line: incremental only when every partition the line's edges came from is here
    with the same signatures; a changed or gone one means a full search."""
    from infra.storage import Storage
    from stages.dedup.layout import LINE_EDGES_RECORD
    from stages.dedup.stage import _fresh_since_line

    storage = Storage.local(tmp_path)
    assert _fresh_since_line(storage, {"p0": "s0"}) == (None, None, {})            # no line yet
    storage.write_bytes("dedup/edges/e1.parquet", b"x")
    chunks = {"dedup/edges/sigs/c.parquet": {"parts": ["p0", "p1"], "rows": 40}}
    storage.write_json(LINE_EDGES_RECORD, {"file": "dedup/edges/e1.parquet", "signed": {"p0": "s0", "p1": "s1"},
                                           "chunks": chunks})
    fresh, carried, got = _fresh_since_line(storage, {"p0": "s0", "p1": "s1", "p2": "s2"})
    assert fresh == {"p2"} and carried == ("dedup/edges/e1.parquet", {"p0", "p1"})
    assert got == chunks
    assert _fresh_since_line(storage, {"p0": "s0", "p1": "s1"})[0] == frozenset()      # nothing new: nothing searched
    assert _fresh_since_line(storage, {"p0": "s0", "p1": "CHANGED", "p2": "s2"})[:2] == (None, None)
    assert _fresh_since_line(storage, {"p0": "s0", "p2": "s2"})[:2] == (None, None)    # p1 gone


def test_an_append_reads_the_lines_signature_chunks_and_keeps_its_new_ones_as_one(tmp_path):
    """_sig_maps and _sig_pieces: a full search keeps each map's signatures as a chunk; an append
    reads the chunks as they are (no rewrite), several to one map task, and its new partitions'
    files, kept as one new chunk; nothing new reads nothing; a chunk gone is read from its
    partitions' files, the others beside it as they are."""
    from types import SimpleNamespace

    import pyarrow as pa

    from infra.storage import Storage
    from stages.dedup.group import _sig_pieces
    from stages.dedup.layout import SIG_SCHEMA
    from stages.dedup.lsh import band_plan
    from stages.dedup.stage import _sig_maps

    plan = band_plan(100, 0.97, 256)
    ctx = SimpleNamespace(cluster_cpus=lambda: 2)
    ups = [SimpleNamespace(part=f"p{i}", kept=10) for i in range(4)]
    signed = {u.part: f"dedup/signed/{u.part}-x" for u in ups}
    maps, chunks = _sig_maps(ctx, ups, signed, plan, None, {})              # everything searched
    assert len(maps) == 2 and all(keep in chunks for _, keep in maps)
    assert sorted(p for c in chunks.values() for p in c["parts"]) == ["p0", "p1", "p2", "p3"]
    more = ups + [SimpleNamespace(part="p4", kept=10), SimpleNamespace(part="p5", kept=10)]
    signed.update(p4="dedup/signed/p4-x", p5="dedup/signed/p5-x")
    maps2, after = _sig_maps(ctx, more, signed, plan, frozenset({"p4", "p5"}), chunks)
    assert len(maps2) == 2 and maps2[0][1] is None                          # the old chunks, as they are,
    assert [u[0] for u in maps2[0][0]] == list(chunks)                      # in one map task
    assert maps2[1][0] == [("dedup/signed/p4-x.sig.parquet", []), ("dedup/signed/p5-x.sig.parquet", [])]
    assert set(after) == set(chunks) | {maps2[1][1]} and after[maps2[1][1]]["parts"] == ["p4", "p5"]
    assert _sig_maps(ctx, more, signed, plan, frozenset(), after) == ([], after)

    storage = Storage.local(tmp_path)
    row = lambda k, part: {"sig_kind": 2, "sig_hi": 1, "sig_lo": 2, "key": k, "part": part,   # noqa: E731
                           "code": b"c", "mean": [0.0, 0.0, 0.0], "h32": 7}
    for p in ("p0", "p1"):
        storage.write_table(f"{p}.sig.parquet", pa.Table.from_pylist([row(f"k{p}", p)], schema=SIG_SCHEMA))
    pieces = _sig_pieces(storage, [("p0.sig.parquet", []), ("p1.sig.parquet", [])], 1, "chunk.parquet")
    assert pieces[0].num_rows == 2 and storage.read_table("chunk.parquet").num_rows == 2
    gone = _sig_pieces(storage, [("gone.parquet", ["p0.sig.parquet", "p1.sig.parquet"])], 1)
    assert sorted(gone[0].column("key").to_pylist()) == ["kp0", "kp1"]
    storage.write_table("p2.sig.parquet", pa.Table.from_pylist([row("kp2", "p2")], schema=SIG_SCHEMA))
    mixed = _sig_pieces(storage, [("gone.parquet", ["p2.sig.parquet"]), ("chunk.parquet", ["p0.sig.parquet"])], 1)
    assert sorted(mixed[0].column("key").to_pylist()) == ["kp0", "kp1", "kp2"]   # the chunk as it is: p1 too


def test_a_dataset_lines_published_samples_stay_kept_in_their_clusters(tmp_path):
    """The components task on a local run folder: without a line, each cluster keeps its smallest
    key; with a line that published b and d (d in a shard the line no longer lists), b is kept and a
    is the duplicate, and a published sample bridged to another published one by a new sample stays."""
    import pyarrow as pa

    from infra.shuffle import read_bucket
    from infra.storage import Storage
    from stages.dedup.components import _components_task, component_roots
    from stages.dedup.layout import DECISION_SCHEMA, DECISIONS, EDGE_SCHEMA
    from stages.shard.line import PUBLISHED_SCHEMA, published_file

    # nodes 0-1-2 and 3-4, 5 alone: each node's root is its component's lowest-ranked node
    ia, ib = np.array([0, 1, 3]), np.array([1, 2, 4])
    assert component_roots(ia, ib, np.arange(6)).tolist() == [0, 0, 0, 3, 3, 5]
    assert component_roots(ia, ib, np.array([5, 4, 0, 1, 2, 3])).tolist() == [2, 2, 2, 3, 3, 5]
    storage = Storage.local(tmp_path)
    edges = [("a", "p0", "b", "p1"), ("c", "p0", "d", "p1"), ("e", "p0", "f", "p1"), ("f", "p1", "g", "p1")]
    storage.write_table("edges/0.parquet", pa.table({
        "a": [e[0] for e in edges], "part_a": [e[1] for e in edges], "b": [e[2] for e in edges],
        "part_b": [e[3] for e in edges], "kind": ["exact_duplicate"] * 4, "cosine": [None] * 4}, schema=EDGE_SCHEMA))
    storage.write_table(published_file("p1"), pa.table({"key": ["b", "d", "f", "g"], "shard": ["000000.tar",
                                                        "000009.tar", "000000.tar", "000001.tar"]},
                                                       schema=PUBLISHED_SCHEMA))

    def dropped(*line):
        out = _components_task(storage, ["edges/0.parquet"], ["p0", "p1"], 5, *line)
        t = pa.concat_tables([read_bucket(storage, [DECISIONS], "part", i, DECISION_SCHEMA) for i in (0, 1)])
        return {k: r for k, r in zip(t.column("key").to_pylist(), t.column("root").to_pylist())}, out

    plain, _ = dropped()
    assert plain == {"b": "a", "d": "c", "f": "e", "g": "e"}
    ruled, out = dropped(frozenset({"000000.tar", "000001.tar"}), frozenset({"p1"}))
    assert ruled == {"a": "b", "d": "c", "e": "f"}        # f and g both published: both stay
    assert out.published_kept == 1


def test_how_dedup_cuts_its_work_is_not_in_its_fingerprint():
    from stages.dedup.stage import DedupStage

    before = DedupStage().fingerprint(load_config(None, []))
    assert DedupStage().fingerprint(load_config(None, ["stages.dedup.bucket_rows=5000"])) == before
    assert DedupStage().fingerprint(load_config(None, ["stages.dedup.within_threshold=0.9"])) != before


def test_changing_a_folder_eval_set_changes_the_dedup_fingerprint(tmp_path):
    from stages.dedup.stage import DedupStage

    (tmp_path / "set").mkdir()
    Image.fromarray(_photos()[0]).save(tmp_path / "set" / "a.png")
    cfg = load_config(None, [f"stages.dedup.eval_sets=[{{name: s, kind: folder, path: {tmp_path / 'set'}}}]"])
    before = DedupStage().fingerprint(cfg)
    assert DedupStage().fingerprint(cfg) == before
    Image.fromarray(_photos()[1]).save(tmp_path / "set" / "b.png")
    assert DedupStage().fingerprint(cfg) != before


def _tar_with(tmp_path, name, add) -> Path:
    import tarfile

    (tmp_path / name).mkdir()
    path = tmp_path / name / "000000.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        ok = tarfile.TarInfo("s0.jpg")
        data = io.BytesIO()
        Image.fromarray(_photos()[0]).save(data, "JPEG")
        ok.size = len(data.getvalue())
        tar.addfile(ok, io.BytesIO(data.getvalue()))
        add(tar)
    return tmp_path / name


def test_untrusted_evaluation_sets_cannot_make_capline_read_what_they_point_at(tmp_path, monkeypatch):
    """A sparse member (a few bytes on disk that read as 300 MB), links and special files in a tar,
    and a symlink to /dev/zero or a FIFO in a folder: each refused naming the member, never read."""
    import os
    import tarfile

    def sparse(tar):
        m = tarfile.TarInfo("s1.jpg")
        m.type, m.size = tarfile.GNUTYPE_SPARSE, 10
        tar.addfile(m, io.BytesIO(b"x" * 10))

    def symlink(tar):
        m = tarfile.TarInfo("s1.jpg")
        m.type, m.linkname = tarfile.SYMTYPE, "/etc/shadow"
        tar.addfile(m)

    def device(tar):
        m = tarfile.TarInfo("s1.jpg")
        m.type, m.devmajor, m.devminor = tarfile.CHRTYPE, 1, 5
        tar.addfile(m)

    for name, add, what in (("sparse", sparse, "a sparse member"), ("link", symlink, "a link"),
                            ("dev", device, "a device or special file")):
        es = EvalSetConfig(name=name, kind="webdataset", path=str(_tar_with(tmp_path, name, add)))
        with pytest.raises(UserError, match=f"member 's1.jpg' is {what}"):
            build_reference(es, None, tmp_path / "c", PARAMS)

    folder = tmp_path / "folder"
    folder.mkdir()
    Image.fromarray(_photos()[0]).save(folder / "a.png")
    os.symlink("/dev/zero", folder / "b.jpg")
    with pytest.raises(UserError, match="b.jpg is a symlink"):
        build_reference(EvalSetConfig(name="f", kind="folder", path=str(folder)), None, tmp_path / "c", PARAMS)
    (folder / "b.jpg").unlink()
    os.mkfifo(folder / "b.jpg")
    with pytest.raises(UserError, match="b.jpg is not a regular file"):
        build_reference(EvalSetConfig(name="f", kind="folder", path=str(folder)), None, tmp_path / "c", PARAMS)
    (folder / "b.jpg").unlink()
    monkeypatch.setattr("infra.tars.MAX_MEMBER_BYTES", 1_000_000)
    (folder / "b.jpg").write_bytes(b"\xff" * 1_000_001)
    with pytest.raises(UserError, match="b.jpg is 1000001 bytes, over 1000000"):
        build_reference(EvalSetConfig(name="f", kind="folder", path=str(folder)), None, tmp_path / "c", PARAMS)


@pytest.mark.slow
def test_the_evaluation_index_built_in_ray_tasks_equals_the_one_built_here(tmp_path, ray_local, monkeypatch):
    import stages.dedup.eval_sets as eval_sets

    folder = tmp_path / "set"
    folder.mkdir()
    for i, photo in enumerate(_photos()[:5]):
        Image.fromarray(photo).save(folder / f"p{i}.png")
    monkeypatch.setattr(eval_sets, "BATCH", 2)     # several tasks for five images
    es = EvalSetConfig(name="s", kind="folder", path=str(folder))
    logs = []
    from pipeline.executor import Executor

    executor = Executor(log=logs.append)
    parallel, _ = build_reference(es, None, tmp_path / "a", PARAMS, log=logs.append, run=executor.run)
    assert any("dedup: indexing s: 3/3" in m for m in logs), logs
    assert executor.records[-1]["tasks"] == 3
    here, _ = build_reference(es, None, tmp_path / "b", PARAMS, log=lambda m: None)   # no executor: in this process
    a, b = np.load(parallel), np.load(here)
    assert list(a["ids"]) == list(b["ids"]) and np.array_equal(a["vecs"], b["vecs"])


def test_the_fetch_tasks_are_sized_by_the_descriptors_wanted_not_the_buckets(tmp_path):
    """The group step cuts the wanted descriptors into fetch buckets before their number is known; the
    driver gives each fetch task consecutive buckets, as many tasks as FETCH_WANTED a task needs: an
    append's few candidates are one task, which fetches what one task per bucket fetches."""
    import pyarrow as pa

    from infra.shuffle import write_buckets
    from infra.storage import Storage
    from stages.dedup.layout import WANTED_SCHEMA
    from stages.dedup.verify import FETCH_WANTED, _fetch_pieces, fetch_spans

    assert fetch_spans(4, 30) == [(0, 4)]
    for n, wanted in ((4, 5 * FETCH_WANTED), (16, 3 * FETCH_WANTED + 1), (16, 10**9), (1, 10**9)):
        spans = fetch_spans(n, wanted)
        assert len(spans) == min(n, -(-wanted // FETCH_WANTED))
        assert [b for lo, hi in spans for b in range(lo, hi)] == list(range(n))      # each bucket once, in order
    storage = Storage.local(tmp_path)
    rng = np.random.default_rng(0)
    desc, rows = {}, {"key": [], "part": [], "pair_bucket": [], "fetch_bucket": []}
    for p in range(8):             # 8 partitions' descriptors, 3 keys each; 2 of each wanted
        keys = [f"k{p}_{i}" for i in range(3)]
        desc[f"p{p}"] = f"d/p{p}.parquet"
        storage.write_table(desc[f"p{p}"], pa.table({"key": keys, "vec": [rng.standard_normal(4).astype(np.float16).tobytes()
                                                                           for _ in keys],
                                                     "detail": [rng.standard_normal(3).astype(np.float16).tobytes()
                                                                for _ in keys]}))
        for k in keys[:2]:
            rows["key"].append(k), rows["part"].append(f"p{p}"), rows["pair_bucket"].append(p % 2), rows["fetch_bucket"].append(p % 4)
    write_buckets(storage, "w/000000.parquet", pa.table(rows, schema=WANTED_SCHEMA), "fetch_bucket")

    def fetched(spans):
        pieces = [_fetch_pieces(storage, span, ["w/000000.parquet"], desc, 2) for span in spans]
        return [sorted(zip(*(pa.concat_tables([p[b] for p in pieces]).column(c).to_pylist() for c in ("key", "vec", "detail"))))
                for b in range(2)]

    one = fetched(fetch_spans(4, 16))
    assert one == fetched([(b, b + 1) for b in range(4)]) and sum(len(b) for b in one) == 16


def test_a_large_lsh_group_is_compared_in_full_not_cut():
    """More codes share one band value than one block holds: every close pair is still found (the
    old code compared only a group's first 2,000 members, silently)."""
    from stages.dedup.lsh import close_pairs_block

    rng = np.random.default_rng(0)
    n = 2600
    codes = rng.integers(0, 256, (n, 32), dtype=np.uint8)
    twin = codes[2500].copy()
    twin[0] ^= 0b101                                   # 2 bits from code 2500
    codes[2599] = twin
    means = np.zeros((n, 3), np.float32)
    words = codes.view(np.uint64)                      # (n, 4): the packed 256-bit codes
    pairs = lambda: {(int(a), int(b)) for ia, ib in close_pairs_block(words, means, 4, 1.0, block=256)  # noqa: E731
                     for a, b in zip(ia, ib)}
    found = pairs()
    assert (2500, 2599) in found
    ham = lambda a, b: int(np.unpackbits(codes[a] ^ codes[b]).sum())   # noqa: E731
    assert all(a < b and ham(a, b) <= 4 for a, b in found)
    means[2599] = 50
    assert (2500, 2599) not in pairs()


def test_exact_copies_in_a_large_group_pair_with_one_representative():
    """A placeholder repeated thousands of times: its copies pair with the first copy (linear), and
    the search runs over one representative with the group's other codes."""
    from stages.dedup.lsh import SMALL_GROUP, collapse_copies

    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (400, 32), dtype=np.uint8)
    means = np.zeros((400, 3), np.float32)
    codes[100:350] = codes[100]                 # rows 100..349: one image 250 times
    means[300:350] = 9                          # ... 50 of them another colour: not the same copy
    small = np.arange(10, 10 + SMALL_GROUP)     # a small group: left whole
    starts, lengths = np.array([10, 100]), np.array([SMALL_GROUP, 300])
    rows, g_starts, g_lengths, ci, cj = collapse_copies(codes, means, starts, lengths)
    assert list(rows[:SMALL_GROUP]) == list(small) and g_starts[0] == 0 and g_lengths[0] == SMALL_GROUP
    kept = rows[g_starts[1]:g_starts[1] + g_lengths[1]]
    assert list(kept) == [100, 300] + list(range(350, 400)) and g_lengths[1] == 52
    assert sorted(zip(ci.tolist(), cj.tolist())) == [(100, j) for j in range(101, 300)] + [(300, j) for j in range(301, 350)]


def test_a_placeholder_repeated_in_every_partition_costs_pairs_linear_in_its_copies(tmp_path):
    """3,000 copies of one image across 3 partitions (every band value shared): the group step
    writes each copy's pair with the first copy, not the 4.5 million pairs of all copies."""
    from infra.shuffle import write_ranges
    from infra.storage import Storage
    from stages.dedup.config import DedupConfig
    from stages.dedup.group import _group_task
    from stages.dedup.layout import PAIR_DIR
    from stages.dedup.sign import signature_table
    from stages.dedup.lsh import band_plan

    rng = np.random.default_rng(2)
    storage, plan, n = Storage.local(tmp_path), band_plan(3600, 0.97, 256), 1200
    blank = rng.integers(0, 256, 32, dtype=np.uint8)
    files = []
    for p in range(3):
        codes = rng.integers(0, 256, (n, 32), dtype=np.uint8)
        codes[:1000] = blank
        keys = [f"p{p}s{i:04d}" for i in range(n)]
        pixels = [b"blank".ljust(16, b"\0") if i < 1000 else rng.bytes(16) for i in range(n)]
        t = signature_table(keys, f"p{p}", codes, np.zeros((n, 3), np.float32), pixels, [rng.bytes(16) for _ in keys], plan)
        write_ranges(storage, f"sig/p{p}.parquet", t, "h32", 1)
        files.append(f"sig/p{p}.parquet")
    out = _group_task(storage, 0, DedupConfig(), files, 1, 1)
    got = storage.read_table(f"{PAIR_DIR}/000000.parquet").to_pylist()
    near = {(r["a"], r["b"]) for r in got if r["kind"] == "near_duplicate"}
    exact = {(r["a"], r["b"]) for r in got if r["kind"] == "exact_duplicate"}
    copies = sorted(f"p{p}s{i:04d}" for p in range(3) for i in range(1000))
    assert near == exact == {(copies[0], c) for c in copies[1:]}
    assert out.largest_group >= 3000 and out.pairs == 2 * 2999


@pytest.mark.slow   # a few seconds of training or many images: not in the fast set
def test_a_torchscript_image_model_is_a_dedup_descriptor(tmp_path):
    """DataComp-style: an image model saved as TorchScript (here a tiny one traced locally) gives the
    encoder embeddings; its output is flattened and unit-normalised; near copies stay near."""
    import io

    import torch
    from PIL import Image

    from infra.errors import ConfigError
    from pipeline.config import load_config
    from stages.dedup.encoder import EncoderDescriber

    class Thumb(torch.nn.Module):
        def forward(self, x):                       # (B, 3, S, S) -> (B, 3*4*4), centred
            t = torch.nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)
            return t - t.mean(dim=1, keepdim=True)

    path = tmp_path / "isc.pt"
    torch.jit.trace(Thumb(), torch.zeros(1, 3, 32, 32)).save(str(path))
    from infra.errors import UserError
    from infra.hashing import hash_file

    sha = hash_file(path)
    with pytest.raises(UserError, match="not the pinned stages.dedup.encoder_sha256"):
        EncoderDescriber(str(path), image_size=32)          # TorchScript is code: never loaded unpinned
    describe = EncoderDescriber(str(path), image_size=32, sha256=sha)

    def png(f):
        img = Image.new("RGB", (48, 40))
        img.putdata([f(x, y) for y in range(40) for x in range(48)])
        buf = io.BytesIO()
        img.save(buf, "PNG")
        return buf.getvalue()

    a = png(lambda x, y: (x * 5, y * 6, 100))
    brighter = png(lambda x, y: (min(255, x * 5 + 8), min(255, y * 6 + 8), 108))
    other = png(lambda x, y: (255 - y * 6, x * 5, 30))
    va, vb, vc = (describe(i)[0] for i in (a, brighter, other))
    assert va.shape == (48,) and abs(np.linalg.norm(va) - 1) < 1e-4
    assert float(va @ vb) >= 0.95 > float(va @ vc)
    with pytest.raises(ConfigError, match=f"runs code when it is loaded; to run it, pin it with "
                                          f"stages.dedup.encoder_sha256: {sha}"):
        load_config(None, [f"stages.dedup.encoder_checkpoint={path}", "stages.dedup.encoder_image_size=32"])
    with pytest.raises(ConfigError, match="the file changed since it was pinned"):
        load_config(None, [f"stages.dedup.encoder_checkpoint={path}", "stages.dedup.encoder_sha256=" + "ab" * 32])
    pinned = load_config(None, [f"stages.dedup.encoder_checkpoint={path}", "stages.dedup.encoder_image_size=32",
                                f"stages.dedup.encoder_sha256={sha}"])
    from stages.dedup.stage import DedupStage

    DedupStage().preflight(pinned)          # what `capline run` checks first accepts what validation did
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="neither a capline model directory nor a TorchScript file"):
        load_config(None, [f"stages.dedup.encoder_checkpoint={tmp_path / 'weights.bin'}"])


@pytest.mark.slow
def test_dedup_runs_a_torchscript_encoder_in_its_tasks(tmp_path, ray_local):
    import torch

    from infra.hashing import hash_file

    from helpers import free_port

    class Thumb(torch.nn.Module):
        def forward(self, x):
            t = torch.nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)
            return t - t.mean(dim=1, keepdim=True)

    path = tmp_path / "isc.pt"
    torch.jit.trace(Thumb(), torch.zeros(1, 3, 32, 32)).save(str(path))
    cfg = load_config(None, ["source.num_samples=120", "source.eval_size=30", "source.slow_seconds=2",
                             "stages.ingest.timeout=1", "stages.ingest.samples_per_shard=60", f"source.serve_port={free_port()}",
                             f"stages.dedup.cache_dir={tmp_path / 'cache'}", f"stages.dedup.encoder_checkpoint={path}",
                             "stages.dedup.encoder_image_size=32", f"stages.dedup.encoder_sha256={hash_file(path)}",
                             "stages.dedup.eval_sets=[{name: demo, kind: builtin, path: demo_heldout}]"])
    summary = run_pipeline(cfg, tmp_path / "run", until="dedup", log=lambda m: None)
    assert summary["dedup"]["in"] == summary["dedup"]["kept"] + sum(summary["dedup"]["dropped"].values())
    assert summary["dedup"]["dropped"].get("eval_duplicate", 0) > 0
    assert list((tmp_path / "cache").rglob("*")), "no evaluation index was built"


@pytest.mark.slow   # starts Ray, a moto server or capline processes: not in the fast set
def test_the_evaluation_index_reaches_workers_as_shared_arrays_not_copies(tmp_path, ray_local):
    """The index's vectors in a worker are the object store's read-only memory (every process of a
    node reads the same pages), and it finds what the index built here finds."""
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(300, 768)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    built = NearDupIndex(colour_tol=None).build([f"e{i}" for i in range(300)], vecs, np.zeros((300, 3), np.float32))
    built.save(tmp_path / "idx.npz")
    loaded = NearDupIndex.load(tmp_path / "idx.npz")
    assert np.array_equal(loaded.codes, built.codes)          # codes kept, not recomputed
    queries = vecs[[5, 17, 250]] + 0.01 * rng.normal(size=(3, 768)).astype(np.float32)
    def probe(blobs, queries):       # in a Ray worker (defined here: pickled by value, not by module)
        from stages.dedup.neardup import NearDupIndex

        index = NearDupIndex.from_arrays(blobs["s"])
        idx, sim = index.search(queries, np.zeros((len(queries), 3), np.float32))
        return bool(index.vecs.flags.writeable), [str(index.ids[i]) for i in idx], sim.tolist()

    blobs = ray_local.put({"s": loaded.arrays()})
    writeable, ids, sims = ray_local.get(ray_local.remote(probe).remote(blobs, queries))
    assert not writeable                                       # a view of shared memory, not a copy
    assert ids == ["e5", "e17", "e250"] and min(sims) > 0.99
    assert ids == [str(loaded.ids[i]) for i in loaded.search(queries, np.zeros((3, 3), np.float32))[0]]


def test_an_evaluation_folder_is_read_again_only_when_its_files_change(tmp_path, monkeypatch):
    """The set's digest (what its index is cached by) is kept beside the cache, by the files'
    names, sizes and mtimes: a rerun does not read every evaluation image to digest it."""
    import stages.dedup.eval_sets as eval_sets

    folder = tmp_path / "set"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(folder / f"{i}.png")
    es = EvalSetConfig(name="s", kind="folder", path=str(folder))
    first = eval_sets.cached_digest(es, None, tmp_path / "cache")
    assert first == eval_sets.content_digest(es, None)
    reads = []
    real = eval_sets.iter_images
    monkeypatch.setattr(eval_sets, "iter_images", lambda *a: reads.append(1) or real(*a))
    assert eval_sets.cached_digest(es, None, tmp_path / "cache") == first and not reads
    Image.fromarray(np.full((16, 16, 3), 200, np.uint8)).save(folder / "3.png")     # a new image
    assert eval_sets.cached_digest(es, None, tmp_path / "cache") != first and reads


def test_an_inverted_file_travels_trained_and_is_never_trained_again(tmp_path, monkeypatch):
    """Past `ivf_above` references the Hamming index is an inverted file, whose training is what
    costs (~220 s a process for a 50,000-image set here): the index saved and shipped carries it
    trained, and a worker or a later load reads it back and finds what the trained one finds."""
    import stages.dedup.neardup as neardup

    rng = np.random.default_rng(1)
    vecs = rng.normal(size=(3000, 64)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    built = NearDupIndex(colour_tol=None, ivf_above=1000).build([f"e{i}" for i in range(3000)], vecs,
                                                               np.zeros((3000, 3), np.float32))
    assert isinstance(built.index, neardup.faiss.IndexBinaryIVF) and "trained" in built.arrays()
    exact = NearDupIndex(colour_tol=None).build(["a"], vecs[:1], np.zeros((1, 3), np.float32))
    assert "trained" not in exact.arrays()                     # an exact index is rebuilt from its codes
    built.save(tmp_path / "idx.npz")
    queries = vecs[[3, 1500, 2999]] + 0.01 * rng.normal(size=(3, 64)).astype(np.float32)
    want = built.search(queries, np.zeros((3, 3), np.float32))[0]

    def never(*a, **k):
        raise AssertionError("trained again")

    monkeypatch.setattr(neardup, "binary_index", never)
    for again in (NearDupIndex.from_arrays(built.arrays(), ivf_above=1000), NearDupIndex.load(tmp_path / "idx.npz", 1000)):
        assert again.index.nprobe == neardup.NPROBE and again.index.ntotal == 3000
        assert np.array_equal(again.search(queries, np.zeros((3, 3), np.float32))[0], want)
    assert list(want) == [3, 1500, 2999]
    # an inverted file's results depend on how many lists it visits: descriptions searched through one
    # are reused under that plan only; where every index is exact the key is what it always was
    from stages.dedup.describe import _described_key

    u = type("U", (), {"part": "p0", "sha256": "ab"})()
    plan = neardup.search_plan(built.arrays())
    assert plan == f"ivf-nprobe{neardup.NPROBE}" and neardup.search_plan(exact.arrays()) == ""
    assert _described_key("f", u, plan) != _described_key("f", u) == _described_key("f", u, "")
    import hashlib

    from stages.dedup.describe import DESCRIBED_LAYOUT, WITHIN_DESCRIPTOR

    before = json.dumps(["f", WITHIN_DESCRIPTOR, DESCRIBED_LAYOUT, "p0", "ab"])   # a line's keys before IVF plans
    assert _described_key("f", u) == f"p0-{hashlib.sha256(before.encode()).hexdigest()[:16]}"
    from stages.dedup.describe import eval_search

    assert eval_search({"hash": {"big": built.arrays(), "small": exact.arrays()}, "encoder": {}}) == f"flat-bars+{plan}"
    assert eval_search({"hash": {"small": exact.arrays()}, "encoder": {}}) == "flat-bars"   # framed pictures searched too
    assert eval_search({"hash": {}, "encoder": {}}) == ""
    monkeypatch.setattr(neardup, "NPROBE", 16)
    assert _described_key("f", u, neardup.search_plan(built.arrays())) != _described_key("f", u, plan)


def test_invalid_utf8_in_an_evaluation_sets_captions_is_read_with_replacement_not_a_traceback(tmp_path):
    """Parquet does not check a string column's UTF-8: such a caption ended the run after its downloads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.dedup.eval_sets import EvalSetConfig, iter_captions

    bad = pa.array([b"a clean caption", b"bad \xff\xfe caption"], pa.binary()).view(pa.string())
    listed = pa.array([[b"one"], [b"two \xff", b"three"]], pa.list_(pa.binary())).cast(pa.list_(pa.binary()))
    pq.write_table(pa.table({"caption": bad, "captions": listed.view(pa.list_(pa.string())), "id": ["a", "b"]}),
                   tmp_path / "set.parquet")
    one = EvalSetConfig(name="x", kind="parquet", path=str(tmp_path / "set.parquet"), id_col="id", caption_col="caption")
    assert list(iter_captions(one)) == [("a", "a clean caption"), ("b", "bad \ufffd\ufffd caption")]
    many = EvalSetConfig(name="x", kind="parquet", path=str(tmp_path / "set.parquet"), id_col="id", caption_col="captions")
    assert list(iter_captions(many)) == [("a", "one"), ("b", "two \ufffd"), ("b", "three")]
    # and `capline check` names them before a run, by column and first row; a clean column says nothing
    from stages.dedup.eval_sets import caption_notes

    (note,) = caption_notes(one)
    assert "evaluation set x: 1 caption(s)" in note and "column 'caption' are not valid UTF-8 (first: row 1)" in note
    (note,) = caption_notes(many)
    assert "(first: row 1 of the flattened lists)" in note
    pq.write_table(pa.table({"caption": ["fine", "also fine"]}), tmp_path / "clean.parquet")
    assert caption_notes(EvalSetConfig(name="c", kind="parquet", path=str(tmp_path / "clean.parquet"),
                                       caption_col="caption")) == []
