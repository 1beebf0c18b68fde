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

An append checks what it added against what was checked (`CHECKED`): a check records the files it
covered (by their BASES tables' names, which name their content and keying settings) and every copy
it found of a row held by more than one of them. When those files are all still listed, in the same
order, and hold more rows than one map reads (PROBE_FROM), the added files' hashes are read first
(the probe), then each earlier file's once, a map keeping only the rows the probe holds: the first
shuffle moves the added rows and their matches, not every row, and its reducers add the record's
copies (rows repeated among the earlier files are repeated still). Any other change (a file gone,
changed or reordered; no record) checks every file. The earlier files are read through runs: a map
that reads several files whole keeps what it read as one table, which the record names, so an
append reads a table per 10^6 rows checked, not one per list file.
"""
from __future__ import annotations

import functools
import json
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
# against a probe a map keeps a few rows of what it reads, a file at a time: it may read more
PROBED_PER_MAP = 10_000_000
# the probe (the added files' hashes, 8 bytes a row) goes through the driver to every map: past this,
# or past the rows checked before, checking every file again costs about the same; and up to one
# map's worth of rows checked before, one map reads them all sooner than a probe is made first
PROBE_MAX = 20_000_000
PROBE_FROM = HASHES_PER_MAP
CHECKED = "source/keyed/across_files.parquet"   # the last check's files and the copies it found
CHECKED_SCHEMA = pa.schema([("hash", pa.uint64()), ("file", pa.int32()), ("part", pa.int32())])
# a map of a check writes what it read of the files it read whole (their BASES tables, up to
# HASHES_PER_MAP rows) as one table, a "run", named by those tables' names; the record lists its
# runs, and an append reads the earlier files through them: a request per run, not per file (2,000
# list files: 2,000 reads and 8.1 s of an append's maps). Files beside the record (under KEYED, which
# the stage keeps and whose folders it prunes), `checked-<digest>.parquet`
RUN_PREFIX = "source/keyed/checked-"
RUN_SCHEMA = CHECKED_SCHEMA   # the same columns; `file` indexes the run's own list of files, not the record's
# an append's own files are kept as a run only where a map reads two or more, so appends of a file
# each leave a file no run holds, and runs of two: read one by one, an append's requests would grow
# with the appends before it. Once an append reads MERGE_FROM small sources (a file no run holds, a
# run of fewer than SMALL_RUN rows), the maps reading them keep them merged, in runs of up to
# HASHES_PER_MAP rows, and the runs they replace are deleted once the record no longer names them:
# an append reads at most a request per 5·10^5 rows checked and MERGE_FROM more
MERGE_FROM = 8
SMALL_RUN = HASHES_PER_MAP // 2


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


def _file_hashes(storage, order: int, bases: str | None, parts: list[str], own_keys: bool,
                 probe: np.ndarray | None = None) -> pa.Table:
    """One file's (hash, part, order) rows: from its BASES table (one read), or from its partitions'
    keys where it has none (keyed before there were any); with `probe` (sorted), only the rows whose
    hash it holds."""
    t = None
    if bases is not None:
        try:
            t = storage.read_table(bases)
        except (FileNotFoundError, OSError):
            t = None
    if t is None:
        t = bases_table([base_hashes(k.column("key").to_pylist(), own_keys) for k in storage.read_tables(parts, ["key"])])
    t = _held(t, probe)
    return t.append_column("order", pa.array(np.full(t.num_rows, order, np.int32)))


def run_path(names: list[str]) -> str:
    """Where the run of the files whose BASES tables are `names` (in order) is kept."""
    import hashlib

    return f"{RUN_PREFIX}{hashlib.sha256(json.dumps(names).encode()).hexdigest()[:24]}.parquet"


def _held(t: pa.Table, probe: np.ndarray | None) -> pa.Table:
    """The rows of `t` whose hash `probe` (sorted) holds; all of them without one."""
    if probe is None:
        return t
    h = t.column("hash").to_numpy()
    held = probe[np.minimum(np.searchsorted(probe, h), len(probe) - 1)] == h if len(probe) else np.zeros(len(h), bool)
    return t.filter(pa.array(held))


def _run_hashes(storage, run: str, specs: list[tuple], own_keys: bool, probe: np.ndarray | None) -> pa.Table:
    """The (hash, part, order) rows of the files `specs` from their run (one read); from each file's
    own BASES table where the run is gone or is not theirs."""
    from infra.storage import in_parallel

    try:
        t = storage.read_table(run)
        if json.loads((t.schema.metadata or {}).get(b"files", b"null")) != [s[1] for s in specs] \
                or not t.schema.remove_metadata().equals(RUN_SCHEMA):
            raise ValueError(run)
    except (FileNotFoundError, OSError, ValueError, pa.ArrowException):
        return pa.concat_tables(in_parallel(lambda f: _file_hashes(storage, *f, own_keys, probe), specs))
    t = _held(t, probe)
    order = np.array([s[0] for s in specs], np.int32)
    return pa.table({"hash": t.column("hash"), "part": t.column("part"),
                     "order": pa.array(order[t.column("file").to_numpy()])})


def _hash_pieces(storage, sources: list[tuple[str | None, list[tuple]]], n: int, own_keys: bool,
                 probe: np.ndarray | None = None, keep_as: str | None = None) -> list[pa.Table]:
    """Ray task (the first shuffle's map): the base hashes of a few files, cut by hash into `n` pieces.
    `sources`: (run, specs) each, specs being (order, BASES table, partition files) of a file; a run's
    files read through it (_run_hashes), the others each from its own table (_file_hashes), side by
    side; with `probe`, only the rows it holds. `keep_as`: every row read is kept there as a run of
    these files (in `sources`' order), before the probe keeps those it holds."""
    from ..dataplane import bucket_pieces
    from infra.storage import in_parallel

    read_probe = probe if keep_as is None else None       # a run keeps every row: read whole
    t = pa.concat_tables(in_parallel(
        lambda src: _run_hashes(storage, src[0], src[1], own_keys, read_probe) if src[0] is not None
        else _file_hashes(storage, *src[1][0], own_keys, read_probe), sources))
    if keep_as is not None:
        specs = [f for _, fs in sources for f in fs]
        local = np.zeros(max(f[0] for f in specs) + 1, np.int32)
        local[[f[0] for f in specs]] = np.arange(len(specs), dtype=np.int32)
        kept = pa.table({"hash": t.column("hash"), "file": pa.array(local[t.column("order").to_numpy()]),
                         "part": t.column("part")}, schema=RUN_SCHEMA)
        storage.write_table(keep_as, kept.replace_schema_metadata({"files": json.dumps([f[1] for f in specs])}))
        t = _held(t, probe)
    h = t.column("hash").to_numpy()
    return bucket_pieces(t, (h % np.uint64(n)).astype(np.int32), n)


def _probe_task(storage, files: list[tuple[int, str | None, list[str]]], own_keys: bool) -> np.ndarray:
    """Ray task: the distinct base hashes of the files an append added, sorted."""
    from infra.storage import in_parallel

    tables = in_parallel(lambda f: _file_hashes(storage, *f, own_keys), files)
    return np.unique(np.concatenate([t.column("hash").to_numpy() for t in tables]))


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


def _runs(files: list[int], rows: list[int], most: int) -> list[list[int]]:
    """`files` (indices) in runs of up to `most` rows (a file larger than that alone)."""
    runs, run, held = [], [], 0
    for i in files:
        if run and held + rows[i] > most:
            runs.append(run)
            run, held = [], 0
        run.append(i)
        held += rows[i]
    return runs + [run] if run else runs


def _no_copies() -> pa.Table:
    """An empty (hash, part, order) table; made when needed: building any table imports pandas, which
    an ingest worker (importing this module through the stage registry) must not
    (tests/stages/test_img2dataset_parts.py)."""
    return pa.table({"hash": pa.array([], pa.uint64()), "part": pa.array([], pa.int32()),
                     "order": pa.array([], pa.int32())})


def _checked_before(storage, record: str | None, bases: list[str | None]) -> tuple[list[int], pa.Table, list] | None:
    """The files the last check covered (indices among these), the copies it found (hash, part, order
    as these files are ordered now) and its runs ((path, indices of the files it holds) each), if
    those files are all still here in the same order; else None (check every file)."""
    if record is None or any(b is None for b in bases):
        return None
    try:
        t = storage.read_table(record)
        meta = t.schema.metadata or {}
        ids = json.loads(meta.get(b"files", b"null"))
        runs = json.loads(meta.get(b"runs", b"[]"))     # none in a record written before there were runs
    except (FileNotFoundError, OSError, ValueError, pa.ArrowException):
        return None       # none yet, or unreadable: a full check writes it again
    pos = {b: i for i, b in enumerate(bases)}
    if not isinstance(ids, list) or not ids or any(not isinstance(b, str) or b not in pos for b in ids) \
            or not t.schema.remove_metadata().equals(CHECKED_SCHEMA):
        return None
    order = np.array([pos[b] for b in ids], np.int32)
    f = t.column("file").to_numpy()
    if np.any(np.diff(order) <= 0) or (len(f) and (f.min() < 0 or f.max() >= len(order))):
        return None
    try:
        runs = [(str(path), [int(order[j]) for j in held]) for path, held in runs]
    except (TypeError, ValueError, IndexError):
        runs = []         # a record with a torn runs list: its files are read one by one
    if len({i for _, held in runs for i in held}) != sum(len(held) for _, held in runs):
        runs = []
    return order.tolist(), pa.table({"hash": t.column("hash"), "part": t.column("part"), "order": pa.array(order[f])}), runs


def _remember(storage, record: str | None, bases: list[str | None], repeated: pa.Table, runs: list,
              whole: bool, replaced: list[str] = ()) -> None:
    """What this check covered and found, and its runs, for the next run's (`_checked_before`);
    `whole`: the check read every file, and the runs of an earlier check it did not name are deleted;
    `replaced`: runs an append merged into new ones, deleted (no listing: their names are known)."""
    if record is None or any(b is None for b in bases):
        return
    t = repeated.group_by(["hash", "order", "part"]).aggregate([]).sort_by(
        [("order", "ascending"), ("part", "ascending"), ("hash", "ascending")])
    t = pa.table({"hash": t.column("hash"), "file": t.column("order"), "part": t.column("part")}, schema=CHECKED_SCHEMA)
    storage.write_table(record, t.replace_schema_metadata({"files": json.dumps(bases), "runs": json.dumps(runs)}))
    # after the record that no longer names them (a crash between leaves files nothing reads)
    named = {path for path, _ in runs}
    if replaced:
        storage.delete_files([f for f in replaced if f not in named])
    if whole:
        folder, _, prefix = RUN_PREFIX.rpartition("/")
        storage.delete_files([f for f in storage.list(folder, ".parquet")
                              if f.rpartition("/")[2].startswith(prefix) and f not in named])


def _kept_as(bases, m: list[int], keep: bool) -> str | None:
    """Where a map reading the files `m` whole keeps them as a run: for two files or more (one
    file's run would be a copy of its own table)."""
    return run_path([bases[i] for i in m]) if keep and len(m) > 1 else None


def _repeated_everywhere(ctx, files, bases, rows: list[int], own_keys: bool, keep: bool) -> tuple[pa.Table, list]:
    """The first shuffle over every file's hashes: the (hash, part, order) rows of each hash that more
    than one file holds, and the runs its maps kept (`keep`)."""
    n = max(1, min(64, math.ceil(sum(rows) / HASHES_PER_BUCKET)))
    # files in runs of up to HASHES_PER_MAP rows, a map each: reads side by side, not a task's start each
    maps = _runs(list(range(len(files))), rows, HASHES_PER_MAP)
    # windowed by rows: an append's maps run on the few processes the run has started (9 cold ones
    # at once took 31 s on 2 cores at 10^7 rows; warm, the same maps take 2 s)
    kept = [_kept_as(bases, m, keep) for m in maps]
    found = ctx.shuffle(_hash_pieces, [(ctx.storage, [(None, [_spec(files, bases, i)]) for i in m], n, own_keys, None, k)
                                       for m, k in zip(maps, kept)], n,
                        _repeated_task, [() for _ in range(n)], "source: keys across files", num_cpus=0.5,
                        sizes=[sum(rows[i] for i in m) for m in maps], items_per_worker=HASHES_PER_WORKER)
    return pa.concat_tables(found), [(k, m) for m, k in zip(maps, kept) if k]


def _repeated_since(ctx, files, bases, rows: list[int], checked: list[int], before: pa.Table, runs: list,
                    own_keys: bool, keep: bool) -> tuple[pa.Table, list, list]:
    """`_repeated_everywhere` when the files `checked` (finding `before`, kept in `runs`) are
    unchanged: the added files' hashes are the probe, and the earlier files give only the rows it
    holds, read through their runs (the small ones merged: MERGE_FROM). -> (the rows, the runs now,
    the runs merged into new ones)."""
    seen = set(checked)
    new = [i for i in range(len(files)) if i not in seen]
    if not new:
        return before, runs, []
    probe = ctx.put(ctx.call(_probe_task, ctx.storage, [_spec(files, bases, i) for i in new], own_keys,
                             what="source: keys of the files added", num_cpus=0.5))
    n = max(1, min(64, math.ceil((sum(rows[i] for i in new) + before.num_rows) / HASHES_PER_BUCKET)))
    # the earlier files as sources: each run, and each file no run holds; the small ones merged
    in_runs = {i for _, held in runs for i in held}
    sources = [(path, held) for path, held in runs] + [(None, [i]) for i in checked if i not in in_runs]
    sized = [sum(rows[i] for i in held) for _, held in sources]
    small = sorted((j for j, size in enumerate(sized) if size < SMALL_RUN), key=lambda j: min(sources[j][1]))
    merging = [m for m in _runs(small, sized, HASHES_PER_MAP) if len(m) > 1] if keep and len(small) >= MERGE_FROM else []
    merged = {j for m in merging for j in m}
    rest = [j for j in range(len(sources)) if j not in merged]
    groups = [[rest[k] for k in m] for m in _runs(list(range(len(rest))), [sized[j] for j in rest], PROBED_PER_MAP)]

    def read(js: list[int]) -> list:
        return [(path, [_spec(files, bases, i) for i in held]) for path, held in (sources[j] for j in js)]

    joined = [[i for j in m for i in sources[j][1]] for m in merging]     # each merged run's files, as read
    merged_as = [_kept_as(bases, held, True) for held in joined]
    probed = [(read(m), probe, None) for m in groups] + [(read(m), probe, k) for m, k in zip(merging, merged_as)]
    replaced = [sources[j][0] for j in sorted(merged) if sources[j][0] is not None]
    runs = [r for j, r in enumerate(runs) if j not in merged] + list(zip(merged_as, joined))
    added = _runs(new, rows, HASHES_PER_MAP)
    kept = [_kept_as(bases, m, keep) for m in added]
    adding = [([(None, [_spec(files, bases, i)]) for i in m], None, k) for m, k in zip(added, kept)]
    from ..dataplane import bucket_pieces

    h = before.column("hash").to_numpy()
    earlier = bucket_pieces(before, (h % np.uint64(n)).astype(np.int32), n)
    found = ctx.shuffle(_hash_pieces, [(ctx.storage, src, n, own_keys, p, k) for src, p, k in probed + adding],
                        n, _repeated_task, [(earlier[b],) for b in range(n)], "source: keys across files",
                        num_cpus=0.5, sizes=[sum(sized[j] for j in m) for m in groups + merging]
                        + [sum(rows[i] for i in m) for m in added], items_per_worker=HASHES_PER_WORKER)
    return pa.concat_tables(found), runs + [(k, m) for m, k in zip(added, kept) if k], replaced


def _spec(files, bases, i: int) -> tuple[int, str | None, list[str]]:
    return i, bases[i], [p.file for p in files[i]]


def unique_across_files(ctx, files: list[list[PartResult]], bases: list[str | None],
                        own_keys: bool, record: str | None = None) -> tuple[list[PartResult], int]:
    """`files`: each URL list file's partitions, in file order; `bases`: where each file's BASES table
    is (None: read its partitions' keys); `record`: where the check keeps what it covered and found
    (CHECKED; None: every run checks every file). -> (the partitions, with those that held repeats
    rewritten; how many keys were renamed)."""
    parts = [p for f in files for p in f]
    rows = [sum(p.n_in for p in f) for f in files]
    before = _checked_before(ctx.storage, record, bases) if len(files) > 1 else None
    added = sum(rows) - sum(rows[i] for i in before[0]) if before else 0
    # runs only where a record is kept and the next append may probe (past PROBE_FROM rows); below,
    # a full check reads every file anyway (and runs an earlier, larger list kept stay until a check
    # keeps runs again)
    keep = record is not None and all(b is not None for b in bases) and sum(rows) > PROBE_FROM
    whole = not (before and PROBE_FROM < sum(rows) - added and added <= min(PROBE_MAX, sum(rows) - added))
    replaced: list[str] = []
    if len(files) < 2:
        repeated, runs = _no_copies(), []         # keyed_rows made one file's keys unique
    elif not whole:
        repeated, runs, replaced = _repeated_since(ctx, files, bases, rows, *before, own_keys, keep)
    else:
        repeated, runs = _repeated_everywhere(ctx, files, bases, rows, own_keys, keep)
    remember = functools.partial(_remember, ctx.storage, record, bases, runs=runs, whole=whole and keep,
                                 replaced=replaced)
    if not repeated.num_rows:
        remember(repeated)
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
        remember(repeated)
        return parts, 0
    renames = pa.concat_tables([f.renames for f in found]).sort_by("part")
    if not renames.num_rows:        # 64-bit hashes alike, bases not
        remember(repeated)
        return parts, 0
    # each affected partition's renames, a slice of the sorted table (its rows only go to its task)
    names = renames.column("part").to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.r_[True, names[1:] != names[:-1]])
    ends = np.r_[starts[1:], len(names)]
    by_name = {p.part: p for p in parts}
    redone = ctx.run(_rewrite_task, [(ctx.storage, by_name[names[a]], renames.slice(a, b - a)) for a, b in zip(starts, ends)],
                     "source: renaming repeats", num_cpus=0.5)
    new = {p.part: p for p in redone}
    remember(repeated)     # last: once every step of the check has succeeded
    return [new.get(p.part, p) for p in parts], renames.num_rows
