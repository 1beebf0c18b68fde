"""Step 5: the near candidates' descriptors fetched by partition and checked by exact cosine, thumbnail
and detail (the edges)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from infra.shuffle import read_bucket, read_span

from ..dataplane import bucket_pieces
from .layout import EDGE_DIR, EDGE_SCHEMA, PAIR_SCHEMA, VEC_SCHEMA, WANTED_SCHEMA, Pair, Verified


FETCH_PARTS = 512      # partitions whose descriptors one fetch task reads, at most, where CPUs allow (each reads every wanted file)
# the group step cuts the wanted descriptors into fetch buckets before it is known how many there are;
# the driver then gives each fetch task consecutive buckets holding up to this many (an append's 30
# wanted descriptors took 4 tasks, each reading the wanted file, 2.6-3.3 s)
FETCH_WANTED = 2_000
FETCH_AT_ONCE = 32     # descriptor files a fetch task reads at once (each waits on the store's latency)


def fetch_spans(n_fetch: int, wanted: int) -> list[tuple[int, int]]:
    """The fetch buckets 0 .. n_fetch-1 as consecutive spans, one per fetch task: as many tasks as
    `wanted` descriptors need at FETCH_WANTED a task, at most n_fetch."""
    tasks = max(1, min(n_fetch, -(-wanted // FETCH_WANTED)))
    edges = [round(i * n_fetch / tasks) for i in range(tasks + 1)]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]


def _fetch_pieces(storage, span: tuple[int, int], files: list[str], desc: dict[str, str], n_pairs: int,
                  with_detail: bool = True) -> list[pa.Table]:
    """Ray task (the verify shuffle's map): the descriptors wanted of the fetch buckets in `span`
    (each a group of partitions; each partition's file read once) -> a piece per pair bucket, handed
    to the verify tasks through Ray's object store. `with_detail` False (the detail check off): the
    detail descriptors are left unread (null), 1,152 bytes a candidate less through the store."""
    columns = ["key", "vec", "detail"] if with_detail else ["key", "vec"]
    t = read_span(storage, files, "fetch_bucket", *span, WANTED_SCHEMA)
    by_part: dict[str, list] = {}
    for k, part, pb in zip(*(t.column(c).to_pylist() for c in ("key", "part", "pair_bucket"))):
        by_part.setdefault(part, []).append((k, pb))
    out = {"key": [], "vec": [], "detail": [], "pair_bucket": []}
    parts = sorted(by_part)
    for lo in range(0, len(parts), FETCH_AT_ONCE):     # read in parallel, a group at a time (memory: a group)
        group = parts[lo:lo + FETCH_AT_ONCE]
        for part, d in zip(group, storage.read_tables([desc[q] for q in group], columns)):
            want = by_part[part]
            d = d.filter(pc.is_in(d.column("key"), pa.array(sorted({k for k, _ in want}))))
            details = d.column("detail").to_pylist() if with_detail else [None] * d.num_rows
            got = dict(zip(d.column("key").to_pylist(), zip(d.column("vec").to_pylist(), details)))
            for k, pb in want:
                out["key"].append(k)
                out["vec"].append(got[k][0])
                out["detail"].append(got[k][1])
                out["pair_bucket"].append(pb)
    table = pa.table(out, schema=VEC_SCHEMA)
    return bucket_pieces(table, np.asarray(out["pair_bucket"], np.int64), n_pairs)


def _unit(v: bytes) -> np.ndarray:
    x = np.frombuffer(v, np.float16).astype(np.float32)
    return x / (np.linalg.norm(x) + 1e-6)


def _verify_reduce(storage, bucket: int, files: list[str], threshold: float, detail_threshold: float,
                   *pieces: pa.Table) -> Verified:
    """Ray task (the verify shuffle's reduce): one pair bucket from every group file, and its
    candidates' descriptors from every fetch task -> its exact pairs and its candidate near pairs at
    cosine >= threshold whose detail descriptors are at cosine >= detail_threshold too (0: not
    compared; a pair also found exact is exact), written as edges; -> counts."""
    t = read_bucket(storage, files, "pair_bucket", bucket, PAIR_SCHEMA)
    pairs = sorted({Pair(*r) for r in zip(*(t.column(f).to_pylist() for f in Pair._fields))})
    exact = [p for p in pairs if p.kind == "exact_duplicate"]
    exact_ab = {(p.a, p.b) for p in exact}
    cand = [p for p in pairs if p.kind == "near_duplicate" and (p.a, p.b) not in exact_ab]
    v = pa.concat_tables(pieces) if cand and pieces else VEC_SCHEMA.empty_table()
    keys = v.column("key").to_pylist()
    vec = {k: _unit(x) for k, x in zip(keys, v.column("vec").to_pylist())}
    alike = [(p, c) for p in cand if (c := float(vec[p.a] @ vec[p.b])) >= threshold]
    if detail_threshold > 0 and alike:
        wanted = {k for p, _ in alike for k in (p.a, p.b)}
        det = {k: _unit(x) for k, x in zip(keys, v.column("detail").to_pylist()) if k in wanted}
        near = [(p, c) for p, c in alike if float(det[p.a] @ det[p.b]) >= detail_threshold]
    else:
        near = alike
    edges = [(p, None) for p in exact] + near
    if edges:
        storage.write_table(f"{EDGE_DIR}/{bucket:06d}.parquet", pa.table(
            {**{f: [getattr(p, f) for p, _ in edges] for f in Pair._fields}, "cosine": [c for _, c in edges]},
            schema=EDGE_SCHEMA))
    return Verified(len(exact), len(cand), len(near), len(edges), len(alike) - len(near))
