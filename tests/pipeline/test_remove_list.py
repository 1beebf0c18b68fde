"""Removal lists: what a line of the list means, and which later samples a removal blocks."""
import numpy as np
import pyarrow as pa
import pytest

from infra.errors import UserError
from infra.storage import Storage
from pipeline import remove
from stages.shard import removals


def test_a_list_names_urls_keys_hashes_and_images_by_their_shape_or_prefix(tmp_path):
    from PIL import Image

    Image.new("RGB", (20, 20), (200, 10, 10)).save(tmp_path / "photo.png")
    sha = "ab" * 32
    (tmp_path / "list.txt").write_text(
        "# takedowns of 2026-12-01\n"
        "https://example.com/a.jpg#frag\n"
        "u0123456789abcdef   # a key\n"
        f"{sha.upper()}\n"
        "photo.png\n"
        "\n"
        "url https://example.com/b.jpg\n"
        "key ukey-that-is-not-hex\n"
        "url https://example.com/c.jpg#part-2   # opted out\n")
    got = [(e.kind, e.value, e.line) for e in remove.parse_list(tmp_path / "list.txt")]
    assert got == [("url", "https://example.com/a.jpg#frag", 2), ("key", "u0123456789abcdef", 3),
                   ("sha256", sha, 4), ("image", "photo.png", 5), ("url", "https://example.com/b.jpg", 7),
                   ("key", "ukey-that-is-not-hex", 8),
                   ("url", "https://example.com/c.jpg#part-2", 9)]   # the fragment is the URL's (recheck writes these)
    (tmp_path / "bad.txt").write_text("https://example.com/a.jpg\nnot anything\n")
    with pytest.raises(UserError, match=r"bad.txt:2: 'not anything' is not a URL"):
        remove.parse_list(tmp_path / "bad.txt")
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(UserError, match="no entries"):
        remove.parse_list(tmp_path / "empty.txt")
    (tmp_path / "gone.txt").write_text("image missing.png\n")
    with pytest.raises(UserError, match="missing.png does not exist"):
        remove.parse_list(tmp_path / "gone.txt")
    # an image entry is a picture: no link to follow, no 3 GB sparse file read whole
    (tmp_path / "link.png").symlink_to(tmp_path / "photo.png")
    (tmp_path / "huge.png").touch()
    import os

    os.truncate(tmp_path / "huge.png", 3 << 30)
    for name in ("link.png", "huge.png"):
        (tmp_path / "img.txt").write_text(f"image {name}\n")
        with pytest.raises(UserError, match=f"image {name} is a symbolic link or over 64 MiB"):
            remove.parse_list(tmp_path / "img.txt")


def _vec(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=768).astype(np.float32)
    return v / np.linalg.norm(v)


