"""The `capline` command line."""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import os
import subprocess
import sys
import time
from pathlib import Path

from infra.errors import UserError

from infra import offline

from .trust import from_elsewhere

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
    _trust_code_option(p)


def _trust_code_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-code", action="append", default=[], metavar="FILE",
                   help="run this TorchScript file that a run folder's or manifest's config names (code runs when "
                        "it loads; a config from elsewhere never decides that alone; repeatable)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("capline")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _parser() -> argparse.ArgumentParser:
    from .runner import stage_names

    stages = stage_names()
    p = argparse.ArgumentParser(
        prog="capline", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Build image-text pretraining datasets from URL lists and train vision encoders on them.\n"
                    "Stages, in order: " + " -> ".join(stages))
    p.add_argument("--version", action="version", version=f"capline {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run (or resume) the pipeline on a config",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="Run the stages in order. A rerun with the same command skips "
                                     "finished stages and resumes an interrupted one.")
    _job_options(run, "run folder (default: the config's run_dir, else runs/<name>)")
    run.add_argument("--until", metavar="STAGE", help="stop after this stage: " + ", ".join(stages))
    run.add_argument("--only", metavar="STAGE",
                     help="run only this stage (earlier ones must be done): " + ", ".join(stages))
    run.add_argument("--incremental", action="store_true",
                     help="for scheduled runs: pick up source partitions added since the last completed run "
                          "(only they are downloaded); with nothing new, say so and do nothing")

    tr = sub.add_parser("train", help="pretrain on the shards of a run (the pipeline's train stage alone)",
                        description="Train the model of the config's `train:` section on the final shards "
                                    "in RUN_DIR with Ray Train workers, tracked in MLflow (SQLite under the "
                                    "run folder unless MLFLOW_TRACKING_URI is set). Rerunning resumes an "
                                    "interrupted job from its last checkpoint. With --run-dir and no "
                                    "CONFIG, the run folder's own config.yaml is used.")
    _job_options(tr, "the run whose shards to train on (default: the config's run folder)")

    ev = sub.add_parser("eval", help="evaluate a trained checkpoint (few-shot, captioning, zero-shot, word order)",
                        description="Run the paper's evaluations on a capline model checkpoint, on the datasets "
                                    "of the run's `eval:` config section (RUN_DIR/config.yaml); results go to "
                                    "RUN_DIR/eval/ as JSON and to the training's MLflow run.")
    ev.add_argument("checkpoint", metavar="CHECKPOINT", help="a model folder (e.g. runs/demo/train/model)")
    ev.add_argument("--tasks", default="fewshot,captioning,zeroshot,wordorder",
                    help="comma-separated: fewshot, captioning, zeroshot, wordorder (default: all)")
    ev.add_argument("--run-dir", help="the run with the tokenizer and held-out data (default: two folders up)")
    ev.add_argument("--json", action="store_true", help="print the results as JSON instead of the summary")
    ev.add_argument("--shots", default=None, help="few-shot sizes per class (default: the run's eval.shots, 1,5,10,25)")

    xp = sub.add_parser("experiment", help="the paper's comparison: Cap vs CapPa vs CLIP* on one run's shards",
                        description="Train Cap, CapPa and CLIP* (and --models siglip,coca,clipcap if asked) at the "
                                    "same size and number of examples on RUN_DIR's shards, evaluate each the same "
                                    "way (10-shot linear and MAP probes, own and LiT-decoder CIDEr, zero-shot, word "
                                    "order), and write RUN_DIR/paper_table.md and paper_curves.png (also in MLflow).")
    xp.add_argument("which", choices=["paper"], help="the experiment to run")
    _job_options(xp, "a run with finished shards (default: the config's run folder)")
    from trainers.evaluation.experiment import BUDGETS

    xp.add_argument("--budget", default="cpu-10min",
                    help=f"{', '.join(BUDGETS)} (default cpu-10min): model size, steps and batch of each training, "
                         "and of the LiT decoder, LiT text tower and MAP probe")
    xp.add_argument("--recipe", default="paper", choices=["paper", "config"],
                    help="paper (default): each model trains with its paper's optimiser (CapPa's big_vision Adafactor, "
                         "lr 1e-3, weight decay 1e-4; ClipCap's AdamW 2e-5); config: with the run config's train.optim")
    xp.add_argument("--clipcap-lm", default=None, metavar="FOLDER",
                    help="ClipCap's language model: a local Hugging Face GPT-2 folder, kept frozen under the transformer "
                         "mapper as in the paper (default: capline's own decoder, trained with the MLP mapper)")
    xp.add_argument("--models", default="cap,cappa,clip",
                    help="comma-separated families (default: cap,cappa,clip; also siglip, coca, and clipcap, "
                         "which trains on the experiment's frozen CLIP* encoder)")

    st = sub.add_parser("status", help="per-stage table: state, in, kept, dropped by reason, wall time")
    st.add_argument("run_dir", metavar="RUN_DIR", help="a run folder made by `capline run`")
    st.add_argument("--json", action="store_true", help="one JSON object per stage, as a list")

    rp = sub.add_parser("report", help="write RUN_DIR/report.html: funnel, score histograms, samples, curves, evaluation",
                        description="Write one self-contained HTML page for a finished (or partial) run: the "
                                    "funnel per stage, score histograms with the thresholds used, a grid of "
                                    "kept and dropped samples with captions and reasons, training curves from "
                                    "MLflow and the evaluation table. `capline run` writes it at the end too.")
    rp.add_argument("run_dir", metavar="RUN_DIR", help="a run folder made by `capline run`")
    rp.add_argument("--per-reason", type=int, default=6, help="samples shown per stage and reason (default 6)")

    ex = sub.add_parser("explain", help="the fate of one sample through every stage",
                        description="Each stage's verdict on one sample, with its reason, score and detail, up "
                                    "to the stage that dropped it; for a kept sample, the final shard and the "
                                    "byte offset of its first member.")
    ex.add_argument("run_dir", metavar="RUN_DIR", help="a run folder made by `capline run`")
    ex.add_argument("key", metavar="KEY", nargs="?", help="the sample's key (the key column of any ledger)")
    ex.add_argument("--url", help="find the sample by its URL instead of its key")
    ex.add_argument("--json", action="store_true", help="print the rows as JSON")

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
    rb.add_argument("--until", metavar="STAGE",
                    help="rebuild up to this stage (default: the last stage the original run finished; a data "
                         "build made with `--until shard` is rebuilt to its shards, never trained)")
    rb.add_argument("--address", help="Ray cluster to join (as for run)")
    _trust_code_option(rb)

    rm = sub.add_parser("remove", help="take items out of a published dataset line (takedowns, safety lists, opt-outs)",
                        description="Remove the samples a list names from a dataset line (a run with "
                                    "stages.shard.append: true): by URL, key, sha256 of the image bytes, or an image "
                                    "whose near copies go too. Only the shards holding a match are rewritten, the old "
                                    "ones kept under shard/line/versions/N/; the line, the manifest, the card and the "
                                    "MLflow data-build run record what went, why and when; every later run of the "
                                    "line drops what the list names before publishing.")
    rm.add_argument("run_dir", metavar="RUN_DIR", help="the dataset line's run folder (local or s3://)")
    rm.add_argument("--list", type=Path, metavar="FILE",
                    help="one entry a line: a URL, a key, a sha256, or an image path (relative to FILE); "
                         "`url `, `key `, `sha256 ` or `image ` before it says which; # starts a comment")
    rm.add_argument("--reason", help="why (recorded with every item removed)")
    rm.add_argument("--finish", action="store_true",
                    help="only finish a removal that was interrupted (killed, a node lost): `capline verify` names "
                         "one; any later remove, recheck or run of the line asks for this first")
    rm.add_argument("--threshold", type=float, default=None,
                    help="cosine of thumbnail descriptors above which an image entry matches a sample "
                         "(default: the run's stages.dedup.within_threshold)")
    rm.add_argument("--detail-threshold", type=float, default=None,
                    help="cosine of the finer detail descriptors a thumbnail match must also reach, so that a "
                         "picture that only looks alike (another product shot the same way) stays; 0: the "
                         "thumbnail alone (default: the run's stages.dedup.within_detail_threshold)")
    rm.add_argument("--address", help="Ray cluster to join (as for run)")

    rc = sub.add_parser("recheck", help="ask a dataset line's URLs again (robots.txt, X-Robots-Tag) and remove what opted out",
                        description="Every URL a dataset line published, asked again as politely as a download "
                                    "(robots.txt once per host, then a HEAD whose X-Robots-Tag is read, within each "
                                    "host's rate; hosts in parallel): those that opt out now are removed from the "
                                    "line (as `capline remove` does, with that reason); a URL that does not answer "
                                    "is counted, not removed. The report by host: shard/line/rechecks/N.json.")
    rc.add_argument("run_dir", metavar="RUN_DIR", help="the dataset line's run folder (local or s3://)")
    rc.add_argument("--address", help="Ray cluster to join (as for run)")

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
    it = sub.add_parser("init", help="write a config for a URL list, finding its URL and caption columns",
                        description="Look at the first rows of a Parquet, CSV, TSV or JSON-lines URL list, find "
                                    "the column of URLs and the column of captions (and a unique key column, if "
                                    "any), and write a run config for it that `capline run` takes.")
    it.add_argument("file", metavar="FILE_OR_FOLDER",
                    help="the URL list: a .parquet, .csv, .tsv, .jsonl or .json file (text ones plain or compressed: "
                         ".gz, .bz2, .zst), or a folder of such parts (LAION's, DataComp's, a dataset line's), "
                         "whose parts must share their columns")
    it.add_argument("--output", "-o", help="the config to write (default: configs/<file name>.yaml)")
    it.add_argument("--format", default="auto", choices=["auto", "parquet", "csv", "tsv", "jsonl"],
                    help="the list's format (default auto: from each file's suffix, compression suffix aside)")
    it.add_argument("--name", help="the run's name (default: from the file name)")
    ck = sub.add_parser("check", help="check a config before running it: settings, URL list columns, paths, models",
                        description="Every check `capline run` makes before it starts Ray or downloads anything: "
                                    "setting values and ranges, the URL lists' files and the columns the config "
                                    "names (with the closest names when one is missing), allow_hosts entries, "
                                    "evaluation sets, scorer and descriptor folders, the dataset line's settings. "
                                    "Exit 0 and one line when the config is ready, else one line naming the setting "
                                    "to change.")
    ck.add_argument("config", nargs="?", default=None, help="YAML run config (default: configs/demo.yaml)")
    ck.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value by dotted key, as for run")
    cf = sub.add_parser("config", help="every setting: its key, default (or the config's value) and meaning",
                        description="List every setting capline reads, as dotted keys for --set or YAML, with "
                                    "its default and one line of what it does. With CONFIG, the values that config "
                                    "sets are shown beside the defaults.")
    cf.add_argument("config", nargs="?", default=None, help="a YAML run config to show the values of")
    cf.add_argument("--grep", help="only the settings whose key or meaning contains this text")
    mo = sub.add_parser("models", help="model families and sizes, with parameter counts")
    mo.add_argument("--table", action="store_true",
                    help="count parameters of every family at every size (32k vocabulary, 224 px; tiny at "
                         "64 px) and compare with the paper's Table 1")
    return p


