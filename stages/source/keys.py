"""Keys unique across the whole URL list, not only within one file.

A key is `u` + a hash of (url, caption); a repeat within one file gets `_1`, `_2`, ... in row order
(stages/source/stage.py: keyed_rows). Two files holding the same row would give two samples one key, and
the shard stage would find "a sample got two verdicts" after writing tars. So, once every file is
keyed, the repeats across files are found and renamed in file order, as if the files were one:
the first occurrence keeps the plain key, the n-th gets `_n`. Every copy stays a sample with its
own verdict: dedup drops the later copies as `exact_duplicate` (same URL and caption), naming the
first in `match_key`. With `key_col` (the user's own keys), a key in two files is refused before
anything downloads, naming the files and rows.

Distributed, in two shuffles through Ray's object store (Executor.shuffle), the first over 12 bytes a
row: each file's keys as 64-bit hashes of their bases, with the partition of each (`bases.parquet`,
written beside the file's keyed partitions when it is keyed, so an append reads the files it did not
key at that size, not their keys). A task per file hands each hash bucket its piece; a task per
bucket returns the hashes found in more than one file. Only the partitions holding those are read:
a task per partition hands each key bucket its rows of repeated bases, a task per bucket writes its
renames, a task per affected partition rewrites it with its own. Nothing passes through the bucket;
the driver holds the repeated hashes and the renames, a row per copy past the first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from infra.errors import UserError

from ..dataplane import PartResult, write_part

BASES = "bases.parquet"     # in a keyed file's folder: hash and partition of each row's key base
BASES_SCHEMA = pa.schema([("hash", pa.uint64()), ("part", pa.int32())])
# the first shuffle moves 16 bytes a row and does little with them: a map reads the hashes of 10^6
# rows' files side by side (~0.1-0.3 s, less than a process takes to start), a process takes maps of
# 4·10^6 rows in turn, a reducer sorts 10^6 in less than a second
HASHES_PER_MAP = 1_000_000
HASHES_PER_WORKER = 4_000_000
HASHES_PER_BUCKET = 1_000_000


def base_of(key: str) -> str:
    return key.split("_", 1)[0]


def base_hashes(keys: list[str], own_keys: bool) -> np.ndarray:
    """64-bit hashes of the keys' bases (of the keys themselves with the user's own keys)."""
    from ..dataplane import key_hashes

    return key_hashes(keys if own_keys else [base_of(k) for k in keys])


def bases_table(hashes: list[np.ndarray]) -> pa.Table:
    """A file's BASES table from each partition's base hashes, in partition order."""
    parts = [np.full(len(h), i, np.int32) for i, h in enumerate(hashes)]
    return pa.table({"hash": np.concatenate(hashes) if hashes else np.zeros(0, np.uint64),
                     "part": np.concatenate(parts) if parts else np.zeros(0, np.int32)}, schema=BASES_SCHEMA)


def _hash_pieces(storage, files: list[tuple[int, str | None, list[str]]], n: int, own_keys: bool) -> list[pa.Table]:
    """Ray task (the first shuffle's map): the base hashes of a few files ((order, BASES table, partition
    files) each), read side by side: from each BASES table (one read), or from the partitions' keys
    where a file has none (keyed before there were any); cut by hash into `n` pieces."""
    from ..dataplane import bucket_pieces

    def hashes(order: int, bases: str | None, parts: list[str]) -> pa.Table:
        t = None
        if bases is not None:
            try:
                t = storage.read_table(bases)
            except (FileNotFoundError, OSError):
                t = None
        if t is None:
            t = bases_table([base_hashes(k.column("key").to_pylist(), own_keys) for k in storage.read_tables(parts, ["key"])])
        return t.append_column("order", pa.array(np.full(t.num_rows, order, np.int32)))

    from infra.storage import in_parallel

    t = pa.concat_tables(in_parallel(lambda f: hashes(*f), files))
    h = t.column("hash").to_numpy()
    return bucket_pieces(t, (h % np.uint64(n)).astype(np.int32), n)


def _repeated_task(*pieces: pa.Table) -> pa.Table:
    """Ray task (the first shuffle's reduce): the (hash, order, part) rows of the hashes this bucket
    holds in more than one file."""
    t = pa.concat_tables(pieces)
    h, o = t.column("hash").to_numpy(), t.column("order").to_numpy()
    if not len(h):
        return t
    idx = np.lexsort((o, h))
    hs, os_ = h[idx], o[idx]
    starts = np.r_[True, hs[1:] != hs[:-1]]
    files = np.add.reduceat((starts | np.r_[True, os_[1:] != os_[:-1]]).astype(np.int64), np.flatnonzero(starts))
    return t.filter(pa.array(np.isin(h, hs[starts][files > 1])))


PIECE_SCHEMA = pa.schema([("order", pa.int32()), ("part", pa.string()), ("key", pa.string()), ("detail", pa.string())])


def _key_pieces(storage, part: str, file: str, order: int, n: int, own_keys: bool,
                repeated: np.ndarray | None = None) -> list[pa.Table]:
    """Ray task (the second shuffle's map): one partition's keys whose base hash is `repeated` (all of
    them without it), split into `n` pieces by the hash of each key's base (the user's key itself with
    key_col), so every copy of a row meets the others."""
    from ..dataplane import hash_pieces

    t = storage.read_table(file, ["key", "detail"])
    if repeated is not None:
        t = t.filter(pa.array(np.isin(base_hashes(t.column("key").to_pylist(), own_keys), repeated)))
    keys = t.column("key").to_pylist()
    t = pa.table({"order": pa.array(np.full(len(keys), order, np.int32)), "part": pa.array([part] * len(keys), pa.string()),
                  "key": t.column("key"), "detail": t.column("detail")}, schema=PIECE_SCHEMA)
    return hash_pieces(t, keys if own_keys else [base_of(k) for k in keys], n)


@dataclass(frozen=True)
class KeyBucket:
    """What one key bucket found: with the user's own keys, the repeats (`n`, the first few pairs of
    rows that share a key, for a one-line refusal); else its renames (RENAME_SCHEMA), which go to
    the rewriting tasks through Ray's object store."""
    renames: pa.Table | None = None
    repeats: list = field(default_factory=list)     # (row, row) described, the first five
    n: int = 0                                      # keys repeated across files


