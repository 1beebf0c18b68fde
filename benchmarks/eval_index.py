"""Dedup's evaluation index at a real evaluation set's size, in the describe tasks that search it.

An evaluation image is described at 28 crops, each a 768-d float32 descriptor and a 256-bit code
(stages/dedup/imagehash.py): 86 KB an image, 4.3 GB for a 50,000-image set (ImageNet-val's size). The
dedup stage puts the index in Ray's object store once (`ray.put` in stages/dedup/stage.py) and every
describe task of a node reads it there without a copy; only the Hamming index over the codes
(faiss, 32 bytes a reference) is each worker process's own. Version three decoded the whole index
into every describe process.

Here: synthetic references of that shape (random unit descriptors, their SimHash codes), `--tasks`
describe-like tasks, each in its own worker process, loading the index through the stage's own
`_indexes` and searching `--queries` near copies of references. Printed and written to
benchmarks/results/eval_index.json: the index's bytes, each task's private memory (USS) and
resident memory (RSS) after its search, the seconds to build its Hamming index (past a million
references an inverted file, trained once by the driver and read back by each task) and to search,
and how many queries found their reference.

    python benchmarks/eval_index.py [--images 50000] [--tasks 4] [--queries 2000]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra import offline  # noqa: E402

offline.apply()

import numpy as np  # noqa: E402

from benchmarks._common import write_results  # noqa: E402

CROPS, DIM, BITS = 28, 768, 256


class _Here:
    """The storage `_indexes` keys its per-process cache on (it only asks for a name here)."""

    def uri(self) -> str:
        return "bench://eval-index"


def _task(blobs, names, queries, means, truth):
    import psutil

    from stages.dedup.describe import _indexes

    t0 = time.time()
    indexes, _, _ = _indexes(_Here(), blobs, names, None)
    built = time.time() - t0
    index = next(iter(indexes.values()))
    t1 = time.time()
    best, _ = index.search(queries, means)
    searched = time.time() - t1
    mem = psutil.Process().memory_full_info()
    return {"uss_mb": round(mem.uss / 2**20), "rss_mb": round(mem.rss / 2**20), "build_s": round(built, 1),
            "search_s": round(searched, 2), "found": int((best == truth).sum()), "pid": psutil.Process().pid}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=50_000)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--queries", type=int, default=2000)
    args = ap.parse_args()

    import psutil
    import ray

    from infra.ray_runtime import RayConfig, ray_session
    from stages.dedup.imagehash import simhash
    from stages.dedup.neardup import NearDupIndex

    n = args.images * CROPS
    rng = np.random.default_rng(0)
    t0 = time.time()
    vecs = rng.standard_normal((n, DIM), dtype=np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    codes = np.concatenate([simhash(vecs[a:a + 200_000], BITS) for a in range(0, n, 200_000)])
    means = rng.uniform(0, 255, (n, 3)).astype(np.float32)
    ids = np.array([f"eval/{i // CROPS:06d}#{i % CROPS}" for i in range(n)])
    made = time.time() - t0
    # as the stage does: the driver loads the set's index (training its inverted file once, or
    # reading it trained from the set's cache) and ships its arrays
    t0 = time.time()
    arrays = NearDupIndex(BITS).build(ids, vecs, means, codes).arrays()
    trained = time.time() - t0
    ivf = "trained" in arrays
    size = sum(a.nbytes for a in arrays.values())
    print(f"{args.images} evaluation images x {CROPS} crops: {size / 2**30:.2f} GiB of index "
          f"({size / args.images / 1024:.0f} KB an image), made in {made:.0f}s; the driver's index "
          f"{'trained' if ivf else 'built'} in {trained:.0f}s", flush=True)
    pick = rng.choice(n, args.queries, replace=False)
    noisy = vecs[pick] + 0.01 * rng.standard_normal((args.queries, DIM), dtype=np.float32)
    queries = (noisy / np.linalg.norm(noisy, axis=1, keepdims=True)).astype(np.float32)
    qmeans = means[pick]
    store_mb = int(size / 2**20 * 1.3) + 512
    with ray_session(RayConfig(num_cpus=args.tasks, object_store_memory_mb=store_mb), log=lambda m: None):
        t1 = time.time()
        blobs = ray.put({"hash": {"bench": arrays}, "encoder": {}})
        put_s = time.time() - t1
        del arrays, vecs, codes, means, ids
        driver_rss = psutil.Process().memory_info().rss / 2**20
        task = ray.remote(num_cpus=1)(_task)
        t2 = time.time()
        runs = ray.get([task.remote(blobs, ("bench",), queries, qmeans, pick) for _ in range(args.tasks)])
        wall = time.time() - t2
    pids = len({r["pid"] for r in runs})
    for r in runs:
        print(f"task (pid {r['pid']}): USS {r['uss_mb']} MB, RSS {r['rss_mb']} MB, Hamming index built in "
              f"{r['build_s']}s, {args.queries} queries in {r['search_s']}s, {r['found']} found their reference")
    uss = max(r["uss_mb"] for r in runs)
    print(f"{args.tasks} tasks in {pids} processes, {wall:.0f}s: private memory per task at most {uss} MB "
          f"against {size / 2**20:.0f} MB each when every process decoded its own copy (version three); "
          f"the object store holds one copy ({put_s:.0f}s to put it)")
    write_results("eval_index", {"images": args.images, "crops": CROPS, "index_mib": round(size / 2**20),
                                 "driver_index_s": round(trained, 1), "inverted_file": ivf,
                                 "tasks": args.tasks, "processes": pids, "queries": args.queries, "put_s": round(put_s, 1),
                                 "wall_s": round(wall, 1), "driver_rss_mb_after_put": round(driver_rss),
                                 "tasks_detail": runs, "max_task_uss_mb": uss,
                                 "max_task_rss_mb": max(r["rss_mb"] for r in runs),
                                 "per_process_copy_mb_version_three": round(size / 2**20)})


if __name__ == "__main__":
    main()