def _redact(text) -> str:
    from infra.tracking import redact

    return redact(text)


def _say(message: str) -> None:
    """The run's log lines: a password in a URI (a tracking server's) never reaches the terminal."""
    print(_redact(message), flush=True)


def _run_storage(where: str):
    """A run folder where it is, for the tools that read summaries and single rows (status, explain):
    a bucket is read in place, nothing is fetched."""
    from infra.storage import Storage

    from .storage import RunStore

    store = RunStore(where)
    if store.uri:
        store.check()
        return store.storage()
    return Storage.local(store.local)


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


def _config(args):
    """The config named, else (with --run-dir) the run folder's own config.yaml, else the demo's;
    with the command's --set overrides on top."""
    from .config import load_config

    if args.config is None and getattr(args, "run_dir", None):
        from .storage import RunStore

        store = RunStore(args.run_dir)
        saved = store.local / "config.yaml"
        if store.uri:
            store.check()   # a missing bucket or refused credentials: said as such, before anything else
            data = store.storage().read_bytes("config.yaml") if store.storage().exists("config.yaml") else None
            if data is not None:
                saved.parent.mkdir(parents=True, exist_ok=True)
                saved.write_bytes(data)
        if saved.is_file():
            print(f"capline: using {args.run_dir}'s own config ({saved})", flush=True)
            try:
                cfg = load_config(saved, args.overrides)
            except UserError as err:   # e.g. written by an older capline, with keys that have moved since
                raise UserError(f"{saved} (the run folder's own config) does not load: {err}; name the config "
                                f"to use: capline {args.command} CONFIG --run-dir {args.run_dir}") from None
            return from_elsewhere(cfg, f"{args.run_dir}'s config", args.overrides, getattr(args, "trust_code", ()),
                                  log=_say)
    return load_config(args.config, args.overrides)