RENAME_SCHEMA = pa.schema([("part", pa.string()), ("key", pa.string()), ("new_key", pa.string()), ("first", pa.string())])


def _bucket_task(own_keys: bool, *pieces: pa.Table) -> KeyBucket:
    """Ray task (a shuffle's reduce): the keys of one bucket from every partition."""
    seen: dict[str, list] = {}
    for t in pieces:
        for order, part, key, detail in zip(*(t.column(c).to_pylist() for c in PIECE_SCHEMA.names)):
            seen.setdefault(key if own_keys else base_of(key), []).append((order, part, key, detail))
    repeats = {b: rows for b, rows in seen.items() if len({r[0] for r in rows}) > 1}
    if own_keys:
        return KeyBucket(repeats=sorted((rows[0][3], rows[1][3]) for rows in repeats.values())[:5], n=len(repeats))
    renames = {c: [] for c in RENAME_SCHEMA.names}
    for b, rows in repeats.items():
        rows.sort(key=lambda r: (r[0], _suffix(r[2])))   # file order, then row order within the file
        for n, (_, part, key, _) in enumerate(rows):
            new = b if n == 0 else f"{b}_{n}"
            if new != key:
                for c, v in zip(renames, (part, key, new, rows[0][3])):
                    renames[c].append(v)
    return KeyBucket(renames=pa.table(renames, schema=RENAME_SCHEMA))


def _suffix(key: str) -> int:
    _, _, n = key.partition("_")
    return int(n) if n.isdigit() else 0


def _rewrite_task(storage, p: PartResult, r: pa.Table) -> PartResult:
    """Ray task: one partition with its renamed keys `r` (and where the first copy is, in its detail)."""
    t = storage.read_table(p.file)
    renames = {k: (n, f) for k, n, f in zip(*(r.column(c).to_pylist() for c in ("key", "new_key", "first")))}
    keys = t.column("key").to_pylist()
    details = t.column("detail").to_pylist()
    new_keys = [renames[k][0] if k in renames else k for k in keys]
    new_details = [f"{d}; the same URL and caption as {renames[k][1]}" if k in renames else d
                   for k, d in zip(keys, details)]
    t = t.set_column(t.column_names.index("key"), "key", pa.array(new_keys, pa.string()))
    t = t.set_column(t.column_names.index("detail"), "detail", pa.array(new_details, pa.string()))
    return write_part(storage, "source", p.part, None, new_keys, t)


