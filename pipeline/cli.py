"""The `capline` command line."""
from __future__ import annotations

import argparse
import os
import subprocess
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


def _job_options(p: argparse.ArgumentParser, run_dir_help: str) -> None:
    """The options every command that starts work on a config takes."""
    p.add_argument("config", nargs="?", default=None,
                   help="YAML run config (default: configs/demo.yaml, the embedded demo)")
    p.add_argument("--run-dir", help=run_dir_help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value by dotted key, e.g. --set stages.ingest.timeout=5 or "
                        "--set train.model=clip (repeatable; the value is parsed as YAML)")
    p.add_argument("--address", help="Ray cluster to join, HOST:PORT or 'auto' (default: RAY_ADDRESS, "
                                     "else the config's ray.address, else a new local cluster)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="capline", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Build image-text pretraining datasets from URL lists and train vision encoders on them.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run (or resume) the pipeline on a config",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="Run the stages in order. A rerun with the same command skips "
                                     "finished stages and resumes an interrupted one.")
    _job_options(run, "run folder (default: the config's run_dir, else runs/<name>)")
    run.add_argument("--until", metavar="STAGE", help="stop after this stage")
    run.add_argument("--only", metavar="STAGE", help="run only this stage (earlier ones must be done)")
    run.add_argument("--incremental", action="store_true",
                     help="for scheduled runs: pick up source partitions added since the last completed run "
                          "(only they are downloaded); with nothing new, say so and do nothing")

    tr = sub.add_parser("train", help="pretrain on the shards of a run (the pipeline's train stage alone)",
                        description="Train the model of the config's `train:` section on the final shards "
                                    "in RUN_DIR with Ray Train workers, tracked in MLflow (SQLite under the "
                                    "run folder unless MLFLOW_TRACKING_URI is set). Rerunning resumes an "
                                    "interrupted job from its last checkpoint.")
    _job_options(tr, "the run whose shards to train on (default: the config's run folder)")

    ev = sub.add_parser("eval", help="evaluate a trained checkpoint (few-shot, captioning, zero-shot, word order)",
                        description="Run the paper's evaluations on a capline model checkpoint; results go "
                                    "to RUN_DIR/eval/ as JSON and to the training's MLflow run.")
    ev.add_argument("checkpoint", metavar="CHECKPOINT", help="a model folder (e.g. runs/demo/train/model)")
    ev.add_argument("--tasks", default="fewshot,captioning,zeroshot,wordorder",
                    help="comma-separated: fewshot, captioning, zeroshot, wordorder (default: all)")
    ev.add_argument("--run-dir", help="the run with the tokenizer and held-out data (default: two folders up)")
    ev.add_argument("--shots", default="1,5,10,25", help="few-shot sizes per class (default: 1,5,10,25)")

    xp = sub.add_parser("experiment", help="the paper's comparison: Cap vs CapPa vs CLIP* on one run's shards",
                        description="Train Cap, CapPa and CLIP* (and --models siglip,coca if asked) at the same "
                                    "size and number of examples on RUN_DIR's shards, evaluate each, and "
                                    "write RUN_DIR/paper_table.md (also logged to MLflow with the learning curves).")
    xp.add_argument("which", choices=["paper"], help="the experiment to run")
    _job_options(xp, "a run with finished shards (default: the config's run folder)")
    xp.add_argument("--budget", default="cpu-10min", help="smoke, cpu-10min (default), cpu-1h or cluster")
    xp.add_argument("--models", default="cap,cappa,clip", help="comma-separated families (default: cap,cappa,clip)")

    st = sub.add_parser("status", help="per-stage table: state, in, kept, dropped by reason, wall time")
    st.add_argument("run_dir", metavar="RUN_DIR", help="a run folder made by `capline run`")

    rp = sub.add_parser("report", help="write RUN_DIR/report.html: funnel, score histograms, samples, curves, evaluation",
                        description="Write one self-contained HTML page for a finished (or partial) run: the "
                                    "funnel per stage, score histograms with the thresholds used, a grid of "
                                    "kept and dropped samples with captions and reasons, training curves from "
                                    "MLflow and the evaluation table. `capline run` writes it at the end too.")
    rp.add_argument("run_dir", metavar="RUN_DIR", help="a run folder made by `capline run`")
    rp.add_argument("--per-reason", type=int, default=6, help="samples shown per stage and reason (default 6)")

    ex = sub.add_parser("explain", help="the fate of one sample through every stage")
    ex.add_argument("run_dir", metavar="RUN_DIR", help="a run folder made by `capline run`")
    ex.add_argument("key", metavar="KEY", help="the sample's key (see ledger.parquet)")

    ve = sub.add_parser("verify", help="check a run's shards against its manifest, or compare two runs",
                        description="With one run: every final shard against manifest.json's checksums "
                                    "(exit 1 naming any that differ). With two: byte-identical, or which "
                                    "samples differ and how (exit 1).")
    ve.add_argument("run_dir", metavar="RUN_DIR")
    ve.add_argument("other", metavar="OTHER_RUN_DIR", nargs="?")

    rb = sub.add_parser("rebuild", help="rebuild a dataset from a manifest and report drift",
                        description="Rerun the pipeline with the manifest's pinned config into a new run "
                                    "folder, reusing its source stage, then name the URLs that died and "
                                    "those whose content changed since, and compare the shards.")
    rb.add_argument("manifest", metavar="MANIFEST", help="a run's manifest.json (or its run folder)")
    rb.add_argument("--run-dir", help="where to rebuild (default: <original run folder>-rebuild)")
    rb.add_argument("--address", help="Ray cluster to join (as for run)")

    ry = sub.add_parser("ray", help="start a Ray node for capline: `ray start` with capline's quiet, "
                                    "guarded process environment and token authentication",
                        description="capline ray start [RAY START OPTIONS]: runs `ray start` with capline's "
                                    "process environment (telemetry off, Ray's cloud-metadata probe disarmed in "
                                    "every process, Ray token auth on). A head gets a token (yours from "
                                    "RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token, else capline's in "
                                    "~/.cache/capline/ray_auth_token); a node joining with --address needs the same "
                                    "token variable set.")
    ry.add_argument("action", choices=["start"], help="only `start`: stop nodes by pid, or with `ray stop`")
    ry.add_argument("ray_args", nargs=argparse.REMAINDER, help="passed to `ray start` as they are")
    mo = sub.add_parser("models", help="model families and sizes, with parameter counts")
    mo.add_argument("--table", action="store_true",
                    help="count parameters of every family at every size (32k vocabulary, 224 px; tiny at "
                         "64 px) and compare with the paper's Table 1")
    return p