def test_a_later_sample_is_blocked_by_key_url_hash_or_as_a_near_copy(tmp_path):
    storage = Storage.local(tmp_path)
    f16 = lambda v: v.astype(np.float16).tobytes()   # noqa: E731
    removed = [
        (1, "url", "https://x/a.jpg", None, None, None, None, 0.97, "takedown"),
        (1, "sample", "key", "ugone", "https://x/g.jpg", "s" * 64, f16(_vec(1)), 0.97, "takedown"),
        (2, "image", "p.png", None, None, None, f16(_vec(2)), 0.9, "safety list"),
        (2, "sha256", "h" * 64, None, None, None, None, 0.9, "safety list"),
    ]
    # as a line removed from before the detail descriptor was recorded wrote it: the thumbnail alone
    before = pa.schema(list(remove.REMOVED_SCHEMA)[:9])
    storage.write_table(remove.REMOVED, pa.table({c: [r[i] for r in removed] for i, c in enumerate(before.names)},
                                                 schema=before))
    rows = {"k1": ("https://x/a.jpg", "1" * 64), "ugone": ("https://x/other.jpg", "2" * 64),
            "k3": ("https://x/g.jpg", "3" * 64), "k4": ("https://x/d.jpg", "h" * 64),
            "k5": ("https://x/e.jpg", "5" * 64), "k6": ("https://x/f.jpg", "6" * 64), "k7": ("https://x/h.jpg", "7" * 64)}
    table = pa.table({"key": list(rows), "url": [u for u, _ in rows.values()], "sha256": [s for _, s in rows.values()]})
    near = _vec(2) + 0.05 * _vec(9)                  # a near copy of the removed image
    vecs = {"k5": f16(near / np.linalg.norm(near)), "k6": f16(_vec(3)), "k7": f16(_vec(1))}
    got = removals.blocked(storage, table, vecs)
    assert set(got) == {"k1", "ugone", "k3", "k4", "k5", "k7"}
    assert got["k1"].startswith("removal 1 (url)") and got["ugone"].startswith("removal 1 (key)")
    assert got["k3"].startswith("removal 1 (url)") and got["k4"].startswith("removal 2 (sha256)")
    assert "near copy of p.png" in got["k5"] and "safety list" in got["k5"]
    assert "near copy of ugone" in got["k7"]
    assert removals.blocked(Storage.local(tmp_path / "none"), table, vecs) == {}
    # with the removals' digest, a worker reads and indexes the file once for all its verdict tasks
    # (each task read it whole: 10^6 entries, 4.9 s and 688 MB a task); a new digest reads it again
    reads = []
    real = storage.read_table
    storage.read_table = lambda *a, **k: reads.append(a) or real(*a, **k)
    assert removals.blocked(storage, table, vecs, digest="d1") == got
    assert removals.blocked(storage, table, vecs, digest="d1") == got and len(reads) == 1
    removals.blocked(storage, table, vecs, digest="d2")
    assert len(reads) == 2


def test_the_lookup_finds_entries_in_the_buckets_they_hash_to_over_every_run(tmp_path):
    """Two runs' lookups (3 and 1 buckets): a URL, a key and a sha256 are found in whichever run added
    them, by reading only the bucket files they hash to; a value nobody published finds nothing."""
    from stages.shard import line_lookup as lk

    storage = Storage.local(tmp_path)
    runs = []
    for run, (n, part, base) in enumerate([(3, "p0", 0), (1, "p1", 100)], start=1):
        keys = [f"u{base + i:016x}" for i in range(40)]
        urls = [f"https://h/{base + i}.jpg" for i in range(40)]
        shas = [f"{base + i:064x}" for i in range(39)] + [None]        # a sample with no sha is left out
        names = [f"{(base + i) % 5:06d}.tar" for i in range(40)]
        pieces = lk.pieces(part, keys, urls, shas, names, n)
        assert len(pieces) == n and sum(p.num_rows for p in pieces) == 40 * 3 - 1
        for b in range(n):
            assert lk.write_bucket(storage, lk.bucket_file(run, b), pieces[b]) == pieces[b].num_rows
        runs.append({"run": run, "lookup": n})
    assert lk.complete(runs) and not lk.complete(runs + [{"run": 3}]) and not lk.complete([])
    got = lk.find(storage, runs, {"url": ["https://h/7.jpg", "https://h/nowhere.jpg"], "key": [f"u{101:016x}"],
                                  "sha256": [f"{38:064x}"]})
    rows = sorted((r["kind"], r["key"], r["part"], r["shard"]) for r in got.to_pylist())
    assert rows == [("key", f"u{101:016x}", "p1", "000001.tar"), ("sha256", f"u{38:016x}", "p0", "000003.tar"),
                    ("url", f"u{7:016x}", "p0", "000002.tar")]
    assert lk.find(storage, runs, {"url": []}).num_rows == 0
    assert lk.buckets_for(10) == 1 and lk.buckets_for(10**6) == 3


def _garments(n: int):
    from PIL import Image

    from trainers.evaluation.datasets import FASHION_MNIST, fashion_mnist_images
    from stages.source.web_shapes import product_shot

    if not FASHION_MNIST.is_file():
        pytest.skip("Debian package dataset-fashion-mnist not installed (make install installs it)")
    return [np.asarray(product_shot(g, 128).convert("RGB")) for g in fashion_mnist_images()[:n]], Image


