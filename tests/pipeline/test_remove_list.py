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
        "key ukey-that-is-not-hex\n")
    got = [(e.kind, e.value, e.line) for e in remove.parse_list(tmp_path / "list.txt")]
    assert got == [("url", "https://example.com/a.jpg#frag", 2), ("key", "u0123456789abcdef", 3),
                   ("sha256", sha, 4), ("image", "photo.png", 5), ("url", "https://example.com/b.jpg", 7),
                   ("key", "ukey-that-is-not-hex", 8)]
    (tmp_path / "bad.txt").write_text("https://example.com/a.jpg\nnot anything\n")
    with pytest.raises(UserError, match=r"bad.txt:2: 'not anything' is not a URL"):
        remove.parse_list(tmp_path / "bad.txt")
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(UserError, match="no entries"):
        remove.parse_list(tmp_path / "empty.txt")
    (tmp_path / "gone.txt").write_text("image missing.png\n")
    with pytest.raises(UserError, match="missing.png does not exist"):
        remove.parse_list(tmp_path / "gone.txt")


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
    storage.write_table(remove.REMOVED, pa.table({c: [r[i] for r in removed] for i, c in enumerate(remove.REMOVED_SCHEMA.names)},
                                                 schema=remove.REMOVED_SCHEMA))
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