def unique_across_files(ctx, files: list[list[PartResult]], bases: list[str | None],
                        own_keys: bool) -> tuple[list[PartResult], int]:
    """`files`: each URL list file's partitions, in file order; `bases`: where each file's BASES table
    is (None: read its partitions' keys). -> (the partitions, with those that held repeats rewritten;
    how many keys were renamed)."""
    parts = [p for f in files for p in f]
    if len(files) < 2:
        return parts, 0       # one file: keyed_rows made its keys unique already
    rows = [sum(p.n_in for p in f) for f in files]
    n = max(1, min(64, math.ceil(sum(rows) / HASHES_PER_BUCKET)))
    # files in runs of up to HASHES_PER_MAP rows, a map each: reads side by side, not a task's start each
    maps, run, held, sizes = [], [], 0, []
    for i, f in enumerate(files):
        if run and held + rows[i] > HASHES_PER_MAP:
            maps.append(run)
            sizes.append(held)
            run, held = [], 0
        run.append((i, bases[i], [p.file for p in f]))
        held += rows[i]
    maps.append(run)
    sizes.append(held)
    # windowed by rows: an append's maps run on the few processes the run has started (9 cold ones
    # at once took 31 s on 2 cores at 10^7 rows; warm, the same maps take 2 s)
    found = ctx.shuffle(_hash_pieces, [(ctx.storage, m, n, own_keys) for m in maps], n,
                        _repeated_task, [() for _ in range(n)], "source: keys across files", num_cpus=0.5,
                        sizes=sizes, items_per_worker=HASHES_PER_WORKER)
    repeated = pa.concat_tables(found)
    if not repeated.num_rows:
        return parts, 0
    # the partitions that hold a repeated base, each with the hashes to look for in it
    h, o, p = (repeated.column(c).to_numpy() for c in ("hash", "order", "part"))
    idx = np.lexsort((h, p, o))      # grouped by partition (file order, then partition), hashes sorted
    h, o, p = h[idx], o[idx], p[idx]
    starts = np.flatnonzero(np.r_[True, (o[1:] != o[:-1]) | (p[1:] != p[:-1])])
    ends = np.r_[starts[1:], len(h)]
    affected = [(int(o[a]), int(p[a]), np.unique(h[a:b])) for a, b in zip(starts, ends)]
    n = max(1, min(64, len(affected)))
    found = ctx.shuffle(_key_pieces, [(ctx.storage, files[f][i].part, files[f][i].file, f, n, own_keys, hashes)
                                      for f, i, hashes in affected], n,
                        _bucket_task, [(own_keys,) for _ in range(n)], "source: repeated keys",
                        num_cpus=0.5)
    if own_keys:
        n = sum(f.n for f in found)
        if n:
            shown = "; ".join(f"{a} and {b}" for f in found for a, b in f.repeats)[:600]
            raise UserError(f"source: {n} key_col value(s) appear in more than one URL list file ({shown}); "
                            "keys must be unique across the files (drop key_col to let capline key rows by "
                            "URL and caption, which keeps every copy and drops repeats as exact_duplicate)")
        return parts, 0
    renames = pa.concat_tables([f.renames for f in found]).sort_by("part")
    if not renames.num_rows:
        return parts, 0
    # each affected partition's renames, a slice of the sorted table (its rows only go to its task)
    names = renames.column("part").to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.r_[True, names[1:] != names[:-1]])
    ends = np.r_[starts[1:], len(names)]
    by_name = {p.part: p for p in parts}
    redone = ctx.run(_rewrite_task, [(ctx.storage, by_name[names[a]], renames.slice(a, b - a)) for a, b in zip(starts, ends)],
                     "source: renaming repeats", num_cpus=0.5)
    new = {p.part: p for p in redone}
    return [new.get(p.part, p) for p in parts], renames.num_rows
