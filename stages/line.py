"""A dataset line: what an append-only shard stage (`stages.shard.append`) has published, run
after run, kept in the run folder across runs (ShardStage.preserve).

- `shard/line/line.json`: every shard the line holds (name, samples, bytes, sha256, md5, the run
  that added it, its ledger partition) and, per run, the shards it added. Written last: a shard is
  published once it is listed here.
- `shard/line/published/<partition>.parquet`: per input partition of the shard stage, its keys that
  are in a shard, and which shard. A key whose shard is not listed in line.json (a run that stopped
  before it wrote line.json) is not published. Beside it `<partition>.json`: how many samples the
  partition kept then, their key-set checksum and the run: a later run that finds the partition
  keeping the same samples has nothing to place from it.

The shard stage reads it to place only new samples in new shards; dedup reads it to keep a
published sample over a new duplicate of it (so no published sample is dropped later).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.compute as pc

LINE = "shard/line"
RECORD = f"{LINE}/line.json"
PUBLISHED = f"{LINE}/published"
PUBLISHED_SCHEMA = pa.schema([("key", pa.string()), ("shard", pa.string())])


def read_line(storage) -> dict | None:
    """The line's record, or None when no append-only run has published yet."""
    return storage.read_json(RECORD)


def published_file(part: str) -> str:
    return f"{PUBLISHED}/{part}.parquet"


def published_state(part: str) -> str:
    """What the partition kept when the line last published from it (kept, kept_sum, run)."""
    return f"{PUBLISHED}/{part}.json"


def published_parts(storage) -> set[str]:
    """The input partitions that have published keys."""
    return {f.rsplit("/", 1)[-1][:-len(".parquet")] for f in storage.list(PUBLISHED, ".parquet")}


def published_rows(storage, part: str, shards: frozenset[str]) -> pa.Table:
    """A partition's published (key, shard) rows, only those in a shard the line lists."""
    if not storage.exists(published_file(part)):
        return PUBLISHED_SCHEMA.empty_table()
    t = storage.read_table(published_file(part)).select(PUBLISHED_SCHEMA.names)
    return t.filter(pc.is_in(t.column("shard"), pa.array(sorted(shards), pa.string())))


def published_among(storage, parts: list[str], keys: set[str], shards: frozenset[str]) -> set[str]:
    """Which of `keys` (from the partitions `parts`) are published: each partition's file read once,
    16 at a time, and only its matching keys held (memory: the keys asked about)."""
    if not parts or not shards:
        return set()
    want = pa.array(sorted(keys), pa.string())

    def hits(part: str) -> list[str]:
        t = published_rows(storage, part, shards)
        return t.filter(pc.is_in(t.column("key"), want)).column("key").to_pylist()

    with ThreadPoolExecutor(min(16, len(parts))) as pool:
        return {k for ks in pool.map(hits, parts) for k in ks}
