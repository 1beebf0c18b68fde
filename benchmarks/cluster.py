"""The data path as a cluster sees it: a Ray head declaring many logical CPUs, the run folder on S3
(moto's real server) behind a loopback proxy that adds latency to every request and counts them.

    python benchmarks/cluster.py [--cpus 16] [--samples 3200] [--per-shard 100] [--latency-ms 25]
                                 [--tree PATH] [--label NAME]

`capline run` (the demo's synthetic source, served over loopback and downloaded by img2dataset) runs
until the shard stage with `ray.num_cpus` logical CPUs. Per stage it reports:
- tasks at once / declared CPUs: for each group of tasks the executor ran (stats.json `tasks`), the
  most that ran at the same instant, from the start and end each task reported;
- object-store requests per sample (all, and GETs of ingest tars), bytes read per sample, and
  objects written per sample, from the proxy's log, attributed to stages by their time windows
  (`_SUCCESS` completed_at minus the stage's wall time; 1 s resolution);
- the whole run's GETs of ingest tars per image (the executor reads a tar in one or a few ranges).
`--tree` runs another checkout of capline the same way (an older revision, for a before/after);
stats it does not record are left out. Results to benchmarks/results/cluster.json (merged by label).

This is one machine with 2 real cores: the figures say how the work is shaped (requests, objects,
parallelism the executor asks for and Ray grants), not how fast a real cluster is.
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks._common import RESULTS, merge_run  # noqa: E402

STAGES = ["source", "ingest", "dedup", "basic", "language", "clip_score", "tokenizer", "shard"]
BUCKET = "capline-bench"


def _stage_windows(client, prefix: str) -> dict[str, tuple[float, float, dict]]:
    out = {}
    for stage in STAGES:
        try:
            marker = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/{stage}/_SUCCESS")["Body"].read())
            stats = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/{stage}/stats.json")["Body"].read())
        except Exception:  # noqa: BLE001 - a stage this revision did not finish
            continue
        end = datetime.strptime(marker["completed_at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp() + 1
        out[stage] = (end - stats["wall_seconds"] - 1, end, stats)
    return out


@contextmanager
def ray_nodes(n: int, cpus: int, env: dict, tree: Path):
    """n nodes started with `capline ray start` (one head), `cpus` logical CPUs among them; yields the
    address (None for n <= 1: `capline run` starts its own local cluster). Stopped by pid."""
    from helpers import cluster_tag, free_port, ray_pids, stop_pids

    if n <= 1:
        yield None
        return
    env, tag = cluster_tag(env)
    port, dash = free_port(), free_port()
    per = max(1, cpus // n)
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", str(per), "--object-store-memory", str(150 * 2**20)]
    cli = [sys.executable, "-m", "pipeline.cli", "ray", "start"]
    try:
        for i in range(n):
            extra = (["--head", "--port", str(port), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash)]
                     if i == 0 else ["--address", f"127.0.0.1:{port}"])
            out = subprocess.run(cli + extra + common, cwd=tree, env=env, capture_output=True, text=True, timeout=180)
            if out.returncode != 0:
                raise SystemExit(f"ray start failed: {out.stdout[-1500:]} {out.stderr[-1500:]}")
        yield f"127.0.0.1:{port}"
    finally:
        stop_pids(ray_pids(tag))
        current = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()


def run(args) -> dict:
    from helpers import s3_behind_proxy

    with s3_behind_proxy(BUCKET, args.latency_ms / 1000) as (env_s3, client, proxy):
        return _run(args, env_s3, client, proxy)


def _run(args, env_s3: dict, client, proxy) -> dict:
    tree = Path(args.tree).resolve() if args.tree else ROOT
    tmp = Path(tempfile.mkdtemp(prefix="capline-cluster-bench-"))
    prefix = f"runs/{args.label}"
    env = {**os.environ, **env_s3,
           "CAPLINE_CACHE": str(tmp / "cache"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
           "PYTHONPATH": str(tree), "CAPLINE_PROGRESS": "0", "CAPLINE_NETGUARD": "1"}
    if args.nodes > 1:
        env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp / "cache" / "ray_auth_token")})
    sets = [f"ray.num_cpus={args.cpus}", f"source.num_samples={args.samples}", "source.serve_port=0",
            f"stages.ingest.samples_per_shard={args.per_shard}", "stages.clip_score.bootstrap.steps=30",
            f"stages.dedup.cache_dir={tmp / 'eval-index'}", "track_data=false"]
    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(tree / "configs" / "demo.yaml"), "--run-dir",
           f"s3://{BUCKET}/{prefix}", "--until", "shard"] + [x for s in sets for x in ("--set", s)]
    if args.scorer_cpus:
        cmd += ["--set", f"stages.clip_score.bootstrap.cpus={args.scorer_cpus}"]
    with ray_nodes(args.nodes, args.cpus, env, tree) as address:
        t0 = time.time()
        proc = subprocess.run(cmd + (["--address", address] if address else []), cwd=tree, env=env,
                              capture_output=True, text=True, timeout=3600)
        wall = time.time() - t0
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:])
        raise SystemExit(f"capline run failed ({proc.returncode})")
    windows = _stage_windows(client, prefix)
    entries = list(proxy.entries)
    images = windows["ingest"][2]["kept"] if "ingest" in windows else None
    tar_gets = sum(1 for _, m, k, _, _ in entries if m == "GET" and "/ingest/" in k and k.endswith(".tar"))
    per_stage = {}
    for stage, (start, end, stats) in windows.items():
        mine = [e for e in entries if start <= e[0] < end]
        methods = Counter(e[1] for e in mine)
        n = max(1, stats.get("in") or 0)
        groups = [{"what": r["what"], "tasks": r["tasks"], "at_once": r["at_once"],
                   "at_once_per_cpu": round(r["at_once"] / r["cluster_cpus"], 3)} for r in stats.get("tasks", [])]
        per_stage[stage] = {
            "samples_in": stats.get("in"), "partitions": stats.get("partitions"), "wall_seconds": stats["wall_seconds"],
            "task_groups": groups,
            "most_at_once_per_cpu": max((g["at_once_per_cpu"] for g in groups if g["tasks"] >= 16), default=None),
            "requests": len(mine), "requests_per_sample": round(len(mine) / n, 4),
            "gets_per_sample": round(methods["GET"] / n, 4),
            "ingest_tar_gets_per_sample": round(sum(1 for e in mine if e[1] == "GET" and "/ingest/" in e[2]
                                                    and e[2].endswith(".tar")) / n, 4),
            "bytes_read_per_sample": round(sum(e[4] for e in mine if e[1] == "GET") / n),
            "objects_written_per_sample": round(methods["PUT"] / n, 4)}
    return {"label": args.label, "tree": str(tree), "cpus_declared": args.cpus, "nodes": max(1, args.nodes),
            "samples": args.samples,
            "samples_per_ingest_shard": args.per_shard, "latency_ms": args.latency_ms, "wall_seconds": round(wall, 1),
            "requests": len(entries), "methods": dict(Counter(e[1] for e in entries)),
            "ingest_images": images, "ingest_tar_gets": tar_gets,
            "ingest_tar_gets_per_image": round(tar_gets / images, 4) if images else None, "stages": per_stage}


def table(result: dict) -> str:
    lines = [f"{result['label']}: {result['samples']} samples, {result['cpus_declared']} logical CPUs, "
             f"{result['latency_ms']} ms per request, {result['wall_seconds']} s; ingest-tar GETs per image "
             f"{result['ingest_tar_gets_per_image']} ({result['ingest_tar_gets']} for {result['ingest_images']})",
             f"{'stage':<11}{'parts':>6}{'at once/CPU':>12}{'req/sample':>11}{'tar GET/s':>10}{'objs/sample':>12}"]
    for stage, s in result["stages"].items():
        most = s["most_at_once_per_cpu"]
        lines.append(f"{stage:<11}{s['partitions'] or 0:>6}{(f'{most:.2f}' if most is not None else '-'):>12}"
                     f"{s['requests_per_sample']:>11.3f}{s['ingest_tar_gets_per_sample']:>10.3f}"
                     f"{s['objects_written_per_sample']:>12.3f}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", type=int, default=16)
    p.add_argument("--samples", type=int, default=3200)
    p.add_argument("--per-shard", type=int, default=100)
    p.add_argument("--latency-ms", type=float, default=25)
    p.add_argument("--nodes", type=int, default=1, help="Ray nodes (`capline ray start`), --cpus split among them")
    p.add_argument("--scorer-cpus", type=int, default=0, help="stages.clip_score.bootstrap.cpus (0: the config's)")
    p.add_argument("--tree", help="another capline checkout to run the same way (before/after)")
    p.add_argument("--label", default="current")
    args = p.parse_args()
    result = run(args)
    print(table(result))
    merge_run("cluster", args.label, result)     # other keys (dedup_alone) stay


if __name__ == "__main__":
    main()