def _redact(text) -> str:
    from trainers.tracking import redact

    return redact(text)


def _say(message: str) -> None:
    """The run's log lines: a password in a URI (a tracking server's) never reaches the terminal."""
    print(_redact(message), flush=True)


def _local_run(where: str) -> Path:
    """A run folder to read: local as it is; an s3:// one fetched into its working copy first."""
    from .storage import RunStore

    store = RunStore(where)
    if store.uri:
        store.check()
        store.pull(log=lambda m: print(m, file=sys.stderr), full=True)
    return store.local


def _check_tracking(cfg, store, stages: set[str]) -> None:
    """An s3:// run folder is shared by machines; the default MLflow store (a SQLite file in one
    machine's working copy) is not. Say so before any work, not after the data path."""
    import os

    tracks = ("train" in stages and cfg.train.steps > 0) or ("shard" in stages and cfg.track_data)
    if store.uri and tracks and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise UserError(f"run folder {store.uri} is in object storage, so MLflow needs a server every node can "
                        "reach: set MLFLOW_TRACKING_URI (e.g. http://mlflow.internal:5000; infra/mlflow/serve.py "
                        "starts one), or set track_data: false and train.steps: 0")


def _cmd_train(args) -> int:
    args.until, args.only = None, "train"
    return _cmd_run(args)


