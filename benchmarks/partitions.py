"""capline at real partition counts: thousands of tiny partitions through every stage, the run folder on
S3 (moto's real server) behind a loopback proxy that adds latency to every request and answers write
bursts above a set rate with 503 SlowDown, as S3 does per prefix. A dataset line, fresh, then with 1 %
more URLs in a new list file.

    python benchmarks/partitions.py [--partitions 2000] [--per-shard 4] [--cpus 16] [--latency-ms 25]
                                    [--write-limit 80] [--append 0.01] [--label NAME]

Each ingest shard holds `--per-shard` URLs and is its own partition (compact_rows = per-shard: nothing
joined), so every stage after ingest runs `--partitions` partitions. Printed and written to
benchmarks/results/partitions.json (merged by label):
- requests per object written (every PUT/POST, the refused ones too, over the distinct keys written)
  and per object read (GET/HEAD of objects over the distinct keys read); listings and batched
  deletes apart; SlowDowns answered; whether the run finished with every URL accounted for;
- per stage: wall seconds, the seconds the driver spent outside tasks (wall less the task groups'),
  and the append's share of the fresh run's;
- the report's seconds (the run logs them), and the whole command's append share;
- whether the first run's shards are byte-identical after the append.

This is one machine with 2 real cores behind a Ray that declares `--cpus`: the figures say how the
work is shaped (requests, objects, what the driver does), not how fast a real cluster is.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks._common import RESULTS, merge_run  # noqa: E402
from benchmarks.cluster import STAGES  # noqa: E402

BUCKET = "capline-parts"
PREFIX = "line"


def _list(path: Path, rows: list[dict], base: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.source.synthetic import SERVER_PLACEHOLDER

    pq.write_table(pa.table({"url": [r["url"].replace(SERVER_PLACEHOLDER, base) for r in rows],
                             "caption": [r["caption"] for r in rows],
                             "similarity": [0.25 + (int(hashlib.sha256(r["url"].encode()).hexdigest()[:4], 16) % 100) / 1000
                                            for r in rows]}), path)


def _traffic(entries: list, refused: int, bucket: str) -> dict:
    """Requests by kind from the proxy's log: object writes and reads per distinct object."""
    objects = [e for e in entries if e[2].strip("/") != bucket]          # /bucket/key..., not /bucket
    writes = [e for e in objects if e[1] in ("PUT", "POST")]
    reads = [e for e in objects if e[1] in ("GET", "HEAD")]
    bucket_level = Counter(e[1] for e in entries if e[2].strip("/") == bucket)
    written, read = len({e[2] for e in writes}), len({e[2] for e in reads})
    heads = sum(1 for e in reads if e[1] == "HEAD")
    # a read is one GET (of a whole object or a byte range); what a read costs beyond it is HEADs.
    # An object read by several stages (an ingest tar: dedup, clip_score, shard) is read each time:
    # reads per object by folder say where
    by_folder: dict[str, list] = {}
    for e in reads:
        if e[1] == "GET":
            folder = e[2].split("/")[3] if e[2].count("/") > 3 else "(top)"
            by_folder.setdefault(folder, []).append(e[2])
    return {"requests": len(entries) + refused, "object_writes": len(writes), "objects_written": written,
            "requests_per_object_written": round((len(writes) + refused) / written, 3) if written else None,
            "object_reads": len(reads), "objects_read": read, "head_requests": heads,
            "requests_per_object_read": round(len(reads) / read, 3) if read else None,
            "requests_per_read": round(len(reads) / (len(reads) - heads), 3) if len(reads) > heads else None,
            "reads_per_object_by_folder": {f: [len(g), round(len(g) / len(set(g)), 2)] for f, g in sorted(by_folder.items())},
            "listings": bucket_level.get("GET", 0), "batched_deletes": bucket_level.get("POST", 0),
            "slowdowns_answered": refused}


def _shuffle_traffic(entries: list, samples: dict[str, int]) -> dict:
    """Requests on a stage's shuffle intermediates (`<stage>/_work/` in the run folder) per sample
    the stage took in (goal <= 0.01): what still goes through the bucket rather than Ray's object store."""
    out = {}
    for stage in ("dedup", "shard"):
        n = sum(1 for e in entries if f"/{PREFIX}/{stage}/_work/" in e[2])
        out[stage] = {"requests": n, "per_sample": round(n / samples[stage], 4) if samples.get(stage) else None}
    return out


