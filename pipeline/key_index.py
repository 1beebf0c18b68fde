"""Each stage's key index: key -> the ledger file that holds it, so `capline explain` reads one small
file per stage (and then that ledger file) instead of every ledger of every stage.

Built by the runner when a stage finishes, before its `_SUCCESS`. Up to ROWS_PER_BUCKET keys: one
file, which a task updates from the ledgers that changed. Past it: a shuffle through Ray's object
store (a task per ledger file hands each bucket its (key, file) rows by the key's hash, a task per
bucket writes `<stage>/keys/<bucket>.parquet`). Either way sorted by key, in row groups small enough
that a lookup reads one. The keys of a ledger written this run come from the object store (the task
that wrote it returned them apart: pipeline/executor.py), so no ledger is read back to be indexed;
only one written before (a resumed stage) or whose keys were lost with a node is read.
`<stage>/keys/meta.json` says how many buckets. The driver sees counts only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

KEYS = "keys"


@dataclass(frozen=True)
class Indexed:
    """What the one-file index task wrote: its rows, and where the keys came from."""
    rows: int
    ledgers_read: int       # ledgers read back for their keys (written before this run, or keys lost)
    ledgers_handed: int     # ledgers whose keys the task that wrote them handed on (the object store)


@dataclass(frozen=True)
class IndexMeta:
    """A stage's key index as `build` left it (`<stage>/keys/meta.json` holds buckets and rows)."""
    buckets: int
    rows: int
    ledgers_read: int
    ledgers_handed: int
ROWS_PER_BUCKET = 2_000_000
ROW_GROUP = 8192


def _map_task(storage, file: str, buckets: int, given: pa.Table | None = None) -> list[pa.Table]:
    """A shuffle's map (Executor.shuffle): one ledger's (key, file) rows, a piece per index bucket."""
    from stages.dataplane import hash_pieces

    keys = (given if given is not None else storage.read_table(file, ["key"])).column("key")
    table = pa.table({"key": keys, "file": pa.array([file] * len(keys), pa.string())})
    return hash_pieces(table, keys.to_pylist(), buckets)


def _reduce_task(storage, out: str, row_group: int, *pieces: pa.Table) -> int:
    """A shuffle's reduce: one index bucket's rows from every ledger, written sorted by key."""
    return _write_index(storage, pa.concat_tables(pieces) if pieces else pa.table({"key": pa.array([], pa.string()),
                                                                                    "file": pa.array([], pa.string())}),
                        out, row_group)


def _single_task(storage, files: list[str], out: str, row_group: int, unchanged: list[str] = (),
                 given_files: list[str] = (), *given: pa.Table | None) -> Indexed:
    """The one index file from the keys of `files`: the rows of the `unchanged` ones taken from the
    index already at `out` (read here, in the task), those of `given_files` from `given` (their keys as
    the writing tasks returned them, in that order), the others' keys read from their ledgers: an
    append reads at most the ledgers it added."""
    import pyarrow.compute as pc

    kept = None
    if unchanged:
        try:
            old = storage.read_table(out)
            kept = old.filter(pc.is_in(old.column("file"), pa.array(list(unchanged), pa.string())))
        except (FileNotFoundError, OSError):
            kept = None
    have = set(kept.column("file").unique().to_pylist()) if kept is not None else set()
    in_hand = {f: t for f, t in zip(given_files, given) if t is not None and f not in have}
    missing = [f for f in files if f not in have and f not in in_hand]
    pieces = [kept] if kept is not None else []
    for f, t in [*in_hand.items(), *zip(missing, storage.read_tables(missing, ["key"]))]:
        keys = t.column("key")
        pieces.append(pa.table({"key": keys.cast(pa.string()), "file": pa.array([f] * len(keys), pa.string())}))
    new = pa.concat_tables(pieces) if pieces else pa.table({"key": pa.array([], pa.string()), "file": pa.array([], pa.string())})
    rows = _write_index(storage, new, out, row_group)
    return Indexed(rows, len(missing), len(in_hand))


def _write_index(storage, t: pa.Table, out: str, row_group: int) -> int:
    t = t.sort_by("key")
    sink = pa.BufferOutputStream()
    pq.write_table(t, sink, row_group_size=row_group, compression="zstd")
    storage.write_bytes(out, sink.getvalue().to_pybytes())
    return t.num_rows