def _detect_all(src: Path, fmt: str, detect) -> dict:
    """What init finds in a list file, or in every list file of a folder (LAION's, DataComp's and a
    dataset line's lists ship as folders of parts): the same URL and caption columns in each."""
    from stages.source.stage import SourceConfig, partition_files

    files = partition_files(SourceConfig(kind="urls", path=str(src))) if src.is_dir() else [src]
    founds = [detect(f, fmt) for f in files]
    first = founds[0]
    for f, d in zip(files[1:], founds[1:]):
        if (d["url_col"], d["caption_col"], d["key_col"]) != (first["url_col"], first["caption_col"], first["key_col"]):
            raise UserError(f"{f}: URLs in '{d['url_col']}', captions in '{d['caption_col']}', where {files[0].name} has "
                            f"'{first['url_col']}' and '{first['caption_col']}': a folder's parts are one list with "
                            "the same columns; move the odd one out")
    if len({d["format"] for d in founds}) > 1:
        first = {**first, "format": "auto"}     # each part read by its own suffix
    if len(files) > 1:
        print(f"capline init: {len(files)} list files in {src}, the same columns in each", flush=True)
    return first


def _cmd_train(args) -> int:
    args.until, args.only = None, "train"
    return _cmd_run(args)


def _cmd_run(args) -> int:
    from .inspect_run import format_status, status_rows
    from .lock import run_lock
    from infra.ray_runtime import ray_session
    from .storage import RunStore
    from .runner import check_before, default_run_dir, preflight, run_pipeline, select, trains

    cfg = _config(args)
    select(args.until, args.only)  # fail on a bad stage name before starting anything
    preflight(cfg)
    store = RunStore(args.run_dir or cfg.run_dir or str(default_run_dir(cfg)))
    store.check()                  # a missing bucket or refused credentials: before any work
    _check_tracking(cfg, store, select(args.until, args.only))
    if args.only:                  # the stages before it must be done, with this config: before lock and Ray
        if not store.storage().exists("manifest.json"):
            raise UserError(f"{store}: no capline run folder there (no manifest.json); check --run-dir, or build "
                            f"the data first with `capline run CONFIG --run-dir {store}`")
        check_before(cfg, store.storage(), args.only)
    run_dir = store.local
    t0 = time.time()
    print(f"capline: run {cfg.name} in {store}" + (f" (working copy {run_dir})" if store.uri else ""), flush=True)
    # two waits of seconds each overlap: the pull (requests to the bucket) with Ray's start (processes
    # starting), and the report (reads of stored summaries) with Ray's shutdown; an append spent 3.2 s
    # of its 30 s in them one after the other (200 partitions, S3 behind 25 ms)
    with run_lock(run_dir, log=_say, uri=store.uri), \
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="capline-driver") as aside:
        incremental = getattr(args, "incremental", False)
        pulled = None if incremental else aside.submit(store.pull, log=_say)
        if incremental:                # whether to run at all is read from what the pull brings
            from .runner import input_fingerprints
            from .schedule import plan

            store.pull(log=_say)
            needed, why = plan(input_fingerprints(cfg), run_dir)
            print(why, flush=True)
            if not needed:
                return 0
        from .report import write_report

        with ray_session(cfg.ray, args.address, log=_say, trains=trains(args.until, args.only)):
            if pulled is not None:
                pulled.result()
            run_pipeline(cfg, run_dir, until=args.until, only=args.only, log=_say,
                         store=store)
            reported = aside.submit(_timed, write_report, run_dir, storage=store.storage())
        # the report and manifest are the run's last writes: under the lock too
        print()
        print(format_status(status_rows(run_dir)))
        summary = run_dir / "eval" / "summary.txt"
        if summary.is_file() and args.only in (None, "eval"):
            print("\n" + summary.read_text().rstrip())
        from .data_tracking import log_report
        from .dataset_card import open_clip_args

        print(f"\ncapline: finished in {time.time() - t0:.0f}s; run folder {run_dir.resolve()}")
        report, seconds = reported.result()
        print(f"report: {report} ({seconds:.1f} s)")
        log_report(run_dir, Path(report), log=_say)
        manifest = json.loads((run_dir / "manifest.json").read_text())
        if open_clip_args(manifest):
            print(f"dataset card: {store.storage().uri('shard/README.md')}")
            from .dataset_card import open_clip_example

            print(f"open_clip: python -m open_clip_train.main {open_clip_args(manifest)} {open_clip_example(manifest)}")
        store.push_top()
    _print_mlflow_pages(run_dir)
    return 0