def _objects(client) -> dict:
    """The run folder's objects after a run, by top folder: what the bucket holds."""
    from helpers import bucket_keys

    keys = bucket_keys(client, BUCKET, f"{PREFIX}/")
    by = Counter(k[len(PREFIX) + 1:].split("/", 1)[0] for k in keys)
    return {"total": len(keys), "by_folder": dict(by.most_common())}


def _stage_stats(client) -> dict[str, dict]:
    """Each finished stage's stats.json from the bucket."""
    out = {}
    for stage in STAGES:
        try:
            out[stage] = json.loads(client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{stage}/stats.json")["Body"].read())
        except client.exceptions.NoSuchKey:
            continue
    return out


def _shard_digests(client) -> dict[str, str]:
    from helpers import bucket_keys

    keys = [k for k in bucket_keys(client, BUCKET, f"{PREFIX}/shard/shards/") if k.endswith(".tar")]
    return {k.rsplit("/", 1)[1]: hashlib.sha256(client.get_object(Bucket=BUCKET, Key=k)["Body"].read()).hexdigest()
            for k in keys}


def _cpu_probe() -> float:
    """Seconds of a fixed one-CPU workload (the best of three): this machine's speed drifts between
    runs by up to ~1.6x (pure-compute tasks of the same code), so each phase is stamped with it, and a
    share across phases that ran at different speeds can be told from one that did not."""
    import hashlib

    block = bytes(range(256)) * (1 << 16)        # 16 MiB
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(24):
            hashlib.sha256(block).digest()
        sum(i * i for i in range(3_000_000))
        best = min(best, time.perf_counter() - t0)
    return round(best, 3)


def run(args) -> dict:
    from helpers import s3_behind_proxy, synthetic_rows
    from stages.source.demo_server import DemoServer
    from stages.source.synthetic import SERVER_PLACEHOLDER

    tmp = Path(tempfile.mkdtemp(prefix="capline-partitions-bench-"))
    n_fresh = args.partitions * args.per_shard
    n_more = max(1, round(n_fresh * args.append))
    t0 = time.time()
    rows = synthetic_rows(tmp / "site", n_fresh + n_more, 7)
    print(f"generated {len(rows)} images in {time.time() - t0:.0f} s")
    stack = contextlib.ExitStack()
    env_s3, client, proxy = stack.enter_context(s3_behind_proxy(BUCKET, args.latency_ms / 1000, write_limit=args.write_limit))
    urls = tmp / "urls"
    urls.mkdir()
    env = {**os.environ, **env_s3, "CAPLINE_CACHE": str(tmp / "cache"),
           "PYTHONPATH": str(ROOT), "CAPLINE_PROGRESS": "0", "CAPLINE_NETGUARD": "1"}
    out: dict = {"label": args.label, "partitions": args.partitions, "urls_per_shard": args.per_shard,
                 "cpus_declared": args.cpus, "latency_ms": args.latency_ms, "write_limit_per_s": args.write_limit,
                 "urls": {"fresh": n_fresh, "append": n_more}}
    try:
        with DemoServer(tmp / "site" / "www") as server:
            config = {"name": "partitions", "seed": 0,
                      "source": {"kind": "urls", "path": str(urls), "url_col": "url", "caption_col": "caption"},
                      "ray": {"num_cpus": args.cpus, "object_store_memory_mb": 512}, "track_data": False,
                      "train": {"steps": 0},
                      "stages": {"ingest": {"allow_hosts": [server.netloc], "samples_per_shard": args.per_shard,
                                            "compact_rows": args.per_shard, "timeout": 5},
                                 "dedup": {"eval_sets": []}, "basic": {"min_image_side": 16},
                                 "language": {"min_confidence": 0.1},
                                 "clip_score": {"scorer": "column", "column": "similarity", "threshold": 0.26,
                                                "keep_fraction": None},
                                 "tokenizer": {"vocab_size": 400, "reuse": True},
                                 "shard": {"samples_per_shard": 1000, "append": True}}}
            (tmp / "partitions.yaml").write_text(json.dumps(config))
            cmd = [sys.executable, "-m", "pipeline.cli", "run", str(tmp / "partitions.yaml"), "--run-dir",
                   f"s3://{BUCKET}/{PREFIX}", "--until", "shard"]
            runs = {}
            for name, part in (("fresh", rows[:n_fresh]), ("append", rows[n_fresh:])):
                _list(urls / f"{name}.parquet", part, server.base_url)
                first = len(proxy.entries)
                refused0 = proxy.slowdowns
                probe_before = _cpu_probe()
                t0 = time.time()
                run_cmd = cmd
                if args.profile and name == "append":   # where the driver's own time goes, by function
                    run_cmd = [cmd[0], "-m", "cProfile", "-o", str(RESULTS / f"partitions-{args.label}-append.prof"), *cmd[1:]]
                proc = subprocess.run(run_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
                wall = time.time() - t0
                log = proc.stdout + proc.stderr
                (RESULTS / f"partitions-{args.label}-{name}.log").write_text(log)
                if proc.returncode != 0:
                    print(log[-4000:])
                    raise SystemExit(f"capline run ({name}) failed ({proc.returncode}); log in benchmarks/results/")
                stages = {}
                for stage, stats in _stage_stats(client).items():
                    in_tasks = sum(r.get("seconds", 0) for r in stats.get("tasks", []))
                    stages[stage] = {"wall_seconds": stats["wall_seconds"], "partitions": stats.get("partitions"),
                                     "in": stats.get("in"), "kept": stats.get("kept"),
                                     "driver_seconds_outside_tasks": round(max(0.0, stats["wall_seconds"] - in_tasks), 2),
                                     "task_groups": [{k: g.get(k) for k in ("what", "tasks", "at_once", "seconds", "first_start_s", "task_s_median", "task_s_max") if k in g}
                                                     for g in stats.get("tasks", [])]}
                report = re.search(r"report: \S+ \((\d+(?:\.\d+)?) s\)", log)
                runs[name] = {"wall_seconds": round(wall, 1), "stages": stages,
                              "cpu_probe_s": {"before": probe_before, "after": _cpu_probe()},
                              "report_seconds": float(report.group(1)) if report else None,
                              "traffic": _traffic(proxy.entries[first:], proxy.slowdowns - refused0, BUCKET),
                              "listed_urls": sum(1 for _ in rows[:n_fresh + (n_more if name == "append" else 0)])}
                runs[name]["shuffle_requests"] = _shuffle_traffic(
                    proxy.entries[first:], {st: (stages.get(st) or {}).get("in") or 0 for st in ("dedup", "shard")})
                runs[name]["bucket_objects"] = _objects(client)
                if args.requests:     # every request of the run, for reading where the reads go
                    Path(f"{args.requests}-{name}.tsv").write_text(
                        "".join(f"{e[1]}\t{e[2]}\t{e[3]}\n" for e in proxy.entries[first:]))
                src = stages.get("source", {})
                runs[name]["every_url_accounted_for"] = src.get("in") == runs[name]["listed_urls"]
                if name == "fresh":
                    shards_before = _shard_digests(client)
            shards_after = _shard_digests(client)
            if args.remove:     # a takedown of a few URLs from the grown line: what it costs
                listed = tmp / "takedown.txt"
                picked = rows[: n_fresh: max(1, n_fresh // args.remove)][: args.remove]
                listed.write_text("".join(f"url {r['url'].replace(SERVER_PLACEHOLDER, server.base_url)}\n" for r in picked))
                first = len(proxy.entries)
                t0 = time.time()
                proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "remove", f"s3://{BUCKET}/{PREFIX}", "--list",
                                       str(listed), "--reason", "benchmark takedown"], cwd=ROOT, env=env,
                                      capture_output=True, text=True, timeout=args.timeout)
                log = proc.stdout + proc.stderr
                (RESULTS / f"partitions-{args.label}-remove.log").write_text(log)
                if proc.returncode != 0:
                    print(log[-4000:])
                    raise SystemExit(f"capline remove failed ({proc.returncode}); log in benchmarks/results/")
                after_removal = _shard_digests(client)
                out["removal"] = {"urls": len(picked), "wall_seconds": round(time.time() - t0, 1),
                                  "traffic": _traffic(proxy.entries[first:], 0, BUCKET),
                                  "shards_rewritten": sum(1 for k in shards_after if after_removal.get(k) != shards_after[k]),
                                  "shards": len(shards_after), "said": log.strip().splitlines()[-1 - min(len(picked), 50)][:300]}
    finally:
        stack.close()
    fresh, append = runs["fresh"], runs["append"]
    share = {s: round(append["stages"][s]["wall_seconds"] / fresh["stages"][s]["wall_seconds"], 3)
             for s in STAGES if s in fresh["stages"] and s in append["stages"] and fresh["stages"][s]["wall_seconds"]}
    out.update(runs=runs, append_share={"stages": share, "command": round(append["wall_seconds"] / fresh["wall_seconds"], 3)},
               first_shards_byte_identical={k: shards_after.get(k) for k in shards_before} == shards_before,
               shards={"fresh": len(shards_before), "after_append": len(shards_after)})
    return out


def table(r: dict) -> str:
    lines = [f"{r['label']}: {r['partitions']} partitions of {r['urls_per_shard']} URLs, {r['cpus_declared']} logical "
             f"CPUs, S3 behind {r['latency_ms']} ms and {r['write_limit_per_s']} writes/s"]
    for name, run in r["runs"].items():
        t = run["traffic"]
        lines.append(f"  {name}: {run['wall_seconds']} s; {t['requests_per_object_written']} requests per object written "
                     f"(goal <= 1.5), {t['requests_per_object_read']} per object read (goal <= 2), "
                     f"{t.get('requests_per_read')} per read ({t.get('head_requests')} HEADs); "
                     f"{t['slowdowns_answered']} SlowDowns answered; every URL accounted for: {run['every_url_accounted_for']}; "
                     f"report {run['report_seconds']} s"
                     + (f"; machine speed probe {run['cpu_probe_s']['before']} s before, {run['cpu_probe_s']['after']} s "
                        "after (a fixed one-CPU workload)" if run.get("cpu_probe_s") else ""))
        if t.get("reads_per_object_by_folder"):
            lines.append("    reads (GETs, per distinct object) by folder: " + ", ".join(
                f"{f} {n} ({per})" for f, (n, per) in t["reads_per_object_by_folder"].items()))
        if run.get("shuffle_requests"):
            sh = run["shuffle_requests"]
            lines.append(f"    shuffle requests per sample (goal <= 0.01): dedup {sh['dedup']['per_sample']} "
                         f"({sh['dedup']['requests']}), shard {sh['shard']['per_sample']} ({sh['shard']['requests']}); "
                         f"objects in the run folder after it: {run['bucket_objects']['total']}")
    lines.append(f"  {'stage':<11}{'fresh s':>9}{'driver s':>9}{'append s':>9}{'driver s':>9}{'share':>7}  (goal <= 0.05)")
    for s, share in r["append_share"]["stages"].items():
        f, a = r["runs"]["fresh"]["stages"][s], r["runs"]["append"]["stages"][s]
        lines.append(f"  {s:<11}{f['wall_seconds']:>9.1f}{f['driver_seconds_outside_tasks']:>9.1f}"
                     f"{a['wall_seconds']:>9.1f}{a['driver_seconds_outside_tasks']:>9.1f}{share:>7.3f}")
    if r.get("removal"):
        m = r["removal"]
        lines.append(f"  remove {m['urls']} URLs: {m['wall_seconds']} s, {m['traffic']['requests']} requests "
                     f"({m['traffic']['object_reads']} reads, {m['traffic']['object_writes']} writes, "
                     f"{m['traffic']['listings']} listings); {m['shards_rewritten']} of {m['shards']} shards rewritten")
    lines.append(f"  whole command: append {r['append_share']['command']} of the fresh run; first run's shards "
                 f"byte-identical: {r['first_shards_byte_identical']} ({r['shards']})")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--partitions", type=int, default=2000)
    p.add_argument("--per-shard", type=int, default=4, help="URLs per ingest shard (each its own partition)")
    p.add_argument("--cpus", type=int, default=16)
    p.add_argument("--latency-ms", type=float, default=25)
    p.add_argument("--write-limit", type=float, default=80, help="writes per second before 503 SlowDown")
    p.add_argument("--append", type=float, default=0.01, help="the second run's extra URLs, as a share of the first's")
    p.add_argument("--timeout", type=float, default=4 * 3600)
    p.add_argument("--label", default="current")
    p.add_argument("--remove", type=int, default=10, help="URLs a takedown then removes from the line (0: none)")
    p.add_argument("--requests", metavar="PREFIX",
                   help="write each run's requests (method, path, status) to PREFIX-fresh.tsv and PREFIX-append.tsv")
    p.add_argument("--profile", action="store_true",
                   help="run the append's driver under cProfile (benchmarks/results/partitions-LABEL-append.prof)")
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = run(args)
    print(table(result))
    merge_run("partitions", args.label, result)


if __name__ == "__main__":
    main()
