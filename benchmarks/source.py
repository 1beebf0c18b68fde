"""The source stage at a size where its own work shows: a URL list of `--files` files of `--rows` rows
(10^6 URLs by default), keyed fresh, then with 1 % more in a new file, the run folder on S3 (moto's
real server behind a loopback proxy adding latency and answering write bursts with 503 SlowDown, as
`partitions.py` does) or, with `--local`, a folder on this disk.

    python benchmarks/source.py [--files 20] [--rows 50000] [--append 0.01] [--appends 1] [--cpus 16] [--local] [--label NAME]

`partitions.py` runs every stage on 8,000 URLs; there the source stage is a second or two of fixed
costs (a Ray task or two started, a few requests) whichever way it runs, and its append share says
nothing about its work. Here the fresh run reads and keys 10^6 rows, and the append shows what is
left of that: the new file's keys, the check across files (each file's 12-byte-a-row base hashes,
not its keys) and the key index (a segment for the new ledger). Printed and merged by label into
benchmarks/results/source.json: each run's stage seconds and task groups, the key index's rows
written, requests (on S3), and the append's share of the fresh stage. With `--appends N`, N appends
one after another, a file each: the check's reads of what earlier checks covered (their runs and
BASES tables, `check_reads`) must not grow with the appends before (keys.MERGE_FROM).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks._common import RESULTS, merge_run  # noqa: E402
from benchmarks.partitions import _cpu_probe, _traffic  # noqa: E402

BUCKET = "capline-source"
PREFIX = "line"


def _write_list(path: Path, first: int, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"url": [f"http://images.example/{i:09d}.jpg" for i in range(first, first + n)],
                             "caption": [f"a photograph, number {i}, of something on a table" for i in range(first, first + n)]}),
                   path)


def _check_reads(entries: list) -> int:
    """GETs of the tables the check across files reads: each file's BASES table and the runs
    (`source/keyed/checked-*`) that hold them."""
    return sum(1 for e in entries if e[1] == "GET" and f"/{PREFIX}/source/keyed/" in e[2]
               and (e[2].endswith("/bases.parquet") or "/checked-" in e[2]))


def run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="capline-source-bench-"))
    urls = tmp / "urls"
    urls.mkdir()
    for f in range(args.files):
        _write_list(urls / f"part-{f:05d}.parquet", f * args.rows, args.rows)
    n_fresh = args.files * args.rows
    n_more = max(1, round(n_fresh * args.append))
    config = {"name": "source-bench", "seed": 0, "track_data": False,
              "source": {"kind": "urls", "path": str(urls), "url_col": "url", "caption_col": "caption"},
              "ray": {"num_cpus": args.cpus, "object_store_memory_mb": 1024}}
    (tmp / "source.yaml").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CAPLINE_PROGRESS": "0", "CAPLINE_NETGUARD": "1"}
    proxy = client = None
    with contextlib.ExitStack() as stack:
        if args.local:
            run_dir = str(tmp / "run")
        else:
            from helpers import s3_behind_proxy

            env_s3, client, proxy = stack.enter_context(s3_behind_proxy(BUCKET, args.latency_ms / 1000,
                                                                        write_limit=args.write_limit))
            env.update(env_s3)
            run_dir = f"s3://{BUCKET}/{PREFIX}"
        out = {"label": args.label, "files": args.files, "rows_per_file": args.rows, "urls": {"fresh": n_fresh, "append": n_more},
               "cpus_declared": args.cpus, "run_folder": "local" if args.local else
               f"S3 (moto) behind {args.latency_ms} ms, {args.write_limit} writes/s", "runs": {}}
        names = ["fresh", "append"] + [f"append{k}" for k in range(2, args.appends + 1)]
        for k, name in enumerate(names):
            if k:
                _write_list(urls / f"part-{args.files + k - 1:05d}.parquet", n_fresh + (k - 1) * n_more, n_more)
            first = len(proxy.entries) if proxy else 0
            probe = _cpu_probe()
            t0 = time.time()
            proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(tmp / "source.yaml"), "--run-dir", run_dir,
                                   "--until", "source"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
            wall = time.time() - t0
            log = proc.stdout + proc.stderr
            (RESULTS / f"source-{args.label}-{name}.log").write_text(log)
            if proc.returncode != 0:
                print(log[-4000:])
                raise SystemExit(f"capline run ({name}) failed ({proc.returncode}); log in benchmarks/results/")
            if client is not None:
                stats = json.loads(client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/source/stats.json")["Body"].read())
            else:
                stats = json.loads((tmp / "run" / "source" / "stats.json").read_text())
            out["runs"][name] = {
                "command_seconds": round(wall, 1), "stage_seconds": stats["wall_seconds"], "rows": stats["in"],
                "cpu_probe_s": probe, "key_index": stats.get("key_index"),
                "task_groups": [{k: g.get(k) for k in ("what", "tasks", "at_once", "seconds", "task_s_median")}
                                for g in stats.get("tasks", [])],
                **({"traffic": _traffic(proxy.entries[first:], 0, BUCKET),
                    "check_reads": _check_reads(proxy.entries[first:])} if proxy else {})}
    f, a = out["runs"]["fresh"], out["runs"]["append"]
    out["append_share"] = {"stage": round(a["stage_seconds"] / f["stage_seconds"], 3),
                           "command": round(a["command_seconds"] / f["command_seconds"], 3)}
    return out


def table(r: dict) -> str:
    lines = [f"{r['label']}: the source stage, {r['files']} files of {r['rows_per_file']} URLs + 1 file of "
             f"{r['urls']['append']}; {r['cpus_declared']} logical CPUs; run folder {r['run_folder']}"]
    for name, run in r["runs"].items():
        t = run.get("traffic")
        lines.append(f"  {name}: stage {run['stage_seconds']} s (command {run['command_seconds']} s), {run['rows']} rows; "
                     f"key index {run['key_index']}; machine speed probe {run['cpu_probe_s']} s"
                     + (f"; {t['requests']} requests, {t['requests_per_object_written']} per object written; "
                        f"the check's reads of runs and BASES tables {run['check_reads']}" if t else ""))
        for g in run["task_groups"]:
            lines.append(f"    {g['what']}: {g['tasks']} tasks, {g['at_once']} at once, {g['seconds']} s")
    lines.append(f"  append share: stage {r['append_share']['stage']} (goal <= 0.05), command {r['append_share']['command']}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=20)
    p.add_argument("--rows", type=int, default=50_000, help="URLs per list file")
    p.add_argument("--append", type=float, default=0.01)
    p.add_argument("--appends", type=int, default=1, help="appends one after another, a new file of --append each")
    p.add_argument("--cpus", type=int, default=16)
    p.add_argument("--latency-ms", type=float, default=25)
    p.add_argument("--write-limit", type=float, default=80)
    p.add_argument("--local", action="store_true", help="the run folder on this disk instead of S3 behind the proxy")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--label", default="current")
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = run(args)
    print(table(result))
    merge_run("source", args.label, result)


if __name__ == "__main__":
    main()
