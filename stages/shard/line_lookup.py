"""A dataset line's lookup: every published sample by its key, its URL and the sha256 of its image,
so a removal finds its matches in a few reads, however many partitions the line holds.

Each run that publishes writes the lookup of the samples it added, as the last step of its
publish shuffle (stages/shard/stage.py): each partition's publish task hands every bucket its (kind,
value) rows through Ray's object store, and a task per bucket writes
`shard/line/lookup/<run>/<bucket>.parquet` (kind, value, key, part, shard). The line's record
keeps each run's bucket count (`runs[i].lookup`). A removal reads, for each run, only the buckets
its entries hash to, then confirms the candidates against their partitions' published records (a
lookup row outlives the removal of its sample). Runs published before the lookup existed have no
count: a removal from such a line reads every partition, as before.
"""
from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc

from ..dataplane import hash_buckets, hash_pieces
from .line import LINE

LOOKUP = f"{LINE}/lookup"
ROWS_PER_BUCKET = 1_000_000         # lookup rows (~150 bytes each) in one bucket file
KINDS = ("key", "url", "sha256")
SCHEMA = pa.schema([("kind", pa.string()), ("value", pa.string()), ("key", pa.string()), ("part", pa.string()),
                    ("shard", pa.string())])


def buckets_for(samples: int) -> int:
    """Bucket files for a run that adds `samples` (three lookup rows each)."""
    return max(1, math.ceil(3 * samples / ROWS_PER_BUCKET))


def _probe(kind: str, value: str) -> str:
    return f"{kind}\0{value}"


def pieces(part: str, keys: list[str], urls: list, shas: list, shards: list[str], n: int) -> list[pa.Table]:
    """One partition's added samples as lookup rows, cut into `n` pieces by (kind, value)."""
    rows = {"kind": [], "value": [], "key": [], "part": [], "shard": []}
    for kind, values in (("key", keys), ("url", urls), ("sha256", shas)):
        for v, k, s in zip(values, keys, shards):
            if v:
                for col, x in zip(rows, (kind, v, k, part, s)):
                    rows[col].append(x)
    t = pa.table(rows, schema=SCHEMA)
    return hash_pieces(t, [_probe(a, b) for a, b in zip(rows["kind"], rows["value"])], n)


def bucket_file(run: int, bucket: int) -> str:
    return f"{LOOKUP}/{run:04d}/{bucket:05d}.parquet"


def write_bucket(storage, rel: str, *got: pa.Table) -> int:
    """Ray task (the publish shuffle's reduce): one bucket of a run's lookup, sorted by value."""
    t = pa.concat_tables(got) if got else SCHEMA.empty_table()
    storage.write_table(rel, t.sort_by([("kind", "ascending"), ("value", "ascending"), ("key", "ascending")]))
    return t.num_rows


def complete(runs: list[dict]) -> bool:
    """Whether every run of the line wrote its lookup (else a removal reads every partition)."""
    return bool(runs) and all(isinstance(r.get("lookup"), int) and r["lookup"] >= 1 for r in runs)


def find(storage, runs: list[dict], entries: dict[str, list[str]]) -> pa.Table:
    """Ray task: the lookup rows that name an entry's (kind, value), over every run: for each run
    only the bucket files the entries hash to. `entries`: kind -> values."""
    probes = [(k, v) for k in KINDS for v in entries.get(k, [])]
    if not probes:
        return SCHEMA.empty_table()
    files = []
    for r in runs:
        b = hash_buckets([_probe(k, v) for k, v in probes], r["lookup"])
        files += [bucket_file(r["run"], int(x)) for x in sorted(set(b.tolist()))]
    got = [t for t in storage.read_tables(files) if t is not None]
    if not got:
        return SCHEMA.empty_table()
    t = pa.concat_tables(got)
    want = pa.array([_probe(k, v) for k, v in probes], pa.string())
    return t.filter(pc.is_in(pc.binary_join_element_wise(t.column("kind"), t.column("value"), "\0"), want))