def test_a_removed_product_photo_blocks_its_copies_and_not_the_products_shot_alike(tmp_path):
    """A takedown of one garment photographed on white (`capline remove` with an image entry, as
    removed.parquet records it): a later run's re-hosted copy of it (half size, JPEG 40) is blocked;
    another garment whose thumbnail is as alike (cosine >= 0.97) is not, unless the removal was made
    with the detail check off (--detail-threshold 0), as every removal was before it existed."""
    import io

    from stages.dedup.imagehash import describe, detail, trim_border

    shots, Image = _garments(400)
    cores = [trim_border(s) for s in shots]
    v = np.stack([describe(c)[0] for c in cores])
    d = np.stack([detail(c) for c in cores])
    sims = v @ v.T
    np.fill_diagonal(sims, 0)
    # the garment with the most look-alikes is the removed one; its look-alikes are distinct products
    target = int((sims >= 0.97).sum(1).argmax())
    alike = [int(j) for j in np.flatnonzero(sims[target] >= 0.97) if not np.array_equal(shots[j], shots[target])]
    assert len(alike) >= 3, "the test needs garments whose thumbnails are alike"
    (tmp_path / "takedown.png").write_bytes(_png(Image, shots[target]))
    entries = [remove.Entry("image", "takedown.png", 1)]
    rv, rd, _ = remove.image_vectors(entries, tmp_path)
    f16 = lambda a: a.astype(np.float16).tobytes()   # noqa: E731
    copy = Image.fromarray(shots[target]).resize((64, 64), Image.BICUBIC)
    buf = io.BytesIO()
    copy.save(buf, "JPEG", quality=40)
    copy_core = trim_border(np.asarray(Image.open(buf).convert("RGB")))
    keys = ["copy"] + [f"alike{j}" for j in alike]
    vecs = {"copy": f16(describe(copy_core)[0]), **{f"alike{j}": f16(v[j]) for j in alike}}
    details = {"copy": f16(detail(copy_core)), **{f"alike{j}": f16(d[j]) for j in alike}}
    table = pa.table({"key": keys, "url": [f"https://x/{k}.jpg" for k in keys], "sha256": [k * 4 for k in keys]})
    for detail_threshold, blocked_alike in ((0.99, False), (0.0, True)):
        storage = Storage.local(tmp_path / f"line{detail_threshold}")
        row = {"removal": 1, "kind": "image", "value": "takedown.png", "key": None, "url": None, "sha256": None,
               "vec": f16(rv[0]), "threshold": 0.97, "reason": "takedown", "detail": f16(rd[0]),
               "detail_threshold": detail_threshold}
        storage.write_table(remove.REMOVED, pa.table({c: [row[c]] for c in remove.REMOVED_SCHEMA.names},
                                                     schema=remove.REMOVED_SCHEMA))
        got = removals.blocked(storage, table, vecs, details)
        assert "copy" in got and "near copy of takedown.png" in got["copy"]
        kept = [k for k in keys[1:] if k not in got]
        if blocked_alike:
            assert not kept, "with the thumbnail alone every look-alike goes"
        else:
            assert len(kept) >= 0.8 * len(alike), (len(kept), len(alike))


