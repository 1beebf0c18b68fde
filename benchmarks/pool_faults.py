"""The model pool's two remaining reasons to be capline's own (#34), measured rather than argued:
what Ray Data's `ActorPoolStrategy` and capline's pool (`Executor.run(model=...)`) do with

1. **a call's aside** (a partition's keys, kept in the object store for a later step): each call's
   output block holds `--keys` keys beside a small result; after the pool has ended, are the
   blocks still readable (who owns them), and how large are the rows that reading the results
   alone (`select_columns(...).take_all()`) gives the driver (as JSON) against the blocks whole
   (one node: where blocks live on a cluster is not shown here);
2. **a partition that kills its actor** (the OOM killer, a segfault in a decoder): one of
   `--parts` partitions ends its process mid-call. Ray Data with its defaults, Ray Data with
   restarts and retries bounded (`max_restarts=3, max_task_retries=2`), and capline's pool: does
   the run end, after how long, does the error name the partition, and how many of the other
   partitions' calls finished.

Each Ray Data case runs in its own process under `--timeout` seconds (a case that has not ended by
then is reported as such and killed by its process group). On this machine Ray declares `--cpus`
CPUs on 2 cores.

    python benchmarks/pool_faults.py [--parts 8] [--keys 20000] [--cpus 4] [--timeout 90] [--label L]
Results: benchmarks/results/pool_faults.json (one entry per --label).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import code, machine, merge_run  # noqa: E402

POISON = 3     # the partition whose call ends its process


def _ray_up(cpus: int):
    """The case's Ray (started by `main` through capline's ray_session), Ray Data's logs quiet."""
    import logging

    import ray

    from pipeline.executor import quiet_ray_data

    logging.getLogger("ray.data").setLevel(logging.ERROR)
    quiet_ray_data()
    return ray


def case_aside(parts: int, keys: int, cpus: int) -> dict:
    """Ray Data's pool: output blocks with an aside column; read after the pool has ended."""
    import gc

    import pyarrow as pa

    ray = _ray_up(cpus)
    import ray.data as rd

    rd.DataContext.get_current().execution_options.preserve_order = True

    class Call:
        def __call__(self, batch: pa.Table) -> pa.Table:
            part = batch.column("part")[0].as_py()
            aside = [f"{part}-{i:08d}" for i in range(keys)]
            return pa.table({"part": [part], "result": [f"{part}: {keys} kept"],
                             "aside": pa.array([aside], pa.list_(pa.string()))})

    ds = rd.from_items([{"part": f"p{i:04d}"} for i in range(parts)], override_num_blocks=parts)
    out = ds.map_batches(Call, batch_format="pyarrow", batch_size=1, compute=rd.ActorPoolStrategy(size=2)).materialize()
    refs = [e.ref for bundle in out.iter_internal_ref_bundles() for e in bundle.blocks]
    del ds
    gc.collect()
    time.sleep(2)
    alive = sum(1 for name in _process_titles() if "MapWorker" in name)
    results = out.select_columns(["part", "result"]).take_all()
    result_bytes = sum(len(json.dumps(r)) for r in results)
    blocks = ray.get(refs)          # the asides, read by reference after the pool is gone
    asides_ok = all(len(b.column("aside")[0]) == keys for b in blocks)
    aside_bytes = sum(b.nbytes for b in blocks)
    return {"blocks": len(refs), "pool_actors_alive_after": alive, "asides_readable_after_pool": asides_ok,
            "result_bytes_to_driver": result_bytes, "block_bytes": aside_bytes,
            "parts_in_order": [r["part"] for r in results] == [f"p{i:04d}" for i in range(parts)]}


def _process_titles() -> list[str]:
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            out.append(" ".join(p.cmdline()))
        except psutil.Error:
            pass
    return out


