"""capline's shuffle (`Executor.shuffle`) against a shuffle that is Ray Data's end to end, on the same
work: what dedup's group step and the key index do (many map tasks, each cutting its rows into one
piece per reducer; each reducer groups what it got).

Since 16a3d8d `Executor.shuffle` runs its maps as capline's tasks and moves their pieces by Ray Data's
hash shuffle (`groupby().map_groups`, a reducer a group); before, each reducer got every map's piece as
an object of the store (maps x reducers objects). The end-to-end Ray Data path makes its maps Ray
Data's too (`range().map_batches()`): its per-task cost there, not its shuffle, made it 2.3x slower.

Each of `--maps` map tasks makes `--rows` rows (key, band, value: a signature table's columns, drawn
from a seeded generator, so nothing is read from storage and the shuffle is what is timed) and cuts
them by `value % reducers`; each of `--reducers` reducers counts its rows and the (band, value)
groups holding two or more (dedup's candidate groups). Both paths must give the same counts.
Ray Data runs once per `--ray` variant: a shuffle strategy of its DataContext (its default,
`shuffle_v2`, `hash_shuffle`, `sort_shuffle_pull_based`), `+nozip` for uncompressed intermediates
(its default compresses them with zstd, CPU a small cluster does not have to spare). The sort-based
strategy is not run unless named: at 2,000 maps it had not finished after ~490 s here (v4s16).

    python benchmarks/shuffle.py [--maps 2000] [--rows 2000] [--reducers 16] [--cpus 16]
                                 [--ray default,shuffle_v2+nozip,hash_shuffle]
Results: benchmarks/results/shuffle.json (one entry per --label).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from benchmarks._common import code, machine, merge_run  # noqa: E402
from infra import offline  # noqa: E402

offline.apply()     # as the CLI does, before Ray starts: token auth (else Ray writes a world-readable token), nothing sent out


def _rows(m: int, n: int, values: int) -> pa.Table:
    rng = np.random.default_rng([7, m])
    return pa.table({"key": [f"p{m:05d}-{i:05d}" for i in range(n)],
                     "band": rng.integers(0, 16, n, dtype=np.int8),
                     "value": rng.integers(0, values, n, dtype=np.uint64)})


def _with_bucket(t: pa.Table, reducers: int) -> pa.Table:
    return t.append_column("bucket", pa.array(t.column("value").to_numpy() % reducers, pa.int64()))


def _count(t: pa.Table) -> tuple[int, int]:
    """(rows, (band, value) groups of two or more)."""
    if not t.num_rows:
        return 0, 0
    g = t.group_by(["band", "value"]).aggregate([("key", "count")])
    return t.num_rows, int(np.count_nonzero(g.column("key_count").to_numpy() >= 2))


def _map(m: int, n: int, values: int, reducers: int) -> list[pa.Table]:
    t = _with_bucket(_rows(m, n, values), reducers)
    b = t.column("bucket").to_numpy()
    order = np.argsort(b, kind="stable")
    cuts = np.searchsorted(b[order], np.arange(reducers + 1))
    t = t.take(pa.array(order))
    return [t.slice(cuts[r], cuts[r + 1] - cuts[r]) for r in range(reducers)]


def _reduce(r: int, *pieces: pa.Table) -> tuple[int, int, int]:
    return (r, *_count(pa.concat_tables(pieces)))


def capline_shuffle(args) -> tuple[float, list]:
    from pipeline.executor import Executor

    ex = Executor(log=lambda m: None)
    t0 = time.time()
    out = ex.shuffle(_map, [(m, args.rows, args.values, args.reducers) for m in range(args.maps)], args.reducers,
                     _reduce, [(r,) for r in range(args.reducers)], "bench shuffle", num_cpus=1)
    return time.time() - t0, sorted(out)


def ray_data_groupby(args, variant: str, default_strategy) -> tuple[float, list]:
    """Ray Data's path under `variant`; `default_strategy`: DataContext's own, read before any variant changed it."""
    import ray.data
    from ray.data.context import DataContext

    ctx = DataContext.get_current()
    strategy, _, options = variant.partition("+")
    ctx.shuffle_strategy = default_strategy if strategy == "default" else strategy
    ctx.shuffle_compression = "none" if options == "nozip" else "zstd"

    def generate(batch: pa.Table) -> pa.Table:
        return pa.concat_tables([_with_bucket(_rows(int(m), args.rows, args.values), args.reducers)
                                 for m in batch.column("id").to_pylist()])

    def reduce_group(t: pa.Table) -> pa.Table:
        rows, groups = _count(t)
        return pa.table({"bucket": [int(t.column("bucket")[0].as_py())], "rows": [rows], "groups": [groups]})

    t0 = time.time()
    ds = ray.data.range(args.maps, override_num_blocks=args.maps).map_batches(
        generate, batch_size=1, batch_format="pyarrow")
    got = ds.groupby("bucket", num_partitions=args.reducers).map_groups(reduce_group, batch_format="pyarrow").take_all()
    return time.time() - t0, sorted((g["bucket"], g["rows"], g["groups"]) for g in got)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--maps", type=int, default=2000, help="map tasks (partitions)")
    p.add_argument("--rows", type=int, default=2000, help="rows each map task makes")
    p.add_argument("--reducers", type=int, default=16)
    p.add_argument("--values", type=int, default=2 ** 20, help="distinct values a row's value is drawn from")
    p.add_argument("--cpus", type=int, default=16, help="CPUs the local Ray cluster declares")
    p.add_argument("--ray", default="default,shuffle_v2+nozip,hash_shuffle",
                   help="Ray Data variants, comma-separated: a DataContext shuffle strategy (or 'default'), "
                        "'+nozip' for uncompressed intermediates")
    p.add_argument("--label", default="default")
    args = p.parse_args()

    import logging

    from ray.data.context import DataContext

    default_strategy = DataContext.get_current().shuffle_strategy

    from infra.ray_runtime import RayConfig, ray_session

    results = {}
    with ray_session(RayConfig(num_cpus=args.cpus, object_store_memory_mb=1024), log=lambda m: None, trains=False):
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        paths = [("capline Executor.shuffle", capline_shuffle)] + [
            ("Ray Data groupby().map_groups" + ("" if v == "default" else f" [{v}]"),
             lambda a, v=v: ray_data_groupby(a, v, default_strategy)) for v in args.ray.split(",") if v]
        # each path once on a few rows first, untimed: worker processes started, modules imported,
        # so the first path timed does not pay the cluster's warm-up for the others
        tiny = argparse.Namespace(**{**vars(args), "maps": args.cpus, "rows": 10})
        for _, fn in paths:
            fn(tiny)
        for name, fn in paths:
            wall, out = fn(args)
            results[name] = {"wall_s": round(wall, 2), "rows": sum(o[1] for o in out), "groups": sum(o[2] for o in out)}
            print(f"{name}: {wall:.1f} s, {results[name]['rows']} rows, {results[name]['groups']} candidate groups",
                  flush=True)
    same = len({(r["rows"], r["groups"]) for r in results.values()}) == 1
    print(f"same counts: {same}")
    merge_run("shuffle", args.label, {"maps": args.maps, "rows_per_map": args.rows, "reducers": args.reducers,
                                      "cpus_declared": args.cpus, "results": results, "code": code(),
                                      "same_counts": same, "machine": machine()})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
