"""Dedup's within-data step alone at 10^6 and 10^7 codes: recall on planted near-duplicates and
peak memory per group task.

For each size N: random 256-bit SimHash codes in partitions of `--per-part`, with `--planted` of
the samples (the second half's) replaced by a near copy of a sample in the first half: a cosine
drawn uniformly in [threshold, 1], and as many random bits flipped as SimHash flips for it
(Binomial(256, acos(c) / pi)). The partitions' signature files are written by the stage's own
`signature_table` (the band plan for N: stages/dedup/lsh.py), then every signature bucket goes through
the stage's `_group_task`, each in a fresh process so its peak RSS is its own. Recall = planted
pairs found as near candidates / planted pairs (the verification after it is an exact cosine on
the found pairs: it cannot find what the group step missed).

Real crawls repeat a few images thousands of times (dead-link placeholders, blank images). With
`--repeated 0.01 --copies 10000` each size runs twice, plain and with 1 % of the samples (none of
the planted ones) replaced by copies of placeholders, each repeated `--copies` times (same code,
same pixels): the second run's wall, peak memory per task and recall against the first's (goal:
within 1.5x, recall unchanged).

    python benchmarks/dedup_within.py [--sizes 1000000 10000000] [--workers 2] [--repeated 0.01 --copies 10000]
Results: benchmarks/results/dedup_within.json, and under "dedup_alone" in cluster.json.
"""
from __future__ import annotations

import argparse
import dataclasses
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


