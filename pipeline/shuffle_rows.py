"""A shuffle's pieces as rows of Ray Data's hash shuffle, and back.

`Executor.shuffle` lets a map return one piece per reducer (any picklable value: an Arrow table, a
list of pairs) and hands reducer b the b-th piece of every map, in map order. Ray Data's
`groupby(...).map_groups` moves rows, so each piece travels as one row:

    bucket: int32    the reducer it is for
    map:    int32    the map that made it (the order the reducer gets its pieces in)
    piece:  large_binary, the piece pickled (protocol 5; an Arrow table or batch in it as Arrow
            IPC: pickle would write a slice's whole parent buffers, 16x the bytes for 16 buckets)

Every map sends a row to every bucket, an empty piece included, so every reducer runs (a reducer
writes its bucket's file even when it got nothing) and gets one piece per map, as before. A
reducer's answer comes back the same way: its bucket, when it ran (its node's clock), and its result
or the exception it raised, pickled.
"""
from __future__ import annotations

import io
import pickle
import time
from typing import Callable

import pyarrow as pa

PIECES = pa.schema([("bucket", pa.int32()), ("route", pa.int64()), ("map", pa.int32()), ("piece", pa.large_binary())])
ANSWERS = pa.schema([("bucket", pa.int32()), ("t0", pa.float64()), ("t1", pa.float64()),
                     ("result", pa.large_binary()), ("error", pa.large_binary())])


def _from_ipc(data: bytes, batch: bool):
    reader = pa.ipc.open_stream(data)
    return reader.read_next_batch() if batch else reader.read_all()


class _ArrowAsIpc(pickle.Pickler):
    """pickle, with each Arrow table or record batch written as Arrow IPC: only the rows it holds."""

    def reducer_override(self, obj):
        if isinstance(obj, (pa.Table, pa.RecordBatch)):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, obj.schema) as writer:
                writer.write(obj)
            return _from_ipc, (sink.getvalue().to_pybytes(), isinstance(obj, pa.RecordBatch))
        return NotImplemented


def dumps(obj) -> bytes:
    out = io.BytesIO()
    _ArrowAsIpc(out, protocol=5).dump(obj)
    return out.getvalue()


def pack_pieces(m: int, pieces: list, routes: list[int] | None = None) -> pa.Table:
    """Map m's pieces, one row per bucket; `routes`: the key each bucket's rows are grouped by (`routes`)."""
    n = len(pieces)
    return pa.table([pa.array(range(n), pa.int32()), pa.array(routes if routes is not None else range(n), pa.int64()),
                     pa.array([m] * n, pa.int32()), pa.array([dumps(p) for p in pieces], pa.large_binary())],
                    schema=PIECES)


def routes(n: int) -> list[int]:
    """A key per bucket such that Ray Data's hash partitioning puts bucket b alone in partition b.

    Grouped by the bucket number itself, n buckets hash into n partitions with collisions (about a
    third of the partitions empty at n=8), and a partition's buckets run one after another in one
    reduce task: the reducers lose that much parallelism. Each bucket gets instead the first
    integer that Ray Data's own partition function sends to its partition. Only speed depends on
    it: rows are grouped by this key, one per bucket, whatever partition it lands in (a Ray whose
    partition function moved or hashes differently on another node only brings the collisions back)."""
    from infra.remote import importing_ray_data

    try:
        with importing_ray_data():      # in the driver, beside the warm-up thread's import
            from ray.data._internal.arrow_ops.transform_pyarrow import hash_partition
    except ImportError:
        return list(range(n))
    out: dict[int, int] = {}
    start, width = 0, max(64, 8 * n)
    while len(out) < n and start < 1000 * n + 10_000:
        candidates = pa.table({"route": pa.array(range(start, start + width), pa.int64())})
        for part, rows in hash_partition(candidates, hash_cols=["route"], num_partitions=n).items():
            if part not in out and rows.num_rows:
                out[part] = rows.column("route")[0].as_py()
        start += width
    return [out.get(b, -1 - b) for b in range(n)]    # a bucket never reached: a key of its own all the same


def unpack_group(group: pa.Table) -> tuple[int, list]:
    """One bucket's rows (in any order) -> (bucket, its pieces in map order)."""
    import pyarrow.compute as pc

    buckets = pc.unique(group.column("bucket")).to_pylist()
    if len(buckets) != 1:
        raise ValueError(f"a group holds the rows of buckets {sorted(buckets)[:5]}, not one")
    order = group.column("map").to_numpy().argsort(kind="stable")
    pieces = group.column("piece").take(pa.array(order))
    # each piece unpickled from a view of the column's buffer, not a copy of its bytes first
    return buckets[0], [pickle.loads(p.as_buffer()) for p in pieces]


def _picklable(err: BaseException) -> bytes:
    """The exception, pickled; one that cannot be (its class takes other arguments, it holds a
    lock) as a RuntimeError saying what it was, so the driver still names it."""
    try:
        data = pickle.dumps(err, protocol=5)
        pickle.loads(data)
        return data
    except Exception:   # noqa: BLE001 - any failure to round-trip means: send its text instead
        return pickle.dumps(RuntimeError(f"{type(err).__name__}: {err}"), protocol=5)


def answer(bucket: int, t0: float, result=None, error: BaseException | None = None) -> pa.Table:
    """A reducer's answer as one row: its result, or the exception it raised (with the address of
    the node it ran on, which the driver's message names when storage refused that node)."""
    if error is not None:
        import ray

        if ray.is_initialized():     # in a Ray worker (a unit test calls this without Ray)
            try:
                error.ip = ray.util.get_node_ip_address()
            except AttributeError:   # an exception that takes no attributes
                pass
    return pa.table([pa.array([bucket], pa.int32()), pa.array([t0]), pa.array([time.time()]),
                     pa.array([None if error is not None else dumps(result)], pa.large_binary()),
                     pa.array([None if error is None else _picklable(error)], pa.large_binary())], schema=ANSWERS)


def reduce_group(group: pa.Table, what: str, reduce_fn: Callable, calls_ref, failpoint: Callable[[str], None]) -> pa.Table:
    """Runs in a Ray Data task, once per bucket: `reduce_fn(*reduce_calls[bucket], *pieces)`. An
    exception the reducer raises is its answer (said once by the driver, never retried as if the
    node had failed); an ObjectRef among the call's arguments is resolved, as a task's would be."""
    import ray

    t0 = time.time()
    failpoint(f"{what} (reduce)")
    bucket, pieces = unpack_group(group)
    try:
        call = [ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in _calls(calls_ref)[bucket]]
        return answer(bucket, t0, result=reduce_fn(*call, *pieces))
    except Exception as err:   # noqa: BLE001 - handed to the driver, which says it in one line
        return answer(bucket, t0, error=err)


_CALLS: dict = {}    # per worker process: a shuffle's reducer calls, fetched once, not once per bucket


def _calls(ref) -> list:
    import ray

    key = ref.hex()
    if key not in _CALLS:
        _CALLS.clear()
        _CALLS[key] = ray.get(ref)
    return _CALLS[key]
