"""What capline's own engine floor still does against Ray Data's mechanism for the same work: the two
pieces #34 asks to move onto Ray Data that stay capline's (the shuffles moved in session 16).

- **task window** (`Executor.run`): `--parts` partitions, each a small per-partition step (the basic
  filter's kind: every caption of the partition hashed and measured), against Ray Data's
  `from_items(...).map_batches(fn, batch_size=1, compute=TaskPoolStrategy())`;
- **model pool** (`Executor.run(model=...)`, `stages/shared_model.py`): the language stage's own
  `identify` with fastText's lid.176 loaded once per actor, against Ray Data's
  `map_batches(Class, compute=ActorPoolStrategy(size=...))` with the same number of actors, each
  loading the same model in its constructor.

Each partition holds `--rows` real COCO captions (`tests/trainers/data/coco-val-captions.txt`, cycled and
numbered so partitions differ). Both paths must give the same answers (the counts per partition).
Each path runs once untimed on a few partitions first (worker processes started, modules imported),
then `--repeat` times timed; the table gives the median. On this machine Ray declares `--cpus` CPUs
on 2 cores, as the other cluster benchmarks do: per-task overheads weigh more here than on a node
with real cores.

    python benchmarks/engine_floor.py [--parts 20,200] [--rows 500] [--cpus 16] [--repeat 3] [--label L]
Results: benchmarks/results/engine_floor.json (one entry per --label).
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa  # noqa: E402

from benchmarks._common import code, machine, merge_run  # noqa: E402
from infra import offline  # noqa: E402

offline.apply()     # as the CLI does, before Ray starts

CAPTIONS = Path(__file__).resolve().parent.parent / "tests" / "trainers" / "data" / "coco-val-captions.txt"


def _partition(i: int, rows: int, captions: list[str]) -> pa.Table:
    start = (i * rows) % len(captions)
    caps = [f"{captions[(start + j) % len(captions)]} ({i}.{j})" for j in range(rows)]
    return pa.table({"key": [f"p{i:05d}-{j:05d}" for j in range(rows)], "caption": caps})


def plain_step(i: int, rows: int, captions: list[str]) -> tuple[int, int]:
    """The basic filter's kind of work: each caption measured and hashed. -> (partition, captions over 40 characters)."""
    t = _partition(i, rows, captions)
    long = 0
    for cap in t.column("caption").to_pylist():
        hashlib.sha1(cap.encode()).digest()
        long += len(cap) > 40
    return i, long


def language_step(i: int, rows: int, captions: list[str]) -> tuple[int, int]:
    """The language stage's judge on one partition. -> (partition, captions kept)."""
    from stages.dataplane import KEPT
    from stages.filters.language import LanguageConfig, identify

    table, _ = identify(_partition(i, rows, captions), LanguageConfig())
    return i, sum(v == KEPT for v in table.column("verdict").to_pylist())


def capline_window(parts: int, rows: int, captions_ref) -> tuple[float, list, dict]:
    from pipeline.executor import Executor

    ex = Executor(log=lambda m: None)
    t0 = time.time()
    out = ex.run(plain_step, [(i, rows, captions_ref) for i in range(parts)], "plain step")
    return time.time() - t0, sorted(out), ex.records[-1]


def ray_data_window(parts: int, rows: int, captions_ref) -> tuple[float, list, dict]:
    import ray
    import ray.data

    def step(batch: dict) -> dict:
        caps = ray.get(captions_ref)
        got = [plain_step(int(i), rows, caps) for i in batch["part"]]
        return {"part": [g[0] for g in got], "n": [g[1] for g in got]}

    t0 = time.time()
    rows_out = ray.data.from_items([{"part": i} for i in range(parts)], override_num_blocks=parts).map_batches(
        step, batch_size=1, compute=ray.data.TaskPoolStrategy()).take_all()
    return time.time() - t0, sorted((r["part"], r["n"]) for r in rows_out), {}


