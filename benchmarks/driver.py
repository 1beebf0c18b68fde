"""The driver's own work at 10^5 partitions, with synthetic records (no images, no Ray): what it costs
to plan a stage, find the earlier run's records (reuse), check in = kept + dropped, sum the score
histograms and write the stage's summaries, per partition, at 10^3, 10^4 and 10^5 partitions.

    python benchmarks/driver.py [--sizes 1000,10000,100000] [--s3]

Each size: N PartResults like a real stage's (counts, key-set checksums, a sparse score histogram);
an earlier run's summary table holding 99 % of them (a 1 % append); then `records.find` over all N,
`check_parts` against an upstream of N, `sum_histograms`, `write_summary` and parts.json. Seconds
and the process's peak RSS growth are printed per step and per partition; the goal is flat per
partition. With --s3 the summaries live on moto behind the counting proxy (25 ms a request), and the
requests each step sent are counted too. Results to benchmarks/results/driver.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks._common import write_results  # noqa: E402


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _parts(n: int, stage: str, seed: int):
    from stages.dataplane import PartResult

    rng = random.Random(seed)
    out = []
    for i in range(n):
        kept = rng.randint(900, 1000)
        hist = {"kept": {str(rng.randint(55, 80)): kept}, "dropped": {str(rng.randint(40, 60)): 1000 - kept}}
        s_in, s_kept = rng.getrandbits(64), rng.getrandbits(64)
        out.append(PartResult(part=f"p{i:07d}", file=f"{stage}/reuse/{i:024x}.parquet", input=f"p{i:07d}",
                              sha256=f"{rng.getrandbits(256):064x}", bytes=40_000, n_in=1000, in_sum=str(s_in),
                              kept=kept, kept_sum=str(s_kept), dropped={"x": 1000 - kept} if kept < 1000 else {},
                              dropped_sum=str((s_in - s_kept) % 2**64), extra={"score_hist": hist}))
    return out


def measure(storage, n: int, counter) -> dict:
    from stages import records
    from stages.dataplane import check_parts, sum_histograms

    steps = {}

    def step(name, fn):
        before_req = counter()
        t0, m0 = time.perf_counter(), _peak_mb()
        got = fn()
        steps[name] = {"seconds": round(time.perf_counter() - t0, 3),
                       "us_per_partition": round(1e6 * (time.perf_counter() - t0) / n, 1),
                       "peak_rss_growth_mb": round(_peak_mb() - m0, 1), "requests": counter() - before_req}
        return got

    upstream = _parts(n, "basic", 1)
    # the stage's own results: in = upstream's kept, as a real stage's are
    parts = [p.__class__(**{**p.__dict__, "n_in": u.kept, "in_sum": u.kept_sum, "input": u.part,
                            "kept": u.kept, "kept_sum": u.kept_sum, "dropped": {}, "dropped_sum": "0"})
             for p, u in zip(_parts(n, "language", 2), upstream)]
    folder = f"s{n}/language/reuse"
    earlier = {f"{folder}/{p.file.rsplit('/', 1)[1][:-8]}.json": p.to_json() for p in parts[: int(n * 0.99)]}
    records.write_summary(storage, folder, earlier)           # the last run's summary: 99 % of today's
    wanted = step("plan", lambda: {p.part: f"{folder}/{p.file.rsplit('/', 1)[1][:-8]}.json" for p in parts})
    found = step("reuse (records.find)", lambda: records.find(storage, wanted))
    step("check in = kept + dropped", lambda: check_parts("language", parts, upstream))
    step("sum score histograms", lambda: sum_histograms(parts))
    step("write the summary", lambda: records.write_summary(storage, folder, {wanted[p.part]: p.to_json() for p in parts}))
    step("write parts.json", lambda: storage.write_json(f"s{n}/language/parts.json", [p.to_json() for p in parts]))
    return {"partitions": n, "found_by_summary": len(found), "steps": steps,
            "seconds": round(sum(s["seconds"] for s in steps.values()), 3),
            "us_per_partition": round(1e6 * sum(s["seconds"] for s in steps.values()) / n, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--s3", action="store_true", help="summaries on moto behind a 25 ms proxy")
    args = p.parse_args()
    from infra.storage import Storage

    sizes = [int(s) for s in args.sizes.split(",")]
    with contextlib.ExitStack() as stack:
        if args.s3:
            from helpers import s3_behind_proxy

            env, _, proxy = stack.enter_context(s3_behind_proxy("capline-driver", 0.025))
            os.environ.update(env)
            storage = Storage.from_uri("s3://capline-driver/bench")
            counter = lambda: len(proxy.entries)   # noqa: E731
        else:
            storage = Storage.local(tempfile.mkdtemp(prefix="capline-driver-bench-"))
            counter = lambda: 0   # noqa: E731
        results = []
        for n in sizes:
            r = measure(storage, n, counter)
            results.append(r)
            print(f"{n:>7} partitions: {r['seconds']:.2f} s, {r['us_per_partition']} us per partition; "
                  + "; ".join(f"{k} {v['us_per_partition']} us/part {v['requests']} req {v['peak_rss_growth_mb']} MB"
                              for k, v in r["steps"].items()))
    path = Path(__file__).resolve().parent / "results" / "driver.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.pop("machine", None)
    data["s3" if args.s3 else "local"] = {"sizes": results, "peak_rss_mb": round(_peak_mb(), 1)}
    write_results("driver", data)


if __name__ == "__main__":
    main()