def build(storage, executor, stage: str, files: dict[str, str], rows: int, in_driver: bool = False,
          given: dict | None = None) -> IndexMeta:
    """The index of `stage`'s ledger `files` (path -> sha256; `rows` keys in all), in Ray tasks; ->
    its meta and how many ledgers were read for it (`ledgers_read`). `given`: ledger -> its keys as
    the task that wrote it returned them (a reference into the object store, or the table), read
    instead of the ledger. `in_driver`: the stage wrote its partitions from the driver (no task), so
    the index is built there too (a cluster's workers may not reach what the driver wrote)."""
    from infra import remote

    try:
        return _build(storage, executor, stage, files, rows, in_driver, given or {})
    except Exception as err:   # noqa: BLE001 - only keys lost with their node are recovered from
        if not given or not remote.lost(err):
            raise
        return _build(storage, executor, stage, files, rows, in_driver, {})     # the ledgers have them too


def _build(storage, executor, stage: str, files: dict[str, str], rows: int, in_driver: bool, given: dict) -> IndexMeta:
    if in_driver:
        from types import SimpleNamespace

        def shuffle(map_fn, calls, n, reduce_fn, reduce_calls, *a, **k):
            pieces = [map_fn(*c) for c in calls]
            return [reduce_fn(*reduce_calls[b], *[p[b] for p in pieces]) for b in range(n)]

        executor = SimpleNamespace(run=lambda fn, calls, *a, **k: [fn(*c) for c in calls], shuffle=shuffle)
    folder = f"{stage}/{KEYS}"
    buckets = max(1, math.ceil(rows / ROWS_PER_BUCKET))
    before = storage.read_json(f"{folder}/meta.json") or {}
    if buckets == 1:    # one index file: one task reads the keys of the ledgers it lacks, no map files
        index = f"{folder}/000000.parquet"
        old = before.get("files") if before.get("buckets") == 1 and isinstance(before.get("files"), dict) else {}
        unchanged = [f for f, sha in files.items() if old.get(f) == sha]
        handing = sorted(f for f in given if f in files and f not in unchanged)
        (done,) = executor.run(_single_task, [(storage, sorted(files), index, ROW_GROUP, unchanged, handing,
                                               *(given[f] for f in handing))],
                               f"{stage} key index", num_cpus=0.25, quiet=True)
        read, handed = done.ledgers_read, done.ledgers_handed
        # buckets of an earlier, larger index (its meta says how many it had): deleted together
        if before.get("buckets") != 1:
            storage.delete_files([f for f in storage.list(folder) if f not in (index, f"{folder}/meta.json")])
    else:   # a shuffle through Ray's object store: the map pieces never touch the bucket
        storage.delete(folder)
        executor.shuffle(_map_task, [(storage, f, buckets, given.get(f)) for f in sorted(files)], buckets,
                         _reduce_task, [(storage, f"{folder}/{b:06d}.parquet", ROW_GROUP) for b in range(buckets)],
                         f"{stage} key index", num_cpus=0.25)
        read = sum(1 for f in files if given.get(f) is None)
        handed = len(files) - read
    meta = {"buckets": buckets, "rows": rows, **({"files": dict(sorted(files.items()))} if buckets == 1 else {})}
    storage.write_json(f"{folder}/meta.json", meta)
    return IndexMeta(buckets, rows, read, handed)


def lookup(storage, stage: str, key: str) -> str | None:
    """The ledger file of `stage` that holds `key`: "" if none does, None if the stage has no index
    (a run made before there were indexes: the caller scans)."""
    meta = storage.read_json(f"{stage}/{KEYS}/meta.json")
    if meta is None:
        return None
    from stages.dataplane import hash_buckets

    b = int(hash_buckets([key], meta["buckets"])[0])
    # sorted by key in small row groups: the filter reads the footer and the one group that can hold it
    hit = pq.read_table(storage.path(f"{stage}/{KEYS}/{b:06d}.parquet"), filesystem=storage.fs, columns=["file"],
                        filters=[("key", "==", key)])
    return hit.column("file")[0].as_py() if hit.num_rows else ""
