"""Each stage's key index: key -> the ledger file that holds it, so `capline explain` reads a few
small files per stage (and then that ledger file) instead of every ledger of every stage.

Built by the runner when a stage finishes, before its `_SUCCESS`, as a log-structured merge: the index
is a list of immutable segments, each the (key, file) rows of the ledgers one build indexed, sorted by
key in row groups small enough that a lookup reads one, cut into hash buckets of at most
ROWS_PER_BUCKET rows (how many is fixed when the segment is written, by its own rows, never by the
stage's size). A build indexes only the ledgers that are new or changed since the index last saw them
(their sha256 in `files.parquet`): an append reads and writes the keys it added, not the stage's.
A ledger that is gone, or that a later segment indexed again, is named in its old segment's `dead`
list: a hit there means the key is no longer in the stage (newer segments are searched first).

Segments merge when the one below the newer ones holds no more than MERGE_RATIO times their rows
(sizes grow geometrically: a few segments, each key rewritten a few times over many appends), or
when its dead rows outnumber its live ones; a merge drops the dead rows, and a wholly dead segment
is deleted unread.

Where keys come from: a ledger written this run hands its keys over through the object store (the
task that wrote it returned them apart: pipeline/executor.py); only one written before (a resumed
stage) or whose keys were lost with a node is read back. A segment of one bucket is one task; a larger
one, and a merge past one bucket, a shuffle through Ray's object store (a task per ledger or segment
file hands each bucket its rows by the key's hash). The driver sees counts.

`<stage>/keys/meta.json`: {"format": 2, "next": id, "segments": [{"id", "buckets", "rows", "dead",
"dead_rows"}, ...] oldest first, "retired": [[id, buckets], ...] the segments the last build
dropped (deleted after the meta is written, and again by the next build)}; `files.parquet`: file,
sha256, segment, rows of each ledger indexed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

KEYS = "keys"
FORMAT = 2
ROWS_PER_BUCKET = 2_000_000
ROW_GROUP = 8192
MERGE_RATIO = 2
KEYS_PER_WORKER = 1_000_000
MAX_DEAD_FILES = 1000       # a segment naming more dead ledgers is merged (meta.json stays small)
PAIRS = pa.schema([("key", pa.string()), ("file", pa.string())])
FILES = pa.schema([("file", pa.string()), ("sha256", pa.string()), ("segment", pa.int64()), ("rows", pa.int64())])


@dataclass(frozen=True)
class Indexed:
    """What one index task wrote: its rows, and where the keys came from."""
    rows: int
    ledgers_read: int       # ledgers read back for their keys (written before this run, or keys lost)
    ledgers_handed: int     # ledgers whose keys the task that wrote them handed on (the object store)


@dataclass(frozen=True)
class IndexMeta:
    """A stage's key index as `build` left it."""
    segments: int
    rows: int               # keys of the stage (the live rows of every segment)
    ledgers_read: int
    ledgers_handed: int
    rows_written: int       # index rows this build wrote: its new segment and any merge


def segment_file(folder: str, segment: int, bucket: int) -> str:
    return f"{folder}/s{segment:06d}-{bucket:06d}.parquet"


def _pairs(storage, kind: str, path: str, given: pa.Table | None = None, dead=()) -> pa.Table:
    """(key, file) rows: of one ledger (`kind` "ledger"; `given`: its keys in hand, else read), or of
    one segment file less the rows of its `dead` ledgers (`kind` "segment")."""
    import pyarrow.compute as pc

    if kind == "ledger":
        keys = (given if given is not None else storage.read_table(path, ["key"])).column("key").cast(pa.string())
        return pa.table({"key": keys, "file": pa.array([path] * len(keys), pa.string())}, schema=PAIRS)
    t = storage.read_table(path)
    return t.filter(pc.invert(pc.is_in(t.column("file"), pa.array(list(dead), pa.string())))) if dead else t


