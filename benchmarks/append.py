"""A scheduled run that appends 1 %: each stage's work as a share of a fresh run's.

A URL folder of `--files` files (the demo's synthetic source, served over loopback, downloaded by
img2dataset) is run until the shard stage; then one more file with 1 % as many URLs is added and the
same command runs again, as a scheduled run would, as a dataset line that keeps its scorer, its
cut, its tokenizer and its shards (`stages.clip_score.bootstrap.reuse`, `stages.clip_score.reuse_cut`,
`stages.tokenizer.reuse`, `stages.shard.append`). Per stage: the tasks it
ran (stats.json `tasks`: every group of Ray tasks the executor ran for it) and its wall seconds, in
the appending run as a fraction of the fresh run.

    python benchmarks/append.py [--files 20] [--per-file 100]
Results: benchmarks/results/append.json

One machine, 2 cores, a local run folder: the fractions say how much of each stage's work a 1 %
append redoes, not how long either run takes on a cluster.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import write_results  # noqa: E402

STAGES = ("ingest", "dedup", "basic", "language", "clip_score", "tokenizer", "shard")


def _stage_work(run_dir: Path) -> dict:
    out = {}
    for stage in STAGES:
        stats = json.loads((run_dir / stage / "stats.json").read_text())
        groups: dict[str, int] = {}
        for t in stats.get("tasks", []):
            groups[t["what"]] = groups.get(t["what"], 0) + t["tasks"]
        out[stage] = {"tasks": sum(groups.values()), "seconds": stats["wall_seconds"], "groups": groups}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=20, help="URL files of the fresh run")
    ap.add_argument("--per-file", type=int, default=100, help="URLs per file")
    args = ap.parse_args()

    from infra import offline

    offline.apply()   # as the CLI does, before Ray is imported: token auth, nothing sent out

    import pyarrow.parquet as pq

    from infra.ray_runtime import RayConfig, ray_session
    from pipeline.config import load_config
    from pipeline.runner import run_pipeline
    from stages.source import synthetic
    from stages.source.demo_server import DemoServer
    from stages.source.stage import DefectFractions
    from stages.source.synthetic import SERVER_PLACEHOLDER

    fresh_n = args.files * args.per_file
    added = max(1, fresh_n // 100)
    with tempfile.TemporaryDirectory(prefix="capline-append-") as tmp:
        tmp = Path(tmp)
        synthetic.generate(tmp / "site", fresh_n + added, 10, 48, 7, vars(DefectFractions()), 100, 100)
        rows = pq.read_table(tmp / "site" / "urls.parquet").to_pylist()
        urls = tmp / "urls"
        urls.mkdir()
        with DemoServer(tmp / "site" / "www") as server, \
                ray_session(RayConfig(num_cpus=2, object_store_memory_mb=512), log=lambda m: None):
            def write(name, chunk):
                lines = ["url,caption"] + [f"{r['url'].replace(SERVER_PLACEHOLDER, server.base_url)},"
                                           f"\"{r['caption']}\"" for r in chunk]
                (urls / name).write_text("\n".join(lines) + "\n")

            for i in range(args.files):
                write(f"f{i:04d}.csv", rows[i * args.per_file:(i + 1) * args.per_file])
            cfg = load_config(None, [
                "source.kind=urls", f"source.path={urls}", f"stages.ingest.allow_hosts=['{server.netloc}']",
                f"stages.ingest.samples_per_shard={args.per_file}", f"stages.ingest.compact_rows={args.per_file}",
                f"stages.dedup.cache_dir={tmp / 'cache'}", "stages.dedup.eval_sets=[]",
                "stages.clip_score.bootstrap.steps=30", "stages.clip_score.bootstrap.reuse=true",
                "stages.tokenizer.vocab_size=500", "stages.tokenizer.reuse=true", "stages.clip_score.reuse_cut=true",
                "stages.shard.append=true", "track_data=false"])
            run_dir = tmp / "run"
            print(f"fresh run: {fresh_n} URLs in {args.files} files", flush=True)
            run_pipeline(cfg, run_dir, until="shard", log=lambda m: None)
            fresh = _stage_work(run_dir)
            write(f"f{args.files:04d}.csv", rows[fresh_n:])
            print(f"appending run: +{added} URLs (1 %) in one more file", flush=True)
            run_pipeline(cfg, run_dir, until="shard", log=lambda m: None)
            append = _stage_work(run_dir)
    table = {}
    print(f"{'stage':<11}{'fresh tasks':>12}{'append tasks':>13}{'share':>7}{'fresh s':>9}{'append s':>9}{'share':>7}")
    for stage in STAGES:
        f, a = fresh[stage], append[stage]
        table[stage] = {"fresh": f, "append": a, "task_share": round(a["tasks"] / max(1, f["tasks"]), 3),
                        "seconds_share": round(a["seconds"] / max(1e-9, f["seconds"]), 3)}
        print(f"{stage:<11}{f['tasks']:>12}{a['tasks']:>13}{table[stage]['task_share']:>7.2f}"
              f"{f['seconds']:>9.1f}{a['seconds']:>9.1f}{table[stage]['seconds_share']:>7.2f}")
    print("task groups (fresh -> append):")
    for stage in STAGES:
        g = fresh[stage]["groups"]
        print(f"  {stage:<11}" + ", ".join(f"{w} {g[w]} -> {append[stage]['groups'].get(w, 0)}" for w in g))
    write_results("append", {"fresh_urls": fresh_n, "added_urls": added, "files": args.files, "stages": table,
                             "goal": "each stage after source <= 5 % of a fresh run"})


if __name__ == "__main__":
    main()
