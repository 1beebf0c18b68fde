"""Step 4: the group shuffle's map and reduce: exact pairs, and near candidates by shared band values."""
from __future__ import annotations


import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from infra.shuffle import range_pieces, read_range, write_buckets

from ..dataplane import hash_buckets
from .layout import PAIR_DIR, PAIR_SCHEMA, SIG_SCHEMA, WANTED_DIR, WANTED_SCHEMA, Grouped, Pair
from .lsh import SMALL_GROUP, close_in_groups, collapse_copies, runs
from .components import _ranks
from .config import DedupConfig, hamming_radius
from .sign import _packed


BLOCK = 1024                 # rows of a large signature group compared at once (memory: BLOCK x group x bits/8)


PAIR_FAN_IN = 64      # signature buckets per pair bucket


def _pair_buckets(a: list[str], b: list[str], n: int) -> np.ndarray:
    """A pair's bucket for the verification step: by the pair, so every copy of a pair (found in
    several signature buckets: several bands alike) meets the others in one task."""
    return hash_buckets([f"{x}\0{y}" for x, y in zip(a, b)], n)


def _sig_pieces(storage, units: list[tuple[str, list[str]]], n_buckets: int, keep_as: str | None = None) -> list[pa.Table]:
    """Ray task (the group shuffle's map): a few units of signatures, each read once (in parallel),
    cut into the `n_buckets` range buckets for the group tasks (through the object store, not the
    bucket). A unit is (a file, the partitions' files it joins): a partition's signature file, or a
    chunk of the dataset line's (several partitions' signatures in one file: an append reads a few
    chunks, not a file per partition), read from its partitions' files if it is gone. `keep_as`:
    what was read is written there as one chunk, for the next run."""
    try:
        tables = storage.read_tables([f for f, _ in units])
    except FileNotFoundError:     # a chunk gone: that one read from its partitions' files
        tables = [_unit(storage, f, parts) for f, parts in units]
    t = pa.concat_tables(tables)
    if keep_as:
        storage.write_table(keep_as, t)
    return range_pieces(t, "h32", n_buckets)


def _unit(storage, file: str, parts: list[str]) -> pa.Table:
    try:
        return storage.read_table(file)
    except FileNotFoundError:
        if not parts:
            raise
        return pa.concat_tables(storage.read_tables(parts))


def _group_reduce(storage, bucket: int, cfg: DedupConfig, n_pair_buckets: int, n_fetch: int,
                  fresh: frozenset | None, *pieces: pa.Table) -> Grouped:
    """Ray task (the group shuffle's reduce): one signature bucket's pieces from every partition."""
    return _group_rows(storage, bucket, cfg, pa.concat_tables(pieces) if pieces else SIG_SCHEMA.empty_table(),
                       n_pair_buckets, n_fetch, fresh)


def _group_task(storage, bucket: int, cfg: DedupConfig, files: list[str], n_buckets: int, n_pair_buckets: int,
                fresh: frozenset | None = None) -> Grouped:
    """One signature bucket read from the signature files themselves (`benchmarks/dedup_within.py`
    runs the group step alone this way)."""
    return _group_rows(storage, bucket, cfg, read_range(storage, files, "h32", bucket, n_buckets, SIG_SCHEMA),
                       n_pair_buckets, fresh=fresh)