def _timed(fn, *args, **kwargs) -> tuple:
    """-> (fn's result, seconds it took)."""
    t = time.time()
    return fn(*args, **kwargs), time.time() - t


def _print_mlflow_pages(run_dir: Path) -> None:
    """How to open the run's MLflow runs: the UI command for a local store, then each run's own page."""
    from infra.tracking import redact, run_pages, tracking_uri

    uri = tracking_uri(run_dir)
    local = uri.startswith("sqlite:")
    if local and not (run_dir / "mlflow.db").is_file():
        return
    manifest = run_dir / "manifest.json"
    runs = {k: v for k, v in (json.loads(manifest.read_text()).get("mlflow_runs", {}) if manifest.is_file() else {}).items()
            if k in ("data", "train")}
    if local:
        mlflow = Path(sys.executable).parent / "mlflow"
        print(f"MLflow: {mlflow if mlflow.exists() else 'mlflow'} ui --backend-store-uri {uri}, then open:")
    for kind, page in run_pages(uri, runs, "http://127.0.0.1:5000" if local else redact(uri)).items():
        print(f"  {kind} run: {page}")


def _cmd_config(args) -> int:
    """`capline config [CONFIG]`: key = value  # meaning, for every setting."""
    import dataclasses

    from infra.configtools import describe_settings

    from .config import RunConfig, load_config

    values = {}
    if args.config:
        def flat(obj, prefix=""):
            for f in dataclasses.fields(obj):
                v, key = getattr(obj, f.name), f"{prefix}{f.name}"
                if dataclasses.is_dataclass(v):
                    flat(v, key + ".")
                else:
                    values[key] = v
        flat(load_config(args.config, []))
    for key, default, meaning in describe_settings(RunConfig):
        line = meaning.split(". ")[0].rstrip(".")
        if args.grep and args.grep.lower() not in f"{key} {line}".lower():
            continue
        shown = json.dumps(default, default=str)
        if key in values and values[key] != default:
            shown = f"{json.dumps(values[key], default=str)}  (default {shown})"
        print(f"{key} = {shown}" + (f"  # {line}" if line else ""))
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
    from infra.ray_runtime import node_env

    node_env()
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
            for line in _line_status(run_dir):
                print(line)
        return 1 if problems else 0
    other = Path(args.other)
    problems_b, _ = verify_run(other)
    for p in problems_b:
        print(f"{other}: {p}")
    lines = compare_runs(run_dir, other)
    if not lines and not (problems or problems_b):
        print(f"identical: {run_dir} and {other} hold byte-identical shards ({n})")
    elif not lines:
        print(f"not verified: the shard files of {run_dir} and {other} are the same bytes, "
              "but not the bytes their manifests recorded (see above)")
    else:
        print(f"different: {len(lines)} differences")
        for line in lines[:200]:
            print("  " + line)
    return 1 if (problems or problems_b or lines) else 0