def capline_pool(parts: int, rows: int, captions_ref) -> tuple[float, list, dict]:
    from pipeline.executor import Executor
    from stages.filters.language import LanguageConfig, shared_backend

    ex = Executor(log=lambda m: None)
    t0 = time.time()
    out = ex.run(language_step, [(i, rows, captions_ref) for i in range(parts)], "language",
                 model=shared_backend(LanguageConfig()))
    return time.time() - t0, sorted(out), ex.records[-1]


def ray_data_pool(parts: int, rows: int, captions_ref, actors: int) -> tuple[float, list, dict]:
    import ray
    import ray.data

    from stages.filters.language import LanguageConfig, shared_backend

    model = shared_backend(LanguageConfig())

    class Judge:
        def __init__(self):
            model.load(*model.args)          # the model once per actor, as capline's pool loads it
            self.captions = ray.get(captions_ref)

        def __call__(self, batch: dict) -> dict:
            got = [language_step(int(i), rows, self.captions) for i in batch["part"]]
            return {"part": [g[0] for g in got], "n": [g[1] for g in got]}

    t0 = time.time()
    rows_out = ray.data.from_items([{"part": i} for i in range(parts)], override_num_blocks=parts).map_batches(
        Judge, batch_size=1, num_cpus=1, memory=model.memory_bytes,
        compute=ray.data.ActorPoolStrategy(size=actors)).take_all()
    return time.time() - t0, sorted((r["part"], r["n"]) for r in rows_out), {"actors": actors}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="20,200", help="partition counts, comma-separated")
    p.add_argument("--rows", type=int, default=500, help="captions a partition holds")
    p.add_argument("--cpus", type=int, default=16, help="CPUs the local Ray cluster declares")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--label", default="default")
    args = p.parse_args()

    import logging

    import ray

    from infra.ray_runtime import RayConfig, ray_session
    from pipeline.ray_shuffle import quiet_ray_data

    captions = [line.strip() for line in CAPTIONS.read_text().splitlines() if line.strip()]
    result = {"code": code(), "machine": machine(), "rows": args.rows, "cpus": args.cpus, "runs": {}}
    with ray_session(RayConfig(num_cpus=args.cpus, object_store_memory_mb=512), log=lambda m: None, trains=False):
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        quiet_ray_data()
        ref = ray.put(captions)
        # warm: worker processes started, Ray Data and fastText's module imported, for every path
        capline_window(args.cpus, 10, ref)
        ray_data_window(args.cpus, 10, ref)
        _, _, rec = capline_pool(8, 10, ref)
        ray_data_pool(8, 10, ref, rec["actors"])
        for parts in [int(x) for x in args.parts.split(",") if x]:
            times: dict[str, list[float]] = {}
            for _ in range(args.repeat):
                s_cw, a_cw, _ = capline_window(parts, args.rows, ref)
                s_rw, a_rw, _ = ray_data_window(parts, args.rows, ref)
                if a_cw != a_rw:
                    raise SystemExit(f"task window: the two paths disagree at {parts} partitions")
                s_cp, a_cp, rec = capline_pool(parts, args.rows, ref)
                s_rp, a_rp, _ = ray_data_pool(parts, args.rows, ref, rec["actors"])
                if a_cp != a_rp:
                    raise SystemExit(f"model pool: the two paths disagree at {parts} partitions")
                for name, s in (("capline task window", s_cw), ("Ray Data TaskPoolStrategy", s_rw),
                                ("capline model pool", s_cp), ("Ray Data ActorPoolStrategy", s_rp)):
                    times.setdefault(name, []).append(round(s, 3))
            run = {name: {"median_s": statistics.median(ts), "runs_s": ts} for name, ts in times.items()}
            run["actors"] = rec["actors"]
            result["runs"][str(parts)] = run
            print(f"{parts} partitions of {args.rows} captions ({rec['actors']} actors):")
            for name, ts in times.items():
                print(f"  {name:30s} {statistics.median(ts):7.2f} s  (runs {ts})")
    merge_run("engine_floor", args.label, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