def _group_rows(storage, bucket: int, cfg: DedupConfig, t: pa.Table, n_pair_buckets: int,
                n_fetch: int | None = None, fresh: frozenset | None = None) -> Grouped:
    """One signature bucket -> its pairs (a < b, with their partitions and kind), written to one file
    bucketed by pair (infra/shuffle.py); -> counts. Equal exact signatures pair every member with the
    group's smallest key; equal band values pair the members whose codes are within the Hamming
    radius and whose colours agree (stages/dedup/lsh.py), the whole group, never cut. `fresh`: the
    partitions new since the dataset line's edges were found (an append): only groups holding a row
    of one are searched (in full), and only pairs with a side in one are kept; the others are the
    line's edges already."""
    t = t.sort_by([("sig_kind", "ascending"), ("sig_hi", "ascending"), ("sig_lo", "ascending"), ("key", "ascending")])
    kind, hi, lo = (t.column(c).to_numpy() for c in ("sig_kind", "sig_hi", "sig_lo"))
    starts, lengths = runs(kind, hi, lo)
    touched = np.ones(len(starts), bool)
    if fresh is not None and len(starts):
        is_fresh = pc.is_in(t.column("part"), value_set=pa.array(sorted(fresh), pa.string()))
        touched = np.add.reduceat(is_fresh.to_numpy(zero_copy_only=False).astype(np.int64), starts) > 0
    exact = (kind[starts] < 2) & (lengths > 1) & touched
    firsts = np.repeat(starts[exact], lengths[exact] - 1)
    ex_i, ex_j = [firsts], [firsts + _ranks(lengths[exact] - 1)]
    near = (kind[starts] >= 2) & (lengths > 1) & touched
    largest = int(lengths[near].max()) if near.any() else 0
    nr_i, nr_j = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    if near.any():
        codes = _packed(t.column("code"), cfg.bits // 8)
        means = t.column("mean").combine_chunks().flatten().to_numpy().reshape(-1, 3)
        g_starts, g_lengths, rows = starts[near], lengths[near], None
        if (g_lengths > SMALL_GROUP).any():      # exact copies (placeholders) paired linearly, then searched once
            rows, g_starts, g_lengths, copy_i, copy_j = collapse_copies(codes, means, g_starts, g_lengths)
            nr_i.append(copy_i)
            nr_j.append(copy_j)
            codes, means = codes[rows], means[rows]
        for i, j in close_in_groups(codes, means, g_starts, g_lengths, hamming_radius(cfg.within_threshold, cfg.bits),
                                    cfg.colour_tol, BLOCK):
            nr_i.append(i if rows is None else rows[i])
            nr_j.append(j if rows is None else rows[j])
    pairs = set()
    for i_list, j_list, what in ((ex_i, ex_j, "exact_duplicate"), (nr_i, nr_j, "near_duplicate")):
        i, j = np.concatenate(i_list).astype(np.int64), np.concatenate(j_list).astype(np.int64)
        # only the rows in a pair become Python strings
        ka, pa_, kb, pb = (t.column(c).take(x).to_pylist() for x in (i, j) for c in ("key", "part"))
        pairs |= {Pair(*p, what) for p in zip(ka, pa_, kb, pb) if fresh is None or p[1] in fresh or p[3] in fresh}
    rows = sorted(pairs)
    cols = {f: [getattr(p, f) for p in rows] for f in Pair._fields}
    pair_bucket = _pair_buckets(cols["a"], cols["b"], n_pair_buckets)
    table = pa.table({**cols, "pair_bucket": pa.array(pair_bucket, pa.int32())}, schema=PAIR_SCHEMA)
    if rows:            # no empty files: the driver passes on the names of those written
        write_buckets(storage, f"{PAIR_DIR}/{bucket:06d}.parquet", table, "pair_bucket")
    # each near candidate's two descriptors, asked of the partitions that hold them (a join, not a
    # task reading every partition's descriptors)
    wanted = sorted({(k, part, int(pb)) for p, pb in zip(rows, pair_bucket) if p.kind == "near_duplicate"
                     for k, part in ((p.a, p.part_a), (p.b, p.part_b))})
    if wanted:
        write_buckets(storage, f"{WANTED_DIR}/{bucket:06d}.parquet", pa.table({
            "key": [w[0] for w in wanted], "part": [w[1] for w in wanted], "pair_bucket": pa.array([w[2] for w in wanted], pa.int32()),
            "fetch_bucket": pa.array(hash_buckets([w[1] for w in wanted], n_fetch or n_pair_buckets))},
            schema=WANTED_SCHEMA), "fetch_bucket")
    return Grouped(len(rows), len(wanted), largest, t.num_rows)


MAP_SIGNATURES = 2_000_000   # signature rows a group map task holds (~70 bytes each)