def _map_task(storage, kind: str, path: str, buckets: int, dead: list, given: pa.Table | None = None) -> list[pa.Table]:
    """A shuffle's map (Executor.shuffle): one ledger's or segment file's rows, a piece per bucket."""
    from stages.dataplane import hash_pieces

    t = _pairs(storage, kind, path, given, dead)
    return hash_pieces(t, t.column("key").to_pylist(), buckets)


def _reduce_task(storage, out: str, row_group: int, *pieces: pa.Table) -> int:
    """A shuffle's reduce: one bucket's rows from every map, written sorted by key."""
    return _write_index(storage, pa.concat_tables(pieces) if pieces else PAIRS.empty_table(), out, row_group)


def _one_task(storage, out: str, row_group: int, ledgers: list[str], segments: list[tuple[str, list]],
              handed: list[str], *given: pa.Table | None) -> Indexed:
    """One index file from the keys of `ledgers` (read) and `handed` (their keys as the writing tasks
    returned them, `given`, in that order; read if lost) and the live rows of `segments` files."""
    in_hand = {f: t for f, t in zip(handed, given) if t is not None}
    read = [f for f in ledgers if f not in in_hand] + [f for f in handed if f not in in_hand]
    pieces = [_pairs(storage, "ledger", f, t) for f, t in in_hand.items()]
    pieces += [_pairs(storage, "ledger", f, t) for f, t in zip(read, storage.read_tables(read, ["key"]))]
    pieces += [_pairs(storage, "segment", path, None, dead) for path, dead in segments]
    rows = _write_index(storage, pa.concat_tables(pieces) if pieces else PAIRS.empty_table(), out, row_group)
    return Indexed(rows, len(read), len(in_hand))


def _write_index(storage, t: pa.Table, out: str, row_group: int) -> int:
    t = t.sort_by("key")
    sink = pa.BufferOutputStream()
    pq.write_table(t, sink, row_group_size=row_group, compression="zstd")
    storage.write_bytes(out, sink.getvalue().to_pybytes())
    return t.num_rows


def build(storage, executor, stage: str, files: dict[str, str], rows: dict[str, int], in_driver: bool = False,
          given: dict | None = None) -> IndexMeta:
    """Index `stage`'s ledger `files` (path -> sha256; `rows`: path -> its keys) in Ray tasks. `given`:
    ledger -> its keys as the task that wrote it returned them (a reference into the object store,
    or the table), read instead of the ledger. `in_driver`: the stage wrote its partitions from the
    driver (no task), so the index is built there too (a cluster's workers may not reach what the
    driver wrote)."""
    from infra import remote

    try:
        return _build(storage, executor, stage, files, rows, in_driver, given or {})
    except Exception as err:   # noqa: BLE001 - only keys lost with their node are recovered from
        if not given or not remote.lost(err):
            raise
        return _build(storage, executor, stage, files, rows, in_driver, {})     # the ledgers have them too


def _in_driver():
    from types import SimpleNamespace

    def shuffle(map_fn, calls, n, reduce_fn, reduce_calls, *a, **k):
        pieces = [map_fn(*c) for c in calls]
        return [reduce_fn(*reduce_calls[b], *[p[b] for p in pieces]) for b in range(n)]

    return SimpleNamespace(run=lambda fn, calls, *a, **k: [fn(*c) for c in calls], shuffle=shuffle)


def _live(s: dict) -> int:
    return s["rows"] - s["dead_rows"]


def _spent(s: dict) -> bool:
    """Mostly dead: merged (rewritten without its dead rows) whatever its size."""
    return s["dead_rows"] > _live(s) or len(s["dead"]) > MAX_DEAD_FILES


def merge_from(segments: list[dict]) -> int:
    """Where the merge starts: the newest segments are merged down while the one below holds at most
    MERGE_RATIO times their rows, and from any spent segment up; len(segments) when none merge."""
    k = len(segments) - 1
    while k > 0 and _live(segments[k - 1]) <= MERGE_RATIO * sum(_live(s) for s in segments[k:]):
        k -= 1
    spent = [j for j, s in enumerate(segments) if _spent(s)]
    k = min([k, *spent])
    return k if len(segments) - k >= 2 or spent else len(segments)


