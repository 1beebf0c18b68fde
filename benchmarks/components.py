"""Dedup's components step alone: peak memory and time of the stage's own `_components_task` on
10^6 and 10^7 edges, to project the one task it still is at 10^8 and 10^9 URLs.

Edges as the verify tasks write them (a, part_a, b, part_b, kind, cosine), in 64 edge files:
clusters of 2-5 samples (sizes drawn at random; each a star plus, in one of three, a chain), keys
like the source's (`u` + 16 hex digits), spread over 1,000 partitions; a third of the edges exact,
the rest near with a cosine in [0.97, 1]. Each size runs in a fresh process, so its peak RSS is its
own; the baseline (Python, Ray and pyarrow imported, nothing read) is measured the same way and
subtracted.

    python benchmarks/components.py [--edges 1000000 10000000]
Results: benchmarks/results/components.json
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks._common import write_results  # noqa: E402

FILES, PARTS = 64, 1000


def _write_edges(root: str, n_edges: int) -> list[str]:
    import pyarrow as pa

    from infra.storage import Storage
    from stages.dedup.layout import EDGE_SCHEMA

    rng = np.random.default_rng(n_edges)
    sizes = rng.integers(2, 6, n_edges)                  # a cluster of k samples brings k - 1 edges
    sizes = sizes[: np.searchsorted(np.cumsum(sizes - 1), n_edges) + 1]
    n_nodes = int(sizes.sum())
    ids = rng.permutation(n_nodes)
    keys = np.array([f"u{x:016x}" for x in rng.integers(0, 2**63, n_nodes)], object)
    parts = np.array([f"part-{p:05d}" for p in range(PARTS)], object)
    part_of = parts[rng.integers(0, PARTS, n_nodes)]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    a = np.repeat(starts, sizes - 1)                     # each member to the cluster's first ...
    b = a + np.concatenate([np.arange(1, k) for k in sizes])
    chain = np.repeat(rng.random(len(sizes)) < 1 / 3, sizes - 1) & (b - a > 1)
    a = np.where(chain, b - 1, a)                        # ... or, in a third of clusters, to the one before
    a, b = ids[a][:n_edges], ids[b][:n_edges]
    kind = np.where(rng.random(len(a)) < 1 / 3, "exact_duplicate", "near_duplicate")
    cos = np.where(kind == "near_duplicate", rng.uniform(0.97, 1.0, len(a)), np.nan)
    storage, files = Storage.local(root), []
    for f, idx in enumerate(np.array_split(np.arange(len(a)), FILES)):
        rel = f"edges/{f:04d}.parquet"
        storage.write_table(rel, pa.table({
            "a": keys[a[idx]].tolist(), "part_a": part_of[a[idx]].tolist(), "b": keys[b[idx]].tolist(),
            "part_b": part_of[b[idx]].tolist(), "kind": kind[idx].tolist(),
            "cosine": pa.array(cos[idx], pa.float64(), from_pandas=True)}, schema=EDGE_SCHEMA))
        files.append(rel)
    return files


def _run(args) -> dict:
    root, files, measure = args
    import ray  # noqa: F401 - as a Ray worker has it imported

    from infra.storage import Storage
    from stages.dedup.components import _components_task

    parts = [f"part-{p:05d}" for p in range(PARTS)]
    t0 = time.time()
    duplicates = _components_task(Storage.local(root), files, parts, 12).duplicates if measure else 0
    return {"seconds": round(time.time() - t0, 2), "duplicates": duplicates,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--edges", type=int, nargs="+", default=[1_000_000, 10_000_000])
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="capline-components-") as tmp:
        with ctx.Pool(1, maxtasksperchild=1) as pool:
            base = pool.map(_run, [(tmp, [], False)])[0]["peak_rss_mb"]
        print(f"baseline process: {base} MB")
        for n in args.edges:
            root = f"{tmp}/{n}"
            files = _write_edges(root, n)
            with ctx.Pool(1, maxtasksperchild=1) as pool:
                got = pool.map(_run, [(root, files, True)])[0]
            got["task_mb"] = round(got["peak_rss_mb"] - base, 1)
            got["bytes_per_edge"] = round(got["task_mb"] * 2**20 / n)
            rows[str(n)] = got
            print(f"{n:>12,} edges: {got['duplicates']:,} dropped, {got['seconds']} s, peak {got['peak_rss_mb']} MB "
                  f"({got['task_mb']} MB over the baseline, {got['bytes_per_edge']} bytes per edge)", flush=True)
    per_edge = rows[str(max(args.edges))]["bytes_per_edge"]     # the largest size: fixed costs spread out
    projection = {f"{e:.0e} edges": f"{per_edge * e / 2**30:.1f} GB" for e in (10**7, 10**8)}
    print("projected task memory:", projection)
    write_results("components", {"edges": rows, "baseline_mb": base, "projection": projection,
                                 "note": "10^7 edges ~ 10^8 URLs with 10 % duplicates; 10^8 edges ~ 10^9 URLs"})


if __name__ == "__main__":
    main()
