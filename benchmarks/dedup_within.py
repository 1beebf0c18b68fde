"""Dedup's within-data step alone at 10^6 and 10^7 codes: recall on planted near-duplicates and
peak memory per group task.

For each size N: random 256-bit SimHash codes in partitions of `--per-part`, with `--planted` of
the samples (the second half's) replaced by a near copy of a sample in the first half: a cosine
drawn uniformly in [threshold, 1], and as many random bits flipped as SimHash flips for it
(Binomial(256, acos(c) / pi)). The partitions' signature files are written by the stage's own
`signature_table` (the band plan for N: stages/lsh.py), then every signature bucket goes through
the stage's `_group_task`, each in a fresh process so its peak RSS is its own. Recall = planted
pairs found as near candidates / planted pairs (the verification after it is an exact cosine on
the found pairs: it cannot find what the group step missed).

    python benchmarks/dedup_within.py [--sizes 1000000 10000000] [--workers 2]
Results: benchmarks/results/dedup_within.json, and under "dedup_alone" in cluster.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks._common import RESULTS, machine, write_results  # noqa: E402

BITS, THRESHOLD = 256, 0.97
SIG_DIR = "sig"


def _codes(n_total: int, part: int, per_part: int) -> np.ndarray:
    return np.random.default_rng([n_total, part]).integers(0, 256, (per_part, BITS // 8), dtype=np.uint8)


def _planted(n_total: int, part: int, per_part: int, every: int):
    """The samples of `part` (second half only) that are near copies: local rows, the first-half
    sample each copies, and the cosine drawn for it."""
    half = n_total // 2
    first = part * per_part
    rows = [r for r in range(per_part) if first + r >= half and (first + r - half) % every == 0]
    rng = np.random.default_rng([n_total, part, 1])
    return rows, [first + r - half for r in rows], rng.uniform(THRESHOLD, 1.0, len(rows))


def write_part(args) -> dict:
    from infra.shuffle import write_ranges
    from infra.storage import Storage
    from stages.dedup import signature_table
    from stages.lsh import band_plan

    root, n_total, part, per_part, every, n_buckets = args
    codes = _codes(n_total, part, per_part)
    rows, sources, cosines = _planted(n_total, part, per_part, every)
    rng = np.random.default_rng([n_total, part, 2])
    for r, src, c in zip(rows, sources, cosines):
        bits = np.unpackbits(_codes(n_total, src // per_part, per_part)[src % per_part])
        bits[rng.choice(BITS, rng.binomial(BITS, np.arccos(c) / np.pi), replace=False)] ^= 1
        codes[r] = np.packbits(bits)
    first = part * per_part
    keys = [f"s{first + r:010d}" for r in range(per_part)]
    uniq = rng.integers(0, 256, (2, per_part, 16), dtype=np.uint8)     # no exact duplicates planted
    table = signature_table(keys, f"p{part:05d}", codes, np.zeros((per_part, 3), np.float32),
                            [u.tobytes() for u in uniq[0]], [u.tobytes() for u in uniq[1]],
                            band_plan(n_total, THRESHOLD, BITS))
    write_ranges(Storage.local(root), f"{SIG_DIR}/p{part:05d}.parquet", table, "h32", n_buckets)
    return {"pairs": [(f"s{s:010d}", keys[r], float(c)) for r, s, c in zip(rows, sources, cosines)]}


def group_one(args) -> dict:
    """One group task in this (fresh) process: its seconds, rows and peak RSS."""
    from infra.storage import Storage
    from stages.dedup import DedupConfig, _group_task

    root, bucket, files, n_buckets = args
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    out = _group_task(Storage.local(root), bucket, DedupConfig(within_threshold=THRESHOLD, bits=BITS), files, n_buckets, 1)
    return {**out, "seconds": time.perf_counter() - t0, "base_mb": base,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_size(n: int, per_part: int, planted: float, workers: int, bucket_rows: int, work: Path) -> dict:
    import pyarrow.parquet as pq

    from stages.dedup import PAIR_DIR, bucket_count, sigs_per_sample
    from stages.lsh import band_plan

    plan = band_plan(n, THRESHOLD, BITS)
    n_buckets = bucket_count(n, bucket_rows, workers, sigs_per_sample(plan))
    parts = n // per_part
    root = work / f"n{n}"
    root.mkdir(parents=True)
    every = max(1, round(1 / planted)) // 2 or 1      # `planted` of all samples: 2x that of the second half
    print(f"{n:,} codes: {plan.describe(THRESHOLD)}; {n_buckets} group tasks of ~{bucket_rows:,} rows", flush=True)
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        made = pool.map(write_part, [(str(root), n, p, per_part, every, n_buckets) for p in range(parts)])
    write_s = time.perf_counter() - t0
    truth = {(a, b): c for m in made for a, b, c in m["pairs"]}
    files = [f"{SIG_DIR}/p{p:05d}.parquet" for p in range(parts)]
    sig_bytes = sum(f.stat().st_size for f in (root / SIG_DIR).iterdir())
    print(f"  signatures written in {write_s:.0f}s ({sig_bytes / 2**30:.2f} GiB); grouping...", flush=True)
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers, maxtasksperchild=1) as pool:
        tasks = pool.map(group_one, [(str(root), b, files, n_buckets) for b in range(n_buckets)], chunksize=1)
    group_s = time.perf_counter() - t0
    found = set()
    for b in range(n_buckets):
        t = pq.read_table(root / PAIR_DIR / f"{b:06d}.parquet", columns=["a", "b", "kind"])   # a file per group task
        found |= {(a, b_) for a, b_, k in zip(*(t.column(c).to_pylist() for c in ("a", "b", "kind")))
                  if k == "near_duplicate"}
    hit = np.array([pair in found for pair in truth])
    cos = np.array(list(truth.values()))
    slices = {f"{lo:.2f}-{hi:.2f}": round(float(hit[(cos >= lo) & (cos < hi)].mean()), 4)
              for lo, hi in ((0.97, 0.98), (0.98, 0.99), (0.99, 1.001))}
    peaks = np.array([t["peak_mb"] for t in tasks])
    res = {"codes": n, "partitions": parts, "planted_pairs": len(truth), "band_width": plan.width, "bands": plan.bands,
           "expected_recall_at_threshold": round(plan.recall_at(THRESHOLD), 4),
           "recall": round(float(hit.mean()), 4), "recall_by_cosine": slices,
           "false_candidates": len(found - set(truth)), "group_tasks": n_buckets,
           "rows_per_task_max": max(t["rows"] for t in tasks), "largest_band_group": max(t["largest_group"] for t in tasks),
           "peak_rss_mb_per_task": {"max": round(float(peaks.max())), "median": round(float(np.median(peaks)))},
           "process_base_rss_mb": round(float(np.median([t["base_mb"] for t in tasks]))),
           "signature_gib": round(sig_bytes / 2**30, 2), "write_s": round(write_s, 1), "group_s": round(group_s, 1),
           "group_task_s_sum": round(sum(t["seconds"] for t in tasks), 1), "workers": workers}
    print(f"  recall {res['recall']} ({slices}), {res['false_candidates']} other candidates; peak per task "
          f"{res['peak_rss_mb_per_task']} MB (process alone {res['process_base_rss_mb']} MB); "
          f"grouped in {group_s:.0f}s", flush=True)
    shutil.rmtree(root)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10**6, 10**7])
    ap.add_argument("--per-part", type=int, default=100_000, help="codes per partition (default 100,000)")
    ap.add_argument("--planted", type=float, default=0.005, help="share of samples that are near copies")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--bucket-rows", type=int, default=1_000_000, help="as stages.dedup.bucket_rows")
    ap.add_argument("--work-dir", default=None, help="where the signature files go (default: a temp dir)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dedup-within-", dir=args.work_dir))
    try:
        runs = [run_size(n, min(args.per_part, n), args.planted, args.workers, args.bucket_rows, work) for n in args.sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peaks = [r["peak_rss_mb_per_task"]["max"] for r in runs]
    summary = {"threshold": THRESHOLD, "bits": BITS, "runs": runs,
               "peak_ratio_largest_to_smallest": round(peaks[-1] / peaks[0], 2) if peaks else None}
    print(f"peak memory per task, {args.sizes[-1]:,} vs {args.sizes[0]:,} codes: x{summary['peak_ratio_largest_to_smallest']}")
    write_results("dedup_within", summary)
    cluster = RESULTS / "cluster.json"         # the cluster benchmark's file carries it too (issue #23)
    data = json.loads(cluster.read_text()) if cluster.is_file() else {"machine": machine()}
    data["dedup_alone"] = {"machine": machine(), **summary}
    cluster.write_text(json.dumps(data, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