def _cmd_rebuild(args) -> int:
    import json

    from infra.configtools import build
    from infra.storage import is_uri

    from .config import RunConfig
    from infra.ray_runtime import ray_session
    from .runner import input_fingerprints, run_pipeline, select, stage_names, trains
    from .storage import RunStore
    from .verify import drift

    # the original: a run folder or its manifest, on a local disk or in a bucket
    where = str(args.manifest)
    where = where[: -len("/manifest.json")] if where.endswith("/manifest.json") else where
    if not is_uri(where) and Path(where).is_file():
        where = str(Path(where).parent)
    old = RunStore(where)
    old.check()
    manifest = old.storage().read_json("manifest.json")
    if manifest is None:
        raise UserError(f"{args.manifest}: no manifest.json there")
    cfg = from_elsewhere(build(RunConfig, manifest["config"]), str(args.manifest), (), args.trust_code, log=_say)
    new = RunStore(args.run_dir or (where.rstrip("/") + "-rebuild"))
    if str(new) == str(old) or (not new.uri and not old.uri and new.local.resolve() == old.local.resolve()):
        raise UserError("rebuild into another --run-dir: the rebuild is compared with the original")
    new.check()
    if input_fingerprints(cfg) != manifest.get("inputs"):
        raise UserError(f"the inputs changed since {args.manifest} was written: {input_fingerprints(cfg)} != "
                        f"{manifest.get('inputs')}")
    # what the original ran, no more: a data build (`--until shard`) is rebuilt to its shards, not
    # trained and evaluated on the way
    names = stage_names()
    finished = [n for n in names if n in manifest.get("stages", {})]
    until = args.until or (finished[-1] if finished else None)
    select(until, None)                       # an unknown --until is named with the stages there are
    if "ingest" not in finished or (until is not None and names.index(until) < names.index("ingest")):
        raise UserError(f"{args.manifest}: the original run did not finish downloading (ingest), so there is no "
                        "drift to report; rebuild a run that did, or give --until ingest or a later stage")
    print(f"capline: rebuilding {old} into {new}, up to {until}", flush=True)
    from .lock import run_lock

    new_dir = new.local
    with run_lock(new_dir, log=_say, uri=new.uri):
        src, dst = old.storage(), new.storage()
        if src.exists("source/_SUCCESS") and not dst.exists("source/_SUCCESS"):
            # the pinned URL list (and the demo's site), object by object: where the original lives
            for rel in src.list("source", recursive=True):
                dst.write_bytes(rel, src.read_bytes(rel))
        new.pull(log=_say)
        with ray_session(cfg.ray, args.address, log=_say, trains=trains(until, None)):
            from .executor import Executor

            # the drift is known once the downloads are: said and written then, whatever comes after
            run_pipeline(cfg, new_dir, until="ingest", log=_say, store=new)
            report = drift(src, dst, Executor(log=_say))
            report["original"] = str(old)
            dst.write_both(new_dir, "drift.json", json.dumps(report, indent=1).encode())
            _say_drift(report, new)
            # the card and the MLflow data-build run name what this rebuilt and its drift
            _record_rebuild(new_dir, old, manifest, report)
            shard_at = names.index("shard")
            if until != "ingest":
                run_pipeline(cfg, new_dir, until=until if names.index(until) <= shard_at else "shard", log=_say,
                             store=new)
            # the shards compared as soon as they exist, whatever comes after
            a, b = (s.read_json("shard/shards.json") for s in (src, dst))
            if a is not None and b is not None:
                report["shards"] = _compare_shards(a, b, src, dst, Executor(log=_say))
                dst.write_both(new_dir, "drift.json", json.dumps(report, indent=1).encode())
            if names.index(until) > shard_at:
                run_pipeline(cfg, new_dir, until=until, log=_say, store=new)
        new.push_top()
    return 0


