"""The reasons the model pool and the task window are capline's own (#34), measured rather than
argued: what Ray Data's `ActorPoolStrategy` / `TaskPoolStrategy` and capline's pool
(`Executor.run(model=...)`) / task window (`Executor.run`) do with

1. **a call's aside** (a partition's keys, kept in the object store for a later step): each call's
   output block holds `--keys` keys beside a small result; after the pool has ended, are the
   blocks still readable (who owns them), and how large are the rows that reading the results
   alone (`select_columns(...).take_all()`) gives the driver (as JSON) against the blocks whole
   (one node: where blocks live on a cluster is not shown here);
2. **a partition that kills its actor** (the OOM killer, a segfault in a decoder): one of
   `--parts` partitions ends its process mid-call. Ray Data with its defaults, Ray Data with
   restarts and retries bounded (`max_restarts=3, max_task_retries=2`), Ray Data asked for capline's
   pool's semantics ("blamed": restarts unbounded, a call's tries bounded at 3, one call in flight per
   actor, a small actor told which partition each actor runs), and capline's pool: does the run end,
   after how long, does the error (or the small actor) name the partition, and how many of the other
   partitions' calls finished; with `_once`, the partition kills its actor only once (the pool must
   recover and finish);
3. **the same partition through a task pool**: Ray Data's `TaskPoolStrategy` (its defaults; retries
   bounded at 2) against capline's task window (`Executor.run`).

Every case also says what else reaches a user's terminal: Ray Data's deprecation warnings (the bounds
go through `ray_remote_args`) and Ray's `core_worker.cc` error line about an actor whose constructor
arguments are in the object store with restarts on (ray-project/ray#57733).

Each Ray Data case runs in its own process under `--timeout` seconds (a case that has not ended by
then is reported as such and killed by its process group). On this machine Ray declares `--cpus`
CPUs on 2 cores.

    python benchmarks/pool_faults.py [--parts 8] [--keys 20000] [--cpus 4] [--timeout 90] [--only a,b] [--label L]
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

    from pipeline.ray_shuffle import quiet_ray_data

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


def _kills(part: int, once_dir: str | None) -> bool:
    """Whether this call of `part` ends its process: the poisoned partition's every call, or with
    `once_dir` its first call only (a death that does not come back: memory pressure from elsewhere)."""
    if part != POISON:
        return False
    if once_dir is None:
        return True
    marker = Path(once_dir) / "killed"
    if marker.exists():
        return False
    marker.touch()
    return True


def case_ray_data_poison(parts: int, cpus: int, mode: str, once_dir: str | None = None) -> dict:
    """`mode`: "defaults" (Ray Data's own), "bounded" (`max_restarts=3, max_task_retries=2`) or
    "blamed": the semantics of capline's pool asked of Ray Data (restarts unbounded, a call's tries
    bounded at 3, one call in flight per actor so that a death is its running call's alone) and a
    small actor told which partition each actor is running, which names the partition when the
    run fails with an actor's id."""
    import warnings

    import pyarrow as pa

    ray = _ray_up(cpus)
    import ray.data as rd

    done = ray.remote(num_cpus=0)(_Counter).remote()
    keeper = ray.remote(num_cpus=0)(_Running).remote() if mode == "blamed" else None

    class Call:
        def __init__(self):
            self.me = ray.get_runtime_context().get_actor_id()

        def __call__(self, batch: pa.Table) -> pa.Table:
            part = int(batch.column("part")[0].as_py())
            if keeper is not None:
                ray.get(keeper.started.remote(self.me, part))
            if _kills(part, once_dir):
                os._exit(1)          # as the OOM killer ends a worker mid-call
            ray.get(done.add.remote(part))
            return pa.table({"part": [part]})

    extra = {"bounded": {"max_restarts": 3, "max_task_retries": 2},
             "blamed": {"max_restarts": -1, "max_task_retries": 2},
             "tasks_bounded": {"max_retries": 2}}.get(mode, {})
    def call(batch: pa.Table) -> pa.Table:
        part = int(batch.column("part")[0].as_py())
        if _kills(part, once_dir):
            os._exit(1)
        ray.get(done.add.remote(part))
        return pa.table({"part": [part]})

    if mode.startswith("tasks"):    # Ray Data's task pool, a function per call: the task window's counterpart
        udf, strategy = call, rd.TaskPoolStrategy(size=2)
    else:
        udf = Call
        strategy = rd.ActorPoolStrategy(size=2, max_tasks_in_flight_per_actor=1 if mode == "blamed" else None)
    t0 = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            rd.from_items([{"part": i} for i in range(parts)], override_num_blocks=parts).map_batches(
                udf, batch_format="pyarrow", batch_size=1, compute=strategy, **extra).materialize()
            got = {"ended": "finished", "seconds": round(time.time() - t0, 1), "others_done": ray.get(done.count.remote())}
        except Exception as err:   # noqa: BLE001 - what the failure says is the measurement
            text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            named = None
            if keeper is not None and getattr(err, "actor_id", None):
                named = ray.get(keeper.running.remote()).get(err.actor_id)
            got = {"ended": "failed", "seconds": round(time.time() - t0, 1), "error": f"{type(err).__name__}: {text[:300]}",
                   "names_the_partition": f"part {POISON}" in text or f"'part': {POISON}" in text,
                   "others_done": ray.get(done.count.remote())}
            if keeper is not None:
                got["keeper_names"] = f"partition {named}" if named is not None else None
    if keeper is not None:
        got["poison_started"] = ray.get(keeper.starts.remote()).get(POISON, 0)
    got["deprecation_warnings"] = sorted({str(w.message)[:120] for w in caught if "deprecat" in str(w.message).lower()})
    return got


class _Running:
    """Which partition each actor of a pool runs now (by actor id), and how often each was started."""

    def __init__(self):
        self.now, self.n = {}, {}

    def started(self, actor: str, part: int) -> None:
        self.now[actor] = part
        self.n[part] = self.n.get(part, 0) + 1

    def running(self) -> dict:
        return self.now

    def starts(self) -> dict:
        return self.n


class _Counter:
    def __init__(self):
        self.parts = set()

    def add(self, part):
        self.parts.add(part)

    def count(self):
        return len(self.parts)


def poison_step(part: int, done, once_dir: str | None = None) -> int:
    import ray

    if _kills(part, once_dir):
        os._exit(1)
    ray.get(done.add.remote(part))
    return part


def case_capline_poison(parts: int, cpus: int, once_dir: str | None = None, pool: bool = True) -> dict:
    ray = _ray_up(cpus)
    from pipeline.executor import Executor
    from stages.shared_model import SharedModel

    done = ray.remote(num_cpus=0)(_Counter).remote()
    ex = Executor(log=lambda m: None)
    t0 = time.time()
    try:
        ex.run(poison_step, [(i, done, once_dir) for i in range(parts)], "poison",
               model=SharedModel("no model", None) if pool else None,
               describe=lambda c: f"partition {c[0]}")
        return {"ended": "finished", "seconds": round(time.time() - t0, 1), "others_done": ray.get(done.count.remote())}
    except Exception as err:   # noqa: BLE001 - what the failure says is the measurement
        text = str(err).strip().splitlines()[0]
        return {"ended": "failed", "seconds": round(time.time() - t0, 1), "error": f"{type(err).__name__}: {text[:300]}",
                "names_the_partition": f"partition {POISON}" in text, "others_done": ray.get(done.count.remote())}


def _in_process(case: str, args, timeout: float) -> dict:
    """One case in its own process group, killed whole past `timeout`: -> its JSON, or 'no end'."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--case", case, "--parts", str(args.parts), "--keys", str(args.keys),
               "--cpus", str(args.cpus), "--once-dir", tmp]
        t0 = time.time()
        with open(Path(tmp) / "stderr", "w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=timeout)
                got = None
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                got = {"ended": f"no end within {timeout:g} s (killed)", "seconds": round(time.time() - t0, 1)}
            err.seek(0)
            # what a user's terminal shows besides capline's own lines: Ray's C++ error lines
            # (an actor pool with restarts whose constructor arguments are in the object store)
            said = [ln for ln in err.read().splitlines() if "core_worker.cc" in ln and "constructor arguments" in ln]
    if got is None:
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        got = json.loads(lines[-1]) if lines else {"ended": f"process exited {proc.returncode} without a result"}
    got["restart_warning_lines"] = len(said)
    return got


CASES = {"aside": lambda a: case_aside(a.parts, a.keys, a.cpus),
         "ray_data_defaults": lambda a: case_ray_data_poison(a.parts, a.cpus, "defaults"),
         "ray_data_bounded": lambda a: case_ray_data_poison(a.parts, a.cpus, "bounded"),
         "ray_data_blamed": lambda a: case_ray_data_poison(a.parts, a.cpus, "blamed"),
         "capline_pool": lambda a: case_capline_poison(a.parts, a.cpus),
         # the same partition through a task pool: Ray Data's (its defaults; retries bounded) and
         # capline's task window (`Executor.run`, plain Ray tasks, max_retries=2)
         "ray_data_tasks_defaults": lambda a: case_ray_data_poison(a.parts, a.cpus, "tasks_defaults"),
         "ray_data_tasks_bounded": lambda a: case_ray_data_poison(a.parts, a.cpus, "tasks_bounded"),
         "capline_window": lambda a: case_capline_poison(a.parts, a.cpus, pool=False),
         # one death only, not the partition's doing: the pool must recover and finish every partition
         "ray_data_blamed_once": lambda a: case_ray_data_poison(a.parts, a.cpus, "blamed", a.once_dir),
         "capline_pool_once": lambda a: case_capline_poison(a.parts, a.cpus, a.once_dir)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=int, default=8)
    p.add_argument("--keys", type=int, default=20_000, help="keys in a call's aside")
    p.add_argument("--cpus", type=int, default=4)
    p.add_argument("--timeout", type=float, default=90.0, help="seconds a case may run before it is killed")
    p.add_argument("--label", default="default")
    p.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)   # one case, in its own process
    p.add_argument("--once-dir", help=argparse.SUPPRESS)     # the case's folder (a one-death case's marker)
    p.add_argument("--only", help="run only these cases (comma-separated)")
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
    for case in (args.only.split(",") if args.only else CASES):
        got = _in_process(case, args, args.timeout)
        result["cases"][case] = got
        print(f"{case:18s} {json.dumps(got)}", flush=True)
    merge_run("pool_faults", args.label, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