def _build(storage, executor, stage: str, files: dict[str, str], rows: dict[str, int], in_driver: bool,
           given: dict) -> IndexMeta:
    executor = _in_driver() if in_driver else executor
    folder = f"{stage}/{KEYS}"
    from infra.storage import in_parallel

    def table_or_none(rel):
        try:
            return storage.read_table(rel)
        except (FileNotFoundError, OSError):
            return None

    # both read side by side (an append reads both for every stage; one wait on the store's latency)
    meta, listed = in_parallel(lambda f: f(), [lambda: storage.read_json(f"{folder}/meta.json") or {},
                                               lambda: table_or_none(f"{folder}/files.parquet")])
    known = listed.to_pylist() if listed is not None and meta.get("format") == FORMAT else None
    if meta.get("format") == FORMAT:
        ids = {s["id"] for s in meta["segments"]}
        if known is not None and any(r["segment"] not in ids for r in known):
            known = None    # the file list written, the meta not (a build stopped between the two)
    if known is None:
        if meta:    # an index of capline's first format, or torn: rebuilt whole
            storage.delete(folder)
        meta, known = {"format": FORMAT, "next": 0, "segments": []}, []
    segments = [dict(s) for s in meta["segments"]]
    by_id = {s["id"]: s for s in segments}
    indexed = {r["file"]: r for r in known}
    died = [f for f, r in indexed.items() if files.get(f) != r["sha256"]]
    dead: dict[int, set] = {}
    for f in died:      # gone, or rewritten since its segment took its keys
        r = indexed.pop(f)
        dead.setdefault(r["segment"], set()).add(f)
        by_id[r["segment"]]["dead_rows"] += r["rows"]
    for i, names in dead.items():     # each list sorted once (a stage rebuilt kills every ledger at once)
        by_id[i]["dead"] = sorted({*by_id[i]["dead"], *names})
    todo = sorted(f for f in files if f not in indexed)
    nxt, written, read, handed = meta["next"], 0, 0, 0
    if todo:
        new_rows = sum(rows.get(f, 0) for f in todo)
        seg = {"id": nxt, "buckets": max(1, math.ceil(new_rows / ROWS_PER_BUCKET)), "rows": 0, "dead": [], "dead_rows": 0}
        nxt += 1
        inputs = [("ledger", f, [], given.get(f), rows.get(f, 0)) for f in todo]
        seg["rows"], read, handed = _write_segment(storage, executor, folder, stage, seg, inputs)
        written += seg["rows"]
        segments.append(seg)
        indexed.update({f: {"file": f, "sha256": files[f], "segment": seg["id"], "rows": rows.get(f, 0)} for f in todo})
    # wholly dead, deleted unread: no ledger indexed there is current (by the files, not the rows,
    # which are the stage's counts and only steer merging)
    holding = {r["segment"] for r in indexed.values()}
    gone = [s for s in segments if s["id"] not in holding]
    segments = [s for s in segments if s["id"] in holding]
    k = merge_from(segments)
    merged = segments[k:] if k < len(segments) else []
    if merged:
        seg = {"id": nxt, "buckets": max(1, math.ceil(sum(_live(s) for s in merged) / ROWS_PER_BUCKET)),
               "rows": 0, "dead": [], "dead_rows": 0}
        nxt += 1
        inputs = [("segment", segment_file(folder, s["id"], b), s["dead"], None, s["rows"] // s["buckets"])
                  for s in merged for b in range(s["buckets"])]
        seg["rows"], _, _ = _write_segment(storage, executor, folder, stage, seg, inputs)
        written += seg["rows"]
        ids = {s["id"] for s in merged}
        for r in indexed.values():
            if r["segment"] in ids:
                r["segment"] = seg["id"]
        segments = segments[:k] + [seg]
    if todo or died or merged:
        table = pa.Table.from_pylist(sorted(indexed.values(), key=lambda r: r["file"]), schema=FILES)
        storage.write_table(f"{folder}/files.parquet", table)
        retired = [[s["id"], s["buckets"]] for s in gone + merged]
        storage.write_json(f"{folder}/meta.json", {"format": FORMAT, "next": nxt, "segments": segments,
                                                   "retired": retired})
        # after the meta that no longer names them; the meta keeps their names until the next build,
        # which deletes them again in the same request as its own: a driver that stopped between the
        # meta and these deletes leaves no segment file behind for good
        storage.delete_files([segment_file(folder, i, b) for i, n in meta.get("retired", []) + retired
                              for b in range(n)])
    return IndexMeta(len(segments), sum(_live(s) for s in segments), read, handed, written)


def _write_segment(storage, executor, folder: str, stage: str, seg: dict, inputs: list[tuple]) -> tuple[int, int, int]:
    """Write segment `seg` from `inputs` ((kind, path, dead, keys in hand, rows) each); -> (rows,
    ledgers read, ledgers handed)."""
    if seg["buckets"] == 1:    # one task, no pieces
        ledgers = [p for kind, p, _, g, _ in inputs if kind == "ledger" and g is None]
        handed = [p for kind, p, _, g, _ in inputs if kind == "ledger" and g is not None]
        segs = [(p, dead) for kind, p, dead, _, _ in inputs if kind == "segment"]
        (done,) = executor.run(_one_task, [(storage, segment_file(folder, seg["id"], 0), ROW_GROUP, ledgers, segs,
                                            handed, *(g for kind, _, _, g, _ in inputs if kind == "ledger" and g is not None))],
                               f"{stage} key index", num_cpus=0.25, quiet=True)
        return done.rows, done.ledgers_read, done.ledgers_handed
    n = seg["buckets"]
    # the maps windowed by the keys they hold: a process hashes 10^6 keys in about a second, and
    # asking for a task per CPU slot started processes instead (45 at once on 2 cores: 53 s of maps
    # for 10^7 keys)
    counts = executor.shuffle(_map_task, [(storage, kind, p, n, dead, g) for kind, p, dead, g, _ in inputs], n,
                              _reduce_task, [(storage, segment_file(folder, seg["id"], b), ROW_GROUP) for b in range(n)],
                              f"{stage} key index", num_cpus=0.25, sizes=[size for *_, size in inputs],
                              items_per_worker=KEYS_PER_WORKER)
    ledgers = [g for kind, _, _, g, _ in inputs if kind == "ledger"]
    return sum(counts), sum(1 for g in ledgers if g is None), sum(1 for g in ledgers if g is not None)


def lookup(storage, stage: str, key: str) -> str | None:
    """The ledger file of `stage` that holds `key`: "" if none does, None if the stage has no index
    (a run made before there were indexes: the caller scans). A small read per segment, newest
    first, until one holds the key."""
    folder = f"{stage}/{KEYS}"
    meta = storage.read_json(f"{folder}/meta.json")
    if meta is None:
        return None
    from stages.dataplane import hash_buckets

    if meta.get("format") != FORMAT:    # capline's first format: `buckets` files named by number
        b = int(hash_buckets([key], meta["buckets"])[0])
        return _find(storage, f"{folder}/{b:06d}.parquet", key) or ""
    for seg in reversed(meta["segments"]):
        file = _find(storage, segment_file(folder, seg["id"], int(hash_buckets([key], seg["buckets"])[0])), key)
        if file is not None:
            return "" if file in seg["dead"] else file
    return ""


def _find(storage, path: str, key: str) -> str | None:
    # sorted by key in small row groups: the filter reads the footer and the one group that can hold it
    hit = pq.read_table(storage.path(path), filesystem=storage.fs, columns=["file"], filters=[("key", "==", key)])
    return hit.column("file")[0].as_py() if hit.num_rows else None