def _cmd_run(args) -> int:
    from .config import load_config
    from .inspect_run import format_status, status_rows
    from .lock import run_lock
    from .ray_runtime import ray_session
    from .storage import RunStore
    from .runner import default_run_dir, preflight, run_pipeline, select

    cfg = load_config(args.config, args.overrides)
    select(args.until, args.only)  # fail on a bad stage name before starting anything
    preflight(cfg)
    store = RunStore(args.run_dir or cfg.run_dir or str(default_run_dir(cfg)))
    store.check()                  # a missing bucket or refused credentials: before any work
    _check_tracking(cfg, store, select(args.until, args.only))
    run_dir = store.local
    t0 = time.time()
    print(f"capline: run {cfg.name} in {store}" + (f" (working copy {run_dir})" if store.uri else ""), flush=True)
    with run_lock(run_dir, log=_say, uri=store.uri):
        store.pull(log=_say)
        if getattr(args, "incremental", False):
            from .runner import input_fingerprints
            from .schedule import plan

            needed, why = plan(input_fingerprints(cfg), run_dir)
            print(why, flush=True)
            if not needed:
                return 0
        with ray_session(cfg.ray, args.address, log=_say):
            run_pipeline(cfg, run_dir, until=args.until, only=args.only, log=_say,
                         store=store)
    print()
    print(format_status(status_rows(run_dir)))
    summary = run_dir / "eval" / "summary.txt"
    if summary.is_file() and args.only in (None, "eval"):
        print("\n" + summary.read_text().rstrip())
    from .report import write_report

    print(f"\ncapline: finished in {time.time() - t0:.0f}s; run folder {run_dir.resolve()}")
    print(f"report: {write_report(run_dir, storage=store.storage())}")
    store.push_top()
    if (run_dir / "mlflow.db").is_file():
        print(f"MLflow: .venv/bin/mlflow ui --backend-store-uri sqlite:///{(run_dir / 'mlflow.db').resolve()} "
              "(then open http://127.0.0.1:5000)")
    return 0


def _cmd_ray(args) -> int:
    """`ray start` with capline's environment: the node's processes and every worker they start
    inherit it (offline.apply() set the quiet switches and procenv in os.environ already)."""
    ray_bin = Path(sys.executable).parent / "ray"
    rest = [a for a in args.ray_args if a != "--"]
    head = "--head" in rest
    if head:
        offline.ray_auth(joining=False)
    elif os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    if "--disable-usage-stats" not in rest:
        rest.append("--disable-usage-stats")
    mode = os.environ.get("RAY_AUTH_MODE", "disabled")
    print(f"capline ray: ray start {' '.join(rest)} (token auth: {mode}"
          + (f", token {os.environ.get('RAY_AUTH_TOKEN_PATH') or 'from RAY_AUTH_TOKEN'}" if mode == "token" else "")
          + ")", flush=True)
    return subprocess.run([str(ray_bin if ray_bin.exists() else "ray"), "start", *rest], env=dict(os.environ)).returncode


def _cmd_verify(args) -> int:
    from .verify import compare_runs, verify_run

    run_dir = Path(args.run_dir)
    problems, n = verify_run(run_dir)
    for p in problems:
        print(f"{run_dir}: {p}")
    if not args.other:
        if not problems:
            print(f"{run_dir}: {n} shards match manifest.json")
        return 1 if problems else 0
    other = Path(args.other)
    problems_b, _ = verify_run(other)
    for p in problems_b:
        print(f"{other}: {p}")
    lines = compare_runs(run_dir, other)
    if not lines:
        print(f"identical: {run_dir} and {other} hold byte-identical shards ({n})")
    else:
        print(f"different: {len(lines)} differences")
        for line in lines[:200]:
            print("  " + line)
    return 1 if (problems or problems_b or lines) else 0