def _record_rebuild(new_dir: Path, old, original: dict, report: dict) -> None:
    """The rebuild's origin and drift in its manifest, read by the dataset card and the MLflow
    data-build run when the shards are written."""
    import time

    from .manifest import Manifest
    import json

    path = new_dir / "manifest.json"
    m = Manifest(path, json.loads(path.read_text()))
    m.data["rebuild"] = {"of": str(old), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "original_digest": original.get("stages", {}).get("shard", {}).get("output_digest"),
                         "drift": report["counts"]}
    m.save()


def _compare_shards(a: list[dict], b: list[dict], src, dst, executor) -> dict:
    """Byte-identical shard files (by the sha256 each run recorded), else the samples compared one by
    one: a dataset line's appends sit in shards of their own, the rebuild lays the line out afresh."""
    from .verify import compare_samples

    if [(x["name"], x["sha256"]) for x in a] == [(x["name"], x["sha256"]) for x in b]:
        print("shards: byte-identical to the original (by the sha256 each run recorded)", flush=True)
        return {"byte_identical": True, "identical": True}
    got = compare_samples(src, dst, executor)
    if got["identical"]:
        print(f"shards: identical to the original sample by sample ({got['samples']} samples, the same bytes; "
              f"{len(a)} shards there, {len(b)} here)", flush=True)
    else:
        print(f"shards: {got['only_in_original'] + got['only_in_rebuild'] + got['changed']} samples differ "
              f"({got['only_in_original']} only in the original, {got['only_in_rebuild']} only in the rebuild, "
              f"{got['changed']} changed):", flush=True)
        for line in got["first"]:
            print(f"  {line}", flush=True)
    return {"byte_identical": False, **got}


def _line_status(storage) -> list[str]:
    """A dataset line's shards, runs and removals, for status and verify."""
    from infra.storage import Storage
    from stages.shard.line import read_line

    line = read_line(Storage.of(storage))
    if not line:
        return []
    out = [f"dataset line: {len(line.get('shards', []))} shards from {len(line.get('runs', []))} runs"]
    for r in line.get("removals") or []:
        out.append(f"  removal {r['removal']} at {r['at']}: {r['removed']} samples ({_redact(r['reason'])[:120]}); "
                   f"shards rewritten: {', '.join(r['shards']) or 'none'}; as they were: {r['versions']}/")
    return out


