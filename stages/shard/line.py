"""A dataset line: what an append-only shard stage (`stages.shard.append`) has published, run
after run, kept in the run folder across runs (ShardStage.preserve).

- `shard/line/line.json`: every shard the line holds (name, samples, bytes, sha256, md5, the run
  that added it, its ledger partition) and, per run, the shards it added. Written last: a shard is
  published once it is listed here.
- `shard/line/published/<partition>.parquet`: per input partition of the shard stage, its keys that
  are in a shard, and which shard. A key whose shard is not listed in line.json (a run that stopped
  before it wrote line.json) is not published. `published/_states.parquet`: per partition, how many
  samples it kept when the line last published from it, their key-set checksum and the run (one
  table, read in one request: a later run that finds a partition keeping the same samples has
  nothing to place from it). Lines published before the table read `<partition>.json` beside
  each partition's keys instead.

The shard stage reads it to place only new samples in new shards; dedup reads it to keep a
published sample over a new duplicate of it (so no published sample is dropped later).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

LINE = "shard/line"
RECORD = f"{LINE}/line.json"
PUBLISHED = f"{LINE}/published"
PUBLISHED_SCHEMA = pa.schema([("key", pa.string()), ("shard", pa.string())])


def read_line(storage) -> dict | None:
    """The line's record, or None when no append-only run has published yet."""
    return storage.read_json(RECORD)


def published_names(storage) -> set[str]:
    """The shard names this line has published as the bucket shows them beyond line.json: the last
    finished run's sizes.json (written after line.json, kept with the shards) and the old versions
    removals kept. A line.json that lacks one of them is stale."""
    sizes = storage.read_json("shard/shards/sizes.json")
    names = {n for n in sizes if isinstance(n, str)} if isinstance(sizes, dict) else set()
    return names | {f.rsplit("/", 1)[-1] for f in storage.list(f"{LINE}/versions", ".tar", recursive=True)}


def published_file(part: str) -> str:
    return f"{PUBLISHED}/{part}.parquet"


def published_state(part: str) -> str:
    """What the partition kept when the line last published from it (kept, kept_sum, run)."""
    return f"{PUBLISHED}/{part}.json"


STATES = f"{PUBLISHED}/_states.parquet"
STATES_SCHEMA = pa.schema([("part", pa.string()), ("kept", pa.int64()), ("kept_sum", pa.string()), ("run", pa.int64())])


def read_states(storage) -> dict[str, dict] | None:
    """partition -> {kept, kept_sum, run} when the line last published from it, from the one table;
    None for a line published before there was one."""
    try:
        t = storage.read_table(STATES)
    except (FileNotFoundError, OSError):
        return None
    return {p: {"kept": k, "kept_sum": s, "run": r}
            for p, k, s, r in zip(*(t.column(c).to_pylist() for c in STATES_SCHEMA.names))}


def write_states(storage, states: dict[str, dict]) -> None:
    parts = sorted(states)
    storage.write_table(STATES, pa.table({"part": parts, "kept": [states[p]["kept"] for p in parts],
                                          "kept_sum": [str(states[p]["kept_sum"]) for p in parts],
                                          "run": [states[p]["run"] for p in parts]}, schema=STATES_SCHEMA))


def published_parts(storage, states: dict | None = None) -> set[str]:
    """The input partitions that have published keys: the states table's (one read), or a listing
    for a line published before it."""
    states = read_states(storage) if states is None else states
    if states is not None:
        return set(states)
    return {f.rsplit("/", 1)[-1][:-len(".parquet")] for f in storage.list(PUBLISHED, ".parquet")
            if not f.endswith(STATES)}


def published_all(storage, part: str) -> pa.Table:
    """A partition's published (key, shard) rows, as its record holds them (one read; none: empty)."""
    try:
        return storage.read_table(published_file(part)).select(PUBLISHED_SCHEMA.names)
    except FileNotFoundError:
        return PUBLISHED_SCHEMA.empty_table()


def published_rows(storage, part: str, shards: frozenset[str]) -> pa.Table:
    """A partition's published (key, shard) rows, only those in a shard the line lists."""
    t = published_all(storage, part)
    return t.filter(pc.is_in(t.column("shard"), pa.array(sorted(shards), pa.string())))


def published_mask(storage, parts: list[str], keys: pa.Array, shards: frozenset[str]) -> np.ndarray:
    """Which of `keys` (from the partitions `parts`) are published: each partition's file read once,
    16 at a time, only its keys among `keys` held (memory: the keys asked about)."""
    if not parts or not shards or not len(keys):
        return np.zeros(len(keys), bool)

    def hits(part: str) -> pa.Array:
        t = published_rows(storage, part, shards)
        return t.column("key").filter(pc.is_in(t.column("key"), keys)).combine_chunks()

    with ThreadPoolExecutor(min(16, len(parts))) as pool:
        found = pa.concat_arrays([pa.array([], pa.string()), *pool.map(hits, parts)])
    return pc.is_in(keys, found).to_numpy(zero_copy_only=False)
