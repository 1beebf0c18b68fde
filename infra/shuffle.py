"""A shuffle's map side and reduce side, in few objects: each map task writes ONE Parquet file whose
row groups are its rows per bucket (sorted by bucket), and a reduce task reads, from every map file,
only the row groups of its bucket, found through the file's footer (the min and max of the bucket
column). Objects written: one per map task, never one per (map, bucket); requests per reduce: two
per map file (footer, row groups), several files at once. Used by dedup for its pairs, wanted
descriptors and decisions (the shard stage and dedup's signatures shuffle through Ray's object
store: pipeline/ray_shuffle.py, through `Executor.shuffle`).
"""
from __future__ import annotations


import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq


def write_buckets(storage, rel: str, table: pa.Table, column: str) -> str:
    """Write `table` to `rel` as one file, a row group per value of the integer `column` (sorted by
    it first; a stable sort, so rows keep their order within a bucket). -> sha256 of the file."""
    table = table.take(pc.sort_indices(table, [(column, "ascending")]))
    return _write_grouped(storage, rel, table, table.column(column).to_numpy())


def _row_groups(writer, table: pa.Table, groups: np.ndarray) -> None:
    """`table` (sorted by `groups`) as a row group per run of equal values in `groups`."""
    bounds = np.flatnonzero(np.diff(groups)) + 1
    for lo, hi in zip([0, *bounds], [*bounds, table.num_rows]):
        if hi > lo:
            writer.write_table(table.slice(lo, hi - lo), row_group_size=hi - lo)


def _write_grouped(storage, rel: str, table: pa.Table, groups: np.ndarray) -> str:
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, table.schema, compression="zstd") as writer:
        _row_groups(writer, table, groups)
        if table.num_rows == 0:
            writer.write_table(table)
    return storage.write_bytes(rel, sink.getvalue().to_pybytes())   # whole or not at all: the map is done


READ_THREADS = 16    # map files read at once by one reduce task: on an object store each read waits on latency


def read_bucket(storage, files: list[str], column: str, value: int, schema: pa.Schema,
                counter: dict | None = None) -> pa.Table:
    """The rows of bucket `value` from every map file (each row group that holds it, by its
    statistics), READ_THREADS files at a time; pieces keep the files' order."""
    return _read_span(storage, files, column, value, value + 1, schema, counter)


def read_span(storage, files: list[str], column: str, lo: int, hi: int, schema: pa.Schema) -> pa.Table:
    """The rows of buckets lo .. hi-1 from every map file (a reader of several consecutive buckets)."""
    return _read_span(storage, files, column, lo, hi, schema, None)


def _read_span(storage, files: list[str], column: str, lo: int, hi: int, schema: pa.Schema,
               counter: dict | None) -> pa.Table:
    """The rows whose `column` is in [lo, hi), from the row groups of each file whose statistics
    overlap it."""
    from concurrent.futures import ThreadPoolExecutor

    def one(rel):
        with storage.fs.open_input_file(storage.path(rel)) as f:
            pf = pq.ParquetFile(f)
            col = pf.schema_arrow.get_field_index(column)
            groups = [i for i in range(pf.metadata.num_row_groups)
                      if (st := pf.metadata.row_group(i).column(col).statistics) is not None
                      and st.has_min_max and st.min < hi and st.max >= lo]
            return (pf.read_row_groups(groups) if groups else None), len(groups)

    if len(files) > 1:
        with ThreadPoolExecutor(min(READ_THREADS, len(files))) as pool:
            got = list(pool.map(one, files))
    else:
        got = [one(rel) for rel in files]
    if counter is not None:
        counter["files"] = counter.get("files", 0) + len(files)
        counter["groups"] = counter.get("groups", 0) + sum(n for _, n in got)
    pieces = [t for t, _ in got if t is not None]
    t = pa.concat_tables(pieces) if pieces else schema.empty_table()
    v = t.column(column)
    return t.filter(pc.and_(pc.greater_equal(v, pa.scalar(lo)), pc.less(v, pa.scalar(hi))))


# -- range buckets: a map file that outlives the number of reducers ------------------------------
# A row's bucket is a range of a uint32 hash column: bucket b of n holds hashes in
# [ceil(b 2^32 / n), ceil((b + 1) 2^32 / n)). A map file is sorted by the hash, a row group per
# bucket of the n it was written for; read with another n, a reducer reads the one to three row
# groups its range overlaps. So a map file made by an earlier run stays usable when the data (and
# with it the number of buckets) grew.
def range_of(bucket: int, n: int) -> tuple[int, int]:
    return -(-bucket * 2**32 // n), -(-(bucket + 1) * 2**32 // n)


def range_buckets(hashes: np.ndarray, n: int) -> np.ndarray:
    return ((hashes.astype(np.uint64) * np.uint64(n)) >> np.uint64(32)).astype(np.int64)


def write_ranges(storage, rel: str, table: pa.Table, column: str, n: int) -> str:
    """`table` sorted by its uint32 `column`, one row group per range bucket of `n`, as one file."""
    table = table.sort_by(column)
    return _write_grouped(storage, rel, table, range_buckets(table.column(column).to_numpy(), n))


def read_range(storage, files: list[str], column: str, bucket: int, n: int, schema: pa.Schema,
               counter: dict | None = None) -> pa.Table:
    """The rows of range bucket `bucket` of `n` from every map file (the row groups that overlap it)."""
    return _read_span(storage, files, column, *range_of(bucket, n), schema, counter)


def range_pieces(table: pa.Table, column: str, n: int) -> list[pa.Table]:
    """`table`, sorted by its uint32 `column` (as `write_ranges` leaves a file), cut into its `n`
    range buckets: zero-copy slices, for a shuffle through the object store."""
    buckets = range_buckets(table.column(column).to_numpy(), n)
    if len(buckets) > 1 and np.any(np.diff(buckets) < 0):
        order = np.argsort(buckets, kind="stable")
        table, buckets = table.take(order), buckets[order]
    bounds = np.searchsorted(buckets, np.arange(n + 1), side="left")
    return [table.slice(int(lo), int(hi - lo)) for lo, hi in zip(bounds[:-1], bounds[1:])]


def map_groups(sizes: list[int], budget: int, at_least: int) -> list[list[int]]:
    """Consecutive items (files, partitions) gathered into a shuffle's map tasks: -> lists of
    indices. A map task per item costs a task start and a round of the scheduler each: at 2,000
    partitions of a few samples that was most of an append's dedup. Groups hold at most `budget`
    (rows, bytes: a map's memory; an item larger than it is a group alone), and there are at least
    `at_least` of them where there are that many items (the cluster kept busy)."""
    if not sizes:
        return []
    total = sum(sizes)
    target = max(1, min(budget, -(-total // max(1, min(at_least, len(sizes))))))
    groups, current, held = [], [], 0
    for i, size in enumerate(sizes):
        if current and held + size > target:
            groups.append(current)
            current, held = [], 0
        current.append(i)
        held += size
    groups.append(current)
    return groups
