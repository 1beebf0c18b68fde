"""Keys unique across the whole URL list, not only within one file.

A key is `u` + a hash of (url, caption); a repeat within one file gets `_1`, `_2`, ... in row order
(stages/source/stage.py: keyed_rows). Two files holding the same row would give two samples one key, and
the shard stage would find "a sample got two verdicts" after writing tars. So, once every file is
keyed, the repeats across files are found and renamed in file order, as if the files were one:
the first occurrence keeps the plain key, the n-th gets `_n`. Every copy stays a sample with its
own verdict: dedup drops the later copies as `exact_duplicate` (same URL and caption), naming the
first in `match_key`. With `key_col` (the user's own keys), a key in two files is refused before
anything downloads, naming the files and rows.

Distributed, as a shuffle through Ray's object store (Executor.shuffle): a task per partition reads
its keys once and hands each key bucket (by the hash of the key's base) its piece; a task per
bucket finds keys in more than one file and writes its renames; a task per affected partition
rewrites it. Every key is read once, and nothing but the renames passes through the bucket. The
driver sees counts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from infra.errors import UserError

from ..dataplane import PartResult, write_part

RENAMES = "source/_work/renames"


def base_of(key: str) -> str:
    return key.split("_", 1)[0]


PIECE_SCHEMA = pa.schema([("order", pa.int32()), ("part", pa.string()), ("key", pa.string()), ("detail", pa.string())])


def _key_pieces(storage, part: str, file: str, order: int, n: int, own_keys: bool) -> list[pa.Table]:
    """Ray task (a shuffle's map): one partition's keys, read once, split into `n` pieces by the hash
    of each key's base (the user's key itself with key_col), so every copy of a row meets the others."""
    from ..dataplane import hash_pieces

    t = storage.read_table(file, ["key", "detail"])
    keys = t.column("key").to_pylist()
    t = pa.table({"order": pa.array(np.full(len(keys), order, np.int32)), "part": pa.array([part] * len(keys), pa.string()),
                  "key": t.column("key"), "detail": t.column("detail")}, schema=PIECE_SCHEMA)
    return hash_pieces(t, keys if own_keys else [base_of(k) for k in keys], n)


@dataclass(frozen=True)
class KeyBucket:
    """What one key bucket found: with the user's own keys, the repeats (`n`, the first few pairs of
    rows that share a key, for a one-line refusal); else the renames per partition (written to
    storage, RENAMES)."""
    renamed: dict = field(default_factory=dict)     # partition -> rows renamed
    repeats: list = field(default_factory=list)     # (row, row) described, the first five
    n: int = 0                                      # keys repeated across files


def _bucket_task(storage, bucket: int, own_keys: bool, *pieces: pa.Table) -> KeyBucket:
    """Ray task (a shuffle's reduce): the keys of one bucket from every partition."""
    seen: dict[str, list] = {}
    for t in pieces:
        for order, part, key, detail in zip(*(t.column(c).to_pylist() for c in PIECE_SCHEMA.names)):
            seen.setdefault(key if own_keys else base_of(key), []).append((order, part, key, detail))
    repeats = {b: rows for b, rows in seen.items() if len({r[0] for r in rows}) > 1}
    if own_keys:
        return KeyBucket(repeats=sorted((rows[0][3], rows[1][3]) for rows in repeats.values())[:5], n=len(repeats))
    renames = {"part": [], "key": [], "new_key": [], "first": []}
    counts: dict[str, int] = {}
    for b, rows in repeats.items():
        rows.sort(key=lambda r: (r[0], _suffix(r[2])))   # file order, then row order within the file
        for n, (_, part, key, _) in enumerate(rows):
            new = b if n == 0 else f"{b}_{n}"
            if new != key:
                for c, v in zip(renames, (part, key, new, rows[0][3])):
                    renames[c].append(v)
                counts[part] = counts.get(part, 0) + 1
    if counts:
        storage.write_table(f"{RENAMES}/b{bucket:03d}.parquet", pa.table(renames))
    return KeyBucket(renamed=counts)


def _suffix(key: str) -> int:
    _, _, n = key.partition("_")
    return int(n) if n.isdigit() else 0


def _rewrite_task(storage, p: PartResult, buckets: list[int]) -> PartResult:
    """Ray task: one partition with its renamed keys (and where the first copy is, in its detail)."""
    t = storage.read_table(p.file)
    renames = {}
    for b in buckets:
        r = storage.read_table(f"{RENAMES}/b{b:03d}.parquet")
        r = r.filter(pc.equal(r.column("part"), p.part))
        renames.update({k: (n, f) for k, n, f in zip(*(r.column(c).to_pylist() for c in ("key", "new_key", "first")))})
    keys = t.column("key").to_pylist()
    details = t.column("detail").to_pylist()
    new_keys = [renames[k][0] if k in renames else k for k in keys]
    new_details = [f"{d}; the same URL and caption as {renames[k][1]}" if k in renames else d
                   for k, d in zip(keys, details)]
    t = t.set_column(t.column_names.index("key"), "key", pa.array(new_keys, pa.string()))
    t = t.set_column(t.column_names.index("detail"), "detail", pa.array(new_details, pa.string()))
    return write_part(storage, "source", p.part, None, new_keys, t)


def unique_across_files(ctx, parts: list[PartResult], file_of: dict[str, int], own_keys: bool) -> tuple[list, int]:
    """-> (the partitions, with those that held repeats rewritten; how many keys were renamed)."""
    if len(set(file_of.values())) < 2:
        return parts, 0       # one file: keyed_rows made its keys unique already
    n = max(1, min(64, len(parts)))
    found = ctx.shuffle(_key_pieces, [(ctx.storage, p.part, p.file, file_of[p.part], n, own_keys) for p in parts], n,
                        _bucket_task, [(ctx.storage, b, own_keys) for b in range(n)], "source: keys across files",
                        num_cpus=0.5)
    if own_keys:
        n = sum(f.n for f in found)
        if n:
            shown = "; ".join(f"{a} and {b}" for f in found for a, b in f.repeats)[:600]
            raise UserError(f"source: {n} key_col value(s) appear in more than one URL list file ({shown}); "
                            "keys must be unique across the files (drop key_col to let capline key rows by "
                            "URL and caption, which keeps every copy and drops repeats as exact_duplicate)")
        return parts, 0
    touched: dict[str, list[int]] = {}
    renamed = 0
    for b, f in enumerate(found):
        for part, n in f.renamed.items():
            touched.setdefault(part, []).append(b)
            renamed += n
    if not touched:
        return parts, 0
    by_name = {p.part: p for p in parts}
    redone = ctx.run(_rewrite_task, [(ctx.storage, by_name[name], bs) for name, bs in sorted(touched.items())],
                     "source: renaming repeats", num_cpus=0.5)
    new = {p.part: p for p in redone}
    ctx.storage.delete(RENAMES)
    return [new.get(p.part, p) for p in parts], renamed
