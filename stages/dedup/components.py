"""Step 6: the edges joined into clusters; of each the smallest key is kept, the rest name it."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from infra.shuffle import write_buckets
from .layout import DECISION_SCHEMA, DECISIONS, EDGE_SCHEMA, Clusters



def _ranks(counts: np.ndarray) -> np.ndarray:
    """1..c for each c in counts, concatenated: a run member's place after the run's first."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(counts)
    return np.arange(total) - np.repeat(ends - counts, counts) + 1


def component_roots(ia: np.ndarray, ib: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Connected components of the graph whose edges are (ia[i], ib[i]) over nodes 0..len(rank)-1;
    -> each node's root: the node of lowest `rank` in its component (column-wise: int arrays and
    scipy's components, no Python object per node)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    n = len(rank)
    graph = coo_matrix((np.ones(len(ia), np.int8), (ia, ib)), shape=(n, n)).tocsr()
    _, labels = connected_components(graph, directed=False)
    lowest = np.full(labels.max() + 1 if n else 0, n, np.int64)
    np.minimum.at(lowest, labels, rank)
    by_rank = np.empty(n, np.int64)
    by_rank[rank] = np.arange(n)
    return by_rank[lowest[labels]]


def line_edges(storage, files: list[str], carried: tuple | None, keep_as: str | None) -> tuple[pa.Table, int]:
    """This run's edges and, in an append, the dataset line's edges between partitions it did not
    search again (`carried`: (the line's edges file, those partitions)); written as the line's edges
    for the next run (`keep_as`), sorted. -> (the edges, how many were carried)."""
    t = pa.concat_tables(storage.read_tables(files)) if files else EDGE_SCHEMA.empty_table()
    n_carried = 0
    if carried is not None:
        old_file, stable = carried
        old = storage.read_table(old_file)
        kept = pa.array(sorted(stable), pa.string())
        old = old.filter(pc.and_(pc.is_in(old.column("part_a"), value_set=kept),
                                 pc.is_in(old.column("part_b"), value_set=kept)))
        n_carried = old.num_rows
        t = pa.concat_tables([t, old.cast(EDGE_SCHEMA)])
    t = t.sort_by([("a", "ascending"), ("b", "ascending"), ("kind", "ascending")])
    # nothing new and the same partitions: the line's file already holds exactly these edges
    if keep_as and not (carried is not None and keep_as == carried[0] and not files):
        storage.write_table(keep_as, t)
    return t, n_carried


def _components_task(storage, files: list[str], parts: list[str], shown_per_reason: int,
                     line_shards: frozenset = frozenset(), published_parts: frozenset = frozenset(),
                     carried: tuple | None = None, keep_as: str | None = None) -> Clusters:
    """Ray task: every edge (exact pairs, verified near pairs) joined into clusters; of each the
    smallest key is kept, or, in a dataset line (stages/shard/line.py), the samples it published (they
    are in shards already and stay kept; a new copy of one is the duplicate). Writes each dropped
    key's (reason, cosine, key kept) in one file, a row group per partition (its index in `parts`),
    for the partitions' tasks to read; -> per-partition counts and the first few drops of each
    reason (by key) for the report. Column-wise: its memory is a few arrays per key in an edge
    (~60 bytes each), growing with the duplicates, never with the data; the driver gets counts.
    `carried`, `keep_as`: the dataset line's edges (line_edges)."""
    from ..shard.line import published_mask

    t, n_carried = line_edges(storage, files, carried, keep_as)
    n_e = t.num_rows
    enc = pc.dictionary_encode(pa.concat_arrays([t.column("a").combine_chunks(), t.column("b").combine_chunks()]))
    ends, keys = enc.indices.to_numpy().astype(np.int32), enc.dictionary
    del enc
    ia, ib = ends[:n_e], ends[n_e:]
    n = len(keys)
    part = np.zeros(n, np.int32)           # a key lies in one partition
    part_index = pa.array(parts, pa.string())
    for col, idx in (("part_a", ia), ("part_b", ib)):
        part[idx] = pc.index_in(t.column(col), part_index).to_numpy(zero_copy_only=False)
    is_exact = pc.equal(t.column("kind"), "exact_duplicate").to_numpy(zero_copy_only=False)
    cos = pc.fill_null(t.column("cosine"), -1.0).to_numpy(zero_copy_only=False)
    del t                                  # from here on: integer and float arrays, and the keys once
    pub_parts = sorted({parts[i] for i in np.unique(part)} & published_parts)
    published = published_mask(storage, pub_parts, keys, line_shards) if pub_parts else np.zeros(n, bool)
    by_key = np.empty(n, np.int64)
    by_key[pc.sort_indices(keys).to_numpy()] = np.arange(n)
    rank = np.empty(n, np.int64)           # published samples first, then by key
    rank[np.lexsort((by_key, ~published))] = np.arange(n)
    roots = component_roots(ia, ib, rank)
    exact = np.zeros(n, bool)
    for idx in (ia, ib):
        exact[idx[is_exact]] = True
    best = np.full(n, -1.0)
    near = ~is_exact
    for idx in (ia, ib):
        np.maximum.at(best, idx[near], cos[near])
    drop = np.flatnonzero((roots != np.arange(n)) & ~published)
    drop = drop[np.argsort(by_key[drop])]          # by key
    table = pa.table({"key": keys.take(pa.array(drop, pa.int64())),
                      "reason": pc.if_else(pa.array(exact[drop]), "exact_duplicate", "near_duplicate"),
                      "score": pa.array(np.where(exact[drop], np.nan, best[drop]), pa.float64(), from_pandas=True),
                      "root": keys.take(pa.array(roots[drop], pa.int64())),
                      "part": pa.array(part[drop], pa.int32())}, schema=DECISION_SCHEMA)
    if len(drop):
        write_buckets(storage, DECISIONS, table, "part")
    per_part = {parts[i]: int(c) for i, c in enumerate(np.bincount(part[drop], minlength=len(parts))) if c}
    shown: dict[str, list] = {}
    for why, mask in (("exact_duplicate", exact[drop]), ("near_duplicate", ~exact[drop])):
        for k in drop[mask][:shown_per_reason]:
            shown.setdefault(why, []).append((keys[k].as_py(), None if exact[k] else float(best[k]),
                                              keys[roots[k]].as_py(), parts[part[k]], parts[part[roots[k]]]))
    # what decides each partition's verdicts besides its own descriptors: a partition whose input,
    # descriptors and decisions are those of an earlier run is not judged again (a part at a time)
    by_part = table.sort_by([("part", "ascending"), ("key", "ascending")])
    digests, bounds = {}, np.flatnonzero(np.diff(by_part.column("part").to_numpy())) + 1
    for lo, hi in zip([0, *bounds], [*bounds, by_part.num_rows]):
        if hi > lo:
            piece = by_part.slice(lo, hi - lo)
            rows = zip(*(piece.column(c).to_pylist() for c in ("key", "reason", "score", "root")))
            digests[parts[piece.column("part")[0].as_py()]] = hashlib.sha256(
                json.dumps(list(rows)).encode()).hexdigest()[:24]
    return Clusters(len(drop), per_part, shown, digests, int((published & (roots != np.arange(n))).sum()), n_e, n_carried)