def case_ray_data_poison(parts: int, cpus: int, bounded: bool) -> dict:
    import pyarrow as pa

    ray = _ray_up(cpus)
    import ray.data as rd

    done = ray.remote(num_cpus=0)(_Counter).remote()

    class Call:
        def __call__(self, batch: pa.Table) -> pa.Table:
            part = int(batch.column("part")[0].as_py())
            if part == POISON:
                os._exit(1)          # as the OOM killer ends a worker mid-call
            ray.get(done.add.remote(part))
            return pa.table({"part": [part]})

    extra = {"max_restarts": 3, "max_task_retries": 2} if bounded else {}
    t0 = time.time()
    try:
        rd.from_items([{"part": i} for i in range(parts)], override_num_blocks=parts).map_batches(
            Call, batch_format="pyarrow", batch_size=1, compute=rd.ActorPoolStrategy(size=2), **extra).materialize()
        return {"ended": "finished", "seconds": round(time.time() - t0, 1), "others_done": ray.get(done.count.remote())}
    except Exception as err:   # noqa: BLE001 - what the failure says is the measurement
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return {"ended": "failed", "seconds": round(time.time() - t0, 1), "error": f"{type(err).__name__}: {text[:300]}",
                "names_the_partition": f"part {POISON}" in text or f"'part': {POISON}" in text,
                "others_done": ray.get(done.count.remote())}


class _Counter:
    def __init__(self):
        self.parts = set()

    def add(self, part):
        self.parts.add(part)

    def count(self):
        return len(self.parts)


def poison_step(part: int, done) -> int:
    import ray

    if part == POISON:
        os._exit(1)
    ray.get(done.add.remote(part))
    return part


def case_capline_poison(parts: int, cpus: int) -> dict:
    ray = _ray_up(cpus)
    from pipeline.executor import Executor
    from stages.shared_model import SharedModel

    done = ray.remote(num_cpus=0)(_Counter).remote()
    ex = Executor(log=lambda m: None)
    t0 = time.time()
    try:
        ex.run(poison_step, [(i, done) for i in range(parts)], "poison", model=SharedModel("no model", None),
               describe=lambda c: f"partition {c[0]}")
        return {"ended": "finished", "seconds": round(time.time() - t0, 1), "others_done": ray.get(done.count.remote())}
    except Exception as err:   # noqa: BLE001 - what the failure says is the measurement
        text = str(err).strip().splitlines()[0]
        return {"ended": "failed", "seconds": round(time.time() - t0, 1), "error": f"{type(err).__name__}: {text[:300]}",
                "names_the_partition": f"partition {POISON}" in text, "others_done": ray.get(done.count.remote())}


def _in_process(case: str, args, timeout: float) -> dict:
    """One case in its own process group, killed whole past `timeout`: -> its JSON, or 'no end'."""
    cmd = [sys.executable, __file__, "--case", case, "--parts", str(args.parts), "--keys", str(args.keys),
           "--cpus", str(args.cpus)]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"ended": f"no end within {timeout:g} s (killed)", "seconds": round(time.time() - t0, 1)}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"ended": f"process exited {proc.returncode} without a result"}


CASES = {"aside": lambda a: case_aside(a.parts, a.keys, a.cpus),
         "ray_data_defaults": lambda a: case_ray_data_poison(a.parts, a.cpus, bounded=False),
         "ray_data_bounded": lambda a: case_ray_data_poison(a.parts, a.cpus, bounded=True),
         "capline_pool": lambda a: case_capline_poison(a.parts, a.cpus)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=int, default=8)
    p.add_argument("--keys", type=int, default=20_000, help="keys in a call's aside")
    p.add_argument("--cpus", type=int, default=4)
    p.add_argument("--timeout", type=float, default=90.0, help="seconds a case may run before it is killed")
    p.add_argument("--label", default="default")
    p.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)   # one case, in its own process
    args = p.parse_args()
    if args.case:
        from infra import offline
        from infra.ray_runtime import RayConfig, ray_session

        offline.apply()      # as the CLI does, before Ray starts
        with ray_session(RayConfig(num_cpus=args.cpus, object_store_memory_mb=512), log=lambda m: None, trains=False):
            got = CASES[args.case](args)
        print(json.dumps(got), flush=True)
        return 0
    result = {"code": code(), "machine": machine(), "parts": args.parts, "keys": args.keys, "cpus": args.cpus,
              "poison": POISON, "cases": {}}
    for case in CASES:
        got = _in_process(case, args, args.timeout)
        result["cases"][case] = got
        print(f"{case:18s} {json.dumps(got)}", flush=True)
    merge_run("pool_faults", args.label, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