def _cmd_rebuild(args) -> int:
    import json
    import shutil

    from trainers.configtools import build

    from .config import RunConfig
    from .ray_runtime import ray_session
    from .runner import input_fingerprints, run_pipeline
    from .verify import compare_runs, drift

    path = Path(args.manifest)
    path = path / "manifest.json" if path.is_dir() else path
    if not path.is_file():
        raise UserError(f"{args.manifest}: no manifest.json there")
    manifest = json.loads(path.read_text())
    cfg = build(RunConfig, manifest["config"])
    old_dir = path.parent
    new_dir = Path(args.run_dir) if args.run_dir else old_dir.with_name(old_dir.name + "-rebuild")
    if new_dir.resolve() == old_dir.resolve():
        raise UserError("rebuild into another --run-dir: the rebuild is compared with the original")
    if input_fingerprints(cfg) != manifest.get("inputs"):
        raise UserError(f"the inputs changed since {path} was written: {input_fingerprints(cfg)} != {manifest.get('inputs')}")
    if (old_dir / "source" / "_SUCCESS").is_file() and not (new_dir / "source").exists():
        shutil.copytree(old_dir / "source", new_dir / "source")  # the pinned URL list (and demo site)
    print(f"capline: rebuilding {old_dir} into {new_dir}", flush=True)
    with ray_session(cfg.ray, args.address, log=_say):
        run_pipeline(cfg, new_dir, log=_say)
    report = drift(old_dir, new_dir)
    (new_dir / "drift.json").write_text(json.dumps(report, indent=1))
    print(f"drift: {len(report['died'])} URLs died, {len(report['changed'])} changed content, "
          f"{len(report['revived'])} came back (details in {new_dir / 'drift.json'})")
    for kind in ("died", "changed", "revived"):
        for key in report[kind][:50]:
            print(f"  {kind:<8} {key}")
    lines = compare_runs(old_dir, new_dir)
    print("shards: byte-identical to the original" if not lines else f"shards: {len(lines)} samples differ")
    return 0


def main(argv: list[str] | None = None) -> int:
    offline.apply(ray_auth_for_local=False)   # decided below, once the arguments say whether we join
    from trainers.tracking import move_credentials_out_of_uri

    move_credentials_out_of_uri()
    parser = _parser()
    args = parser.parse_args(argv)
    # a cluster this run starts gets Ray's token auth; before anything imports Ray
    if args.command != "ray":   # `capline ray start` decides for the node it starts
        offline.ray_auth(joining=bool(getattr(args, "address", None) or os.environ.get("RAY_ADDRESS")))
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "status":
            from .inspect_run import format_status, status_rows

            print(format_status(status_rows(_local_run(args.run_dir))))
            return 0
        if args.command == "report":
            from .report import write_report

            print(write_report(_local_run(args.run_dir), args.per_reason))
            return 0
        if args.command == "explain":
            from .inspect_run import explain, format_explain

            print(format_explain(args.key, explain(Path(args.run_dir), args.key)))
            return 0
        if args.command == "experiment":
            from trainers.evaluation.experiment import run_experiment

            from .config import load_config
            from .ray_runtime import ray_session
            from .runner import default_run_dir

            cfg = load_config(args.config, args.overrides)
            run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
            with ray_session(cfg.ray, args.address, log=_say):
                path = run_experiment(run_dir, cfg.train, cfg.seed, tuple(args.models.split(",")), args.budget,
                                      log=_say)
            print(path.read_text())
            return 0
        if args.command == "eval":
            from trainers.evaluation.run import evaluate, summary

            ckpt = Path(args.checkpoint)
            if not (ckpt / "model.json").is_file():
                raise UserError(f"{ckpt}: not a capline model checkpoint (no model.json)")
            run_dir = Path(args.run_dir) if args.run_dir else ckpt.resolve().parent.parent
            try:
                shots = tuple(int(k) for k in args.shots.split(","))
            except ValueError:
                raise UserError(f"--shots {args.shots}: expected comma-separated integers, e.g. 1,5,10,25") from None
            print(summary(evaluate(ckpt, run_dir, [t.strip() for t in args.tasks.split(",") if t.strip()],
                                   shots=shots)))
            return 0
        if args.command == "verify":
            return _cmd_verify(args)
        if args.command == "rebuild":
            return _cmd_rebuild(args)
        if args.command == "ray":
            return _cmd_ray(args)
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
        print(f"capline: error: {_redact(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("capline: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
