"""The `capline` command line."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from trainers.errors import UserError

from . import offline

EPILOG = """\
Telemetry: capline starts every process with the usual libraries' telemetry and update checks
off (Ray usage stats and dashboard, MLflow, wandb, albumentations, hub clients). Set
CAPLINE_TELEMETRY=1 to leave them at the libraries' defaults. CAPLINE_NETGUARD=1 refuses (and
logs to CAPLINE_NETGUARD_LOG) every non-loopback connection from capline and its children.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="capline", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Build image-text pretraining datasets from URL lists and train vision encoders on them.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run (or resume) the pipeline on a config",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="Run the stages in order. A rerun with the same command skips "
                                     "finished stages and resumes an interrupted one.")
    run.add_argument("config", nargs="?", default=None,
                     help="YAML run config (default: configs/demo.yaml, the embedded demo)")
    run.add_argument("--run-dir", help="run folder (default: the config's run_dir, else runs/<name>)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value by dotted key, e.g. --set stages.ingest.timeout=5 "
                          "(repeatable; the value is parsed as YAML)")
    run.add_argument("--until", metavar="STAGE", help="stop after this stage")
    run.add_argument("--only", metavar="STAGE", help="run only this stage (earlier ones must be done)")
    run.add_argument("--address", help="Ray cluster to join, HOST:PORT or 'auto' (default: RAY_ADDRESS, "
                                       "else the config's ray.address, else a new local cluster)")

    st = sub.add_parser("status", help="per-stage table: state, in, kept, dropped by reason, wall time")
    st.add_argument("run_dir", metavar="RUN_DIR", help="a run folder made by `capline run`")

    ex = sub.add_parser("explain", help="the fate of one sample through every stage")
    ex.add_argument("run_dir", metavar="RUN_DIR", help="a run folder made by `capline run`")
    ex.add_argument("key", metavar="KEY", help="the sample's key (see ledger.parquet)")

    mo = sub.add_parser("models", help="model families and sizes, with parameter counts")
    mo.add_argument("--table", action="store_true",
                    help="count parameters of every family at every size (32k vocabulary, 224 px; tiny at "
                         "64 px) and compare with the paper's Table 1")
    return p


def _cmd_run(args) -> int:
    from .config import load_config
    from .inspect_run import format_status, status_rows
    from .ray_runtime import ray_session
    from .runner import default_run_dir, preflight, run_pipeline, select

    cfg = load_config(args.config, args.overrides)
    select(args.until, args.only)  # fail on a bad stage name before starting anything
    preflight(cfg)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    t0 = time.time()
    print(f"capline: run {cfg.name} in {run_dir}", flush=True)
    with ray_session(cfg.ray, args.address, log=lambda m: print(m, flush=True)):
        run_pipeline(cfg, run_dir, until=args.until, only=args.only, log=lambda m: print(m, flush=True))
    print()
    print(format_status(status_rows(run_dir)))
    print(f"\ncapline: finished in {time.time() - t0:.0f}s; run folder {run_dir.resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    offline.apply()
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "status":
            from .inspect_run import format_status, status_rows

            print(format_status(status_rows(Path(args.run_dir))))
            return 0
        if args.command == "explain":
            from .inspect_run import explain, format_explain

            print(format_explain(args.key, explain(Path(args.run_dir), args.key)))
            return 0
        if args.command == "models":
            from trainers.models import FAMILIES, SIZES

            if args.table:
                from trainers.models.params import format_table, table

                print(format_table(table()))
            else:
                print("families: " + ", ".join(FAMILIES))
                print("sizes (width, depth, heads, mlp, patch): " +
                      "; ".join(f"{k} {v}" for k, v in SIZES.items()))
            return 0
        parser.print_help()
        return 2
    except UserError as err:
        print(f"capline: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("capline: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