def _cmd_remove(args) -> int:
    from .remove import remove

    if args.finish == (args.list is not None) or (args.list is not None and args.reason is None):
        raise UserError("capline remove: give --list FILE and --reason TEXT, or --finish alone")
    r = remove(str(args.run_dir), args.list, args.reason, args.threshold, args.address, log=_say,
               detail_threshold=args.detail_threshold)
    if r is None:
        print("remove: no removal of this line is half done; nothing to finish", flush=True)
        return 0
    print(f"removal {r['removal']}: {r['removed']} samples removed ({', '.join(f'{n} {k}' for k, n in r['entries'].items() if n)} "
          f"entries); shards rewritten: {', '.join(r['shards']) or 'none'} (as they were: {r['versions']}/); "
          "later runs of the line drop what the list names", flush=True)
    for key in r["keys"][:50]:
        print(f"  removed {key}", flush=True)
    return 0


def _cmd_recheck(args) -> int:
    from .remove import recheck_line

    r = recheck_line(str(args.run_dir), args.address, log=_say)
    removed = (f"removed as removal {r['removal']} ({r['removed']} samples)" if r["removal"] else "nothing removed")
    print(f"recheck {r['recheck']}: {r['checked']} URLs on {len(r['hosts'])} hosts; {r['opted_out']} opt out now, "
          f"{removed}; {r['unreachable']} did not answer (kept)", flush=True)
    for host, c in sorted(r["hosts"].items(), key=lambda kv: -kv[1]["opted_out"])[:20]:
        print(f"  {host:<40} {c['checked']:>8} checked {c['opted_out']:>6} opted out {c['unreachable']:>6} no answer",
              flush=True)
    for url, why in list(r["urls"].items())[:50]:
        print(f"  {why:<40} {url}", flush=True)
    return 0