def _placeholders(first: int, per_part: int, every: int, repeated: float, copies: int):
    """(local row, placeholder number) of the rows that are a placeholder's copies: the residues 1..k
    of `every` (the planted pairs use residue 0), k = repeated * every, so `repeated` of all rows;
    consecutive such rows share a placeholder, `copies` each."""
    k = round(repeated * every)
    for r in range(per_part):
        idx = first + r
        if 1 <= idx % every <= k:
            yield r, ((idx // every) * k + idx % every - 1) // copies


def write_part(args) -> dict:
    from infra.shuffle import write_ranges
    from infra.storage import Storage
    from stages.dedup.sign import signature_table
    from stages.dedup.lsh import band_plan

    root, n_total, part, per_part, every, n_buckets, repeated, copies = args
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
    pixels = [u.tobytes() for u in uniq[0]]
    for r, holder in _placeholders(first, per_part, every, repeated, copies):
        codes[r] = np.random.default_rng([7, holder]).integers(0, 256, BITS // 8, dtype=np.uint8)
        pixels[r] = holder.to_bytes(16, "little")
    table = signature_table(keys, f"p{part:05d}", codes, np.zeros((per_part, 3), np.float32),
                            pixels, [u.tobytes() for u in uniq[1]],
                            band_plan(n_total, THRESHOLD, BITS))
    write_ranges(Storage.local(root), f"{SIG_DIR}/p{part:05d}.parquet", table, "h32", n_buckets)
    return {"pairs": [(f"s{s:010d}", keys[r], float(c)) for r, s, c in zip(rows, sources, cosines)]}


def group_one(args) -> dict:
    """One group task in this (fresh) process: its seconds, rows and peak RSS."""
    from infra.storage import Storage
    from stages.dedup.config import DedupConfig
    from stages.dedup.group import _group_task

    root, bucket, files, n_buckets = args
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    out = _group_task(Storage.local(root), bucket, DedupConfig(within_threshold=THRESHOLD, bits=BITS), files, n_buckets, 1)
    return {**dataclasses.asdict(out), "seconds": time.perf_counter() - t0, "base_mb": base,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_size(n: int, per_part: int, planted: float, workers: int, bucket_rows: int, work: Path,
             repeated: float = 0.0, copies: int = 10_000) -> dict:
    import pyarrow.parquet as pq

    from stages.dedup.layout import PAIR_DIR
    from stages.dedup.sign import bucket_count, sigs_per_sample
    from stages.dedup.lsh import band_plan

    plan = band_plan(n, THRESHOLD, BITS)
    n_buckets = bucket_count(n, bucket_rows, workers, sigs_per_sample(plan))
    parts = n // per_part
    root = work / f"n{n}-r{repeated}"
    root.mkdir(parents=True)
    every = max(1, round(1 / planted)) // 2 or 1      # `planted` of all samples: 2x that of the second half
    if repeated and not 1 <= round(repeated * every) < every:
        raise SystemExit(f"--repeated {repeated}: with --planted {planted} it must be between {1 / every:g} and "
                         f"{(every - 1) / every:g}")
    print(f"{n:,} codes{f' ({repeated:.0%} copies of placeholders, {copies:,} each)' if repeated else ''}: "
          f"{plan.describe(THRESHOLD)}; {n_buckets} group tasks of ~{bucket_rows:,} rows", flush=True)
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        made = pool.map(write_part, [(str(root), n, p, per_part, every, n_buckets, repeated, copies)
                                     for p in range(parts)])
    write_s = time.perf_counter() - t0
    truth = {(a, b): c for m in made for a, b, c in m["pairs"]}
    files = [f"{SIG_DIR}/p{p:05d}.parquet" for p in range(parts)]
    sig_bytes = sum(f.stat().st_size for f in (root / SIG_DIR).iterdir())
    print(f"  signatures written in {write_s:.0f}s ({sig_bytes / 2**30:.2f} GiB); grouping...", flush=True)
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers, maxtasksperchild=1) as pool:
        tasks = pool.map(group_one, [(str(root), b, files, n_buckets) for b in range(n_buckets)], chunksize=1)
    group_s = time.perf_counter() - t0
    found, pair_rows = set(), 0
    for b in range(n_buckets):
        if not (root / PAIR_DIR / f"{b:06d}.parquet").is_file():
            continue           # a bucket without pairs writes no file
        t = pq.read_table(root / PAIR_DIR / f"{b:06d}.parquet", columns=["a", "b", "kind"])   # a file per group task
        pair_rows += t.num_rows
        found |= {(a, b_) for a, b_, k in zip(*(t.column(c).to_pylist() for c in ("a", "b", "kind")))
                  if k == "near_duplicate"}
    held = {f"s{i:010d}" for i in range(n) if repeated and 1 <= i % every <= round(repeated * every)}
    found_other = {(a, b_) for a, b_ in found if a not in held and b_ not in held}
    hit = np.array([pair in found for pair in truth])
    cos = np.array(list(truth.values()))
    slices = {f"{lo:.2f}-{hi:.2f}": round(float(hit[(cos >= lo) & (cos < hi)].mean()), 4)
              for lo, hi in ((0.97, 0.98), (0.98, 0.99), (0.99, 1.001))}
    peaks = np.array([t["peak_mb"] for t in tasks])
    res = {"codes": n, "partitions": parts, "planted_pairs": len(truth), "band_width": plan.width, "bands": plan.bands,
           "expected_recall_at_threshold": round(plan.recall_at(THRESHOLD), 4),
           "recall": round(float(hit.mean()), 4), "recall_by_cosine": slices,
           "false_candidates": len(found_other - set(truth)), "placeholder_copies": len(held),
           "pairs_written": pair_rows, "group_tasks": n_buckets,
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
    ap.add_argument("--repeated", type=float, default=0.0,
                    help="also run each size with this share of samples copies of placeholders (e.g. 0.01)")
    ap.add_argument("--copies", type=int, default=10_000, help="copies of each placeholder (default 10,000)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dedup-within-", dir=args.work_dir))
    heavy = []
    try:
        runs = []
        for n in args.sizes:
            runs.append(run_size(n, min(args.per_part, n), args.planted, args.workers, args.bucket_rows, work))
            if args.repeated:
                r = run_size(n, min(args.per_part, n), args.planted, args.workers, args.bucket_rows, work,
                             args.repeated, args.copies)
                plain = runs[-1]
                r["against_plain"] = {
                    "wall": round(r["group_s"] / plain["group_s"], 2),
                    "peak_rss_per_task": round(r["peak_rss_mb_per_task"]["max"] / plain["peak_rss_mb_per_task"]["max"], 2),
                    "recall": [plain["recall"], r["recall"]]}
                print(f"  with placeholders, against plain: wall x{r['against_plain']['wall']}, peak per task "
                      f"x{r['against_plain']['peak_rss_per_task']} (goal <= 1.5 each), recall {plain['recall']} -> "
                      f"{r['recall']}", flush=True)
                heavy.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peaks = [r["peak_rss_mb_per_task"]["max"] for r in runs]
    summary = {"threshold": THRESHOLD, "bits": BITS, "runs": runs,
               "peak_ratio_largest_to_smallest": round(peaks[-1] / peaks[0], 2) if peaks else None}
    print(f"peak memory per task, {args.sizes[-1]:,} vs {args.sizes[0]:,} codes: x{summary['peak_ratio_largest_to_smallest']}")
    if heavy:
        summary["with_placeholders"] = {"repeated": args.repeated, "copies": args.copies, "runs": heavy}
        old = RESULTS / "dedup_within.json"     # a placeholders-only rerun keeps the plain sizes it did not run
        if old.is_file():
            kept = {r["codes"]: r for r in json.loads(old.read_text()).get("runs", [])}
            kept.update({r["codes"]: r for r in runs})
            summary["runs"] = [kept[k] for k in sorted(kept)]
    write_results("dedup_within", summary)
    cluster = RESULTS / "cluster.json"         # the cluster benchmark's file carries it too (issue #23)
    data = json.loads(cluster.read_text()) if cluster.is_file() else {"machine": machine()}
    data["dedup_alone"] = {"machine": machine(), **summary}
    cluster.write_text(json.dumps(data, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