def _png(Image, arr) -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def test_a_removal_reads_the_line_and_decodes_its_list_only_under_the_lock(tmp_path, monkeypatch):
    """A remove that overlapped an append decoded its list and read line.json before it took the
    lock, then wrote that line back: the append's 5 shards left line.json. Everything the removal
    writes from is read after the lock is held."""
    import contextlib
    import json

    import infra.ray_runtime as ray_runtime
    import pipeline.executor as executor
    import pipeline.lock as lock
    import pipeline.remove as remove
    from pipeline.config import load_config

    run = tmp_path / "run"
    (run / "shard" / "line").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"config": load_config(None, []).to_dict()}))
    (run / "shard" / "line" / "line.json").write_text(json.dumps({"shards": [], "runs": []}))
    (tmp_path / "list.txt").write_text("url http://example.invalid/1.jpg\n")
    events = []

    @contextlib.contextmanager
    def locked(*a, **k):
        events.append("lock")
        yield

    class Stop(Exception):
        pass

    class Engine:   # Ray up (a no-op here); the first task ends the test: all was read by then
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, name):
            raise Stop

    monkeypatch.setattr(lock, "run_lock", locked)
    monkeypatch.setattr(ray_runtime, "ray_session", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(executor, "Executor", Engine)
    real_read, real_vectors = remove.read_line, remove.image_vectors
    monkeypatch.setattr(remove, "read_line", lambda s: events.append("line") or real_read(s))
    monkeypatch.setattr(remove, "image_vectors", lambda *a: events.append("decode") or real_vectors(*a))
    with pytest.raises(Stop):
        remove.remove(str(run), tmp_path / "list.txt", "test", None, None, log=lambda m: None)
    assert events[events.index("lock"):] == ["lock", "line", "decode"], events


def test_ending_a_line_keeps_its_removals_in_force(tmp_path):
    """`append: false` (the way out the line's refusals name) deleted shard/line/ with removed.parquet,
    and the next run published the removed sample again. Ending a line keeps removed.parquet and its
    removals' records: dedup's removal digest still names them, and a line started again carries them."""
    import json
    import types

    import pyarrow as pa

    from infra.storage import Storage
    from stages.shard.removals import ENDED_REMOVALS, REMOVED, removal_digest
    from stages.shard.stage import ShardStage

    storage = Storage.local(tmp_path)
    removal = {"removal": 1, "reason": "takedown", "keys": ["k1"]}
    storage.write_json("shard/line/line.json", {"shards": [], "runs": [], "removals": [removal]})
    storage.write_table(REMOVED, pa.table({"key": ["k1"], "url": ["http://x/1.jpg"]}))
    storage.write_bytes("shard/line/versions/1/000000.tar", b"old")
    before = removal_digest(storage)
    ctx = types.SimpleNamespace(cfg=types.SimpleNamespace(append=False), storage=storage, log=lambda m: None)
    assert ShardStage()._line(ctx) is None
    assert not storage.exists("shard/line/line.json") and not storage.exists("shard/line/versions/1/000000.tar")
    assert storage.exists(REMOVED) and storage.read_json(ENDED_REMOVALS) == [removal]
    assert removal_digest(storage) == before is not None      # every later run's dedup still applies it
    assert json.loads((tmp_path / ENDED_REMOVALS).read_text())[0]["reason"] == "takedown"


@pytest.mark.slow   # 33 views of 6 photos described: seconds, kept out of the fast set
def test_a_removed_photo_is_found_cropped_mirrored_grey_or_turned_and_no_other_photo_is(tmp_path):
    """A takedown by image came back cropped 5 %, mirrored, in grey or rotated a few degrees and was
    not found (cosines 0.04-0.93 against the 0.97 threshold): the removal now records its picture's
    views (removal_views) and each edit matches one; the other photos match none. In a coloured or
    white frame (0 of 8 found while the sample's descriptor was the framed whole's) it is found by the
    picture inside the frame, which dedup's describe step records beside the whole."""
    import io

    import skimage.data as skd
    from PIL import Image, ImageOps
    from sklearn.datasets import load_sample_images

    from stages.dedup.imagehash import describe, detail, framed_descriptors, to_rgb_array, trim_border
    from stages.shard.removals import near_copies_of

    photos = [getattr(skd, n)()[..., :3] for n in ("astronaut", "coffee", "chelsea", "rocket")]
    photos += list(load_sample_images().images)

    def jpeg(im):
        buf = io.BytesIO()
        im.convert("RGB").save(buf, "JPEG", quality=85)
        return buf.getvalue()

    def found(data, refs):
        """As dedup's verdicts and `remove` match a sample: by the descriptors its describe step wrote."""
        arr = to_rgb_array(data)
        core = trim_border(arr)
        f16 = lambda v: v.astype(np.float16).tobytes()   # noqa: E731 - as the description file holds them
        framed = framed_descriptors(arr)
        rv, rd, _ = refs
        k = len(rv)
        return near_copies_of(["s"], {"s": f16(describe(core)[0])}, {"s": f16(detail(core))},
                              {"s": (f16(framed[0]), f16(framed[2]))} if framed else {}, rv, rd, np.ones(k, bool),
                              np.full(k, 0.97), np.full(k, 0.99))[0] is not None

    refs = []
    for i, a in enumerate(photos):
        (tmp_path / f"{i}.jpg").write_bytes(jpeg(Image.fromarray(a)))
        refs.append(remove.image_vectors([remove.Entry("image", f"{i}.jpg", 1)], tmp_path))
    assert len(refs[0][0]) == len(remove.removal_views(np.zeros((64, 64, 3), np.uint8))) == 33
    for i, a in enumerate(photos):
        im = Image.fromarray(a)
        w, h = im.size
        edits = {"crop 5 %": im.crop((w // 20, h // 20, w - w // 20, h - h // 20)), "mirror": ImageOps.mirror(im),
                 "grey": ImageOps.grayscale(im), "turned 3": im.rotate(3, resample=Image.BICUBIC),
                 "turned -5": im.rotate(-5, resample=Image.BICUBIC)}
        missed = [name for name, e in edits.items() if not found(jpeg(e), refs[i])]
        assert not missed, (i, missed)
        assert not any(found(jpeg(Image.fromarray(b)), refs[i]) for j, b in enumerate(photos) if j != i)
        frames = {"red frame": ImageOps.expand(im, border=w // 12, fill=(200, 30, 30)),
                  "white 4:3 canvas": ImageOps.pad(im, (w + w // 5, (w + w // 5) * 3 // 4), color=(255, 255, 255)),
                  "grey frame, cropped 5 %": ImageOps.expand(im.crop((w // 20, h // 20, w - w // 20, h - h // 20)),
                                                            border=w // 20, fill=(128, 128, 128))}
        missed = [name for name, e in frames.items() if not found(jpeg(e), refs[i])]
        assert not missed, (i, missed)
        assert not any(found(jpeg(ImageOps.expand(Image.fromarray(b), border=w // 12, fill=(200, 30, 30))), refs[i])
                       for j, b in enumerate(photos) if j != i)


def test_past_many_removals_candidates_come_from_a_hamming_index_and_find_the_same_copies():
    """Past ANN_ABOVE removed references a sample is compared with its 16 nearest by SimHash
    Hamming distance, not with all of them (10^6 references: 7.7 TFLOP a partition); the copies found
    and their references are those an exhaustive comparison finds."""
    from stages.shard.removals import ANN_ABOVE, near_copies, ref_index

    rng = np.random.default_rng(0)
    unit = lambda a: (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)   # noqa: E731
    m = ANN_ABOVE + 5000
    refs, ref_details = unit(rng.standard_normal((m, 768))), unit(rng.standard_normal((m, 576)))
    picked = rng.choice(m, 60, replace=False)
    copies = unit(refs[picked] + 0.08 * unit(rng.standard_normal((60, 768))))        # cosine ~0.997
    copy_details = unit(ref_details[picked] + 0.05 * unit(rng.standard_normal((60, 576))))
    others = unit(rng.standard_normal((60, 768)))
    queries, q_details = np.vstack([copies, others]), np.vstack([copy_details, unit(rng.standard_normal((60, 576)))])
    args = (queries, q_details, np.ones(120, bool), refs, ref_details, np.ones(m, bool),
            np.full(m, 0.97), np.full(m, 0.99))
    index = ref_index(refs)
    assert index is not None and ref_index(refs[:ANN_ABOVE]) is None
    ann, exact = near_copies(*args, index=index), near_copies(*args)
    assert [h and h[0] for h in ann] == [h and h[0] for h in exact] == list(picked) + [None] * 60