def _say_drift(report: dict, new) -> None:
    n = report["counts"]
    print(f"drift: {n['died']} URLs died, {n['changed']} changed content, {n['revived']} came back "
          f"(the first {report['listed']} of each in {new.storage().uri('drift.json')}, all in {report['all']})",
          flush=True)
    for kind in ("died", "changed", "revived"):
        for key in report[kind][:50]:
            print(f"  {kind:<8} {key}", flush=True)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # `capline status RUN | head`: the reader left; say nothing more (stdout is gone) and exit
        # as a killed writer would, without Python's flush error at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _main(argv: list[str] | None = None) -> int:
    offline.apply(ray_auth_for_local=False)   # decided below, once the arguments say whether we join
    from infra.tracking import move_credentials_out_of_uri

    move_credentials_out_of_uri()
    import logging

    # MLflow's and alembic's INFO lines (creating tables, ...) are not the run's news; MLflow resets
    # its loggers' level on import from MLFLOW_LOGGING_LEVEL
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")   # its bars would break capline's lines
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        # a cluster this run starts gets Ray's token auth; before anything imports Ray
        if args.command != "ray":   # `capline ray start` decides for the node it starts
            offline.ray_auth(joining=bool(getattr(args, "address", None) or os.environ.get("RAY_ADDRESS")))
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "status":
            from .inspect_run import format_status, status_rows

            storage = _run_storage(args.run_dir)
            rows = status_rows(storage)
            print(json.dumps(rows, indent=1) if args.json else format_status(rows))
            if not args.json:
                for line in _line_status(storage):
                    print(line)
            return 0
        if args.command == "report":
            from .report import write_report

            print(write_report(_local_run(args.run_dir), args.per_reason))
            return 0
        if args.command == "explain":
            from .inspect_run import explain, format_explain, key_of_url

            if bool(args.key) == bool(args.url):
                raise UserError("explain: give a KEY or --url URL (one of them)")
            run_dir = _run_storage(args.run_dir)
            key = args.key or key_of_url(run_dir, args.url)
            rows = explain(run_dir, key)
            print(json.dumps(rows, indent=1, ensure_ascii=True) if args.json else format_explain(key, rows))
            return 0
        if args.command == "experiment":
            from trainers.evaluation.experiment import run_experiment

            from infra.ray_runtime import ray_session
            from .runner import default_run_dir

            from trainers.evaluation.experiment import check_experiment

            cfg = _config(args)
            run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
            models = tuple(m.strip() for m in args.models.split(",") if m.strip())
            check_experiment(run_dir, models, args.budget, args.clipcap_lm)   # before a cluster starts
            from .lock import run_lock

            with run_lock(run_dir, log=_say), ray_session(cfg.ray, args.address, log=_say):
                path = run_experiment(run_dir, cfg.train, cfg.seed, models, args.budget, log=_say, eval_cfg=cfg.eval,
                                      recipe=args.recipe, clipcap_lm=args.clipcap_lm)
            print(path.read_text())
            return 0
        if args.command == "eval":
            from trainers.evaluation.run import evaluate, summary

            ckpt = Path(args.checkpoint)
            if not (ckpt / "model.json").is_file():
                raise UserError(f"{ckpt}: not a capline model checkpoint (no model.json)")
            run_dir = Path(args.run_dir) if args.run_dir else ckpt.resolve().parent.parent
            try:
                shots = tuple(int(k) for k in args.shots.split(",")) if args.shots else None
            except ValueError:
                raise UserError(f"--shots {args.shots}: expected comma-separated integers, e.g. 1,5,10,25") from None
            from .lock import run_lock

            with run_lock(run_dir, log=_say):   # evaluation writes into the run folder
                # progress on stdout before the summary; with --json, stdout is the JSON alone
                progress = sys.stderr if args.json else sys.stdout
                results = evaluate(ckpt, run_dir, [t.strip() for t in args.tasks.split(",") if t.strip()], shots=shots,
                                   log=lambda m: print(m, file=progress, flush=True))
                if (run_dir / "manifest.json").is_file():   # the run's page shows what was just measured
                    from .report import write_report

                    print(f"report: {write_report(run_dir)} (refreshed with this evaluation)", file=progress, flush=True)
            print(json.dumps(results, indent=1) if args.json else summary(results))
            return 0
        if args.command == "verify":
            return _cmd_verify(args)
        if args.command == "rebuild":
            return _cmd_rebuild(args)
        if args.command == "remove":
            return _cmd_remove(args)
        if args.command == "recheck":
            return _cmd_recheck(args)
        if args.command == "ray":
            return _cmd_ray(args)
        if args.command == "config":
            return _cmd_config(args)
        if args.command == "check":
            from .config import load_config
            from .runner import preflight

            from .init_config import check_hosts

            cfg = load_config(args.config, args.overrides)
            preflight(cfg)
            from stages.dedup.eval_sets import caption_notes

            notes = check_hosts(cfg) + [n for es in cfg.stages.dedup.eval_sets for n in caption_notes(es)]
            for note in notes:   # the dry read of the lists' first rows init makes; the evaluation captions
                print(f"capline check: note: {note}")
            print(f"capline check: {args.config or 'the embedded demo config'} is ready to run ({cfg.name}: settings, inputs and "
                  "models checked; nothing downloaded, no cluster started)")
            return 0
        if args.command == "init":
            from .init_config import detect, write_config

            src = Path(args.file)
            if not src.exists():
                raise UserError(f"{src}: no such file or folder")
            found = _detect_all(src, args.format, detect)
            out = Path(args.output) if args.output else Path("configs") / f"{re.sub(r'[^A-Za-z0-9_-]+', '-', src.name)}.yaml"
            name = write_config(src, out, found, args.name)
            print(f"capline init: URLs in '{found['url_col']}', captions in '{found['caption_col']}'"
                  + (f", keys in '{found['key_col']}'" if found["key_col"] is not None else "")
                  + (" (no header: columns by position)" if not found.get("header", True) else "") + f"; wrote {out} (run {name})")
            if found.get("private_hosts"):
                print(f"capline init: note: the list names private or loopback hosts ({', '.join(found['private_hosts'][:5])}), "
                      f"which ingest refuses; {out} has the stages.ingest.allow_hosts line to uncomment if you trust them")
            if found.get("malformed"):
                from .init_config import malformed_note

                print(f"capline init: note: {malformed_note(found['malformed'])}")
            print(f"next: capline run {out}")
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
        print(f"capline: error: {_redact(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("capline: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except OSError as err:
        import errno

        if err.errno != errno.ENOSPC and "No space left on device" not in str(err):
            raise
        print(f"capline: error: no space left on the device holding {getattr(err, 'filename', None) or 'the run folder'}; "
              "free space or move --run-dir elsewhere, then rerun the same command to resume", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
