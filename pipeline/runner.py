"""Run the stages in order, each at most once per input.

For each stage: its input digest is the hash of its fingerprint (config section, seed, input
files) and the previous stage's output digest. If `_SUCCESS` holds that digest, the stage is
skipped. Otherwise it runs: `_STARTED` records the digest first (a folder started under another
digest is wiped; under the same one its partial work is resumed), then the stage runs, the runner
checks in = kept + dropped against the previous stage's kept keys, and writes `ledger.parquet`,
`stats.json` and, last, `_SUCCESS` with the output digest (a hash of every output file).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from stages.base import KEPT, Stage, StageContext
from stages.basic import BasicStage
from stages.clip_score import ClipScoreStage
from stages.clip_score import preflight as clip_score_preflight
from stages.dedup import DedupStage
from stages.evaluate import EvalStage
from stages.dedup import preflight as dedup_preflight
from stages.ingest import IngestStage
from stages.language import LanguageStage
from stages.language import preflight as language_preflight
from stages.shard import ShardStage
from stages.tokenizer import TokenizerStage
from stages.train import TrainStage
from stages.source import SourceStage, check_url_list, file_sha256, partition_files
from trainers.errors import UserError

from . import audit
from .config import RunConfig, save_config
from .manifest import Manifest, write_json_atomic

STAGES: list[Stage] = [SourceStage(), IngestStage(), DedupStage(), BasicStage(), LanguageStage(), ClipScoreStage(),
                       TokenizerStage(), ShardStage(), TrainStage(), EvalStage()]
CONTROL_FILES = {"_SUCCESS", "_STARTED", "stats.json"}


def stage_names(stages: list[Stage] | None = None) -> list[str]:
    return [s.name for s in (stages or STAGES)]


def output_digest(stage_dir: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(stage_dir.rglob("*")):
        rel = path.relative_to(stage_dir)
        if not path.is_file() or rel.parts[0] == "_work" or rel.name in CONTROL_FILES:
            continue
        h.update(str(rel).encode() + b"\0" + file_sha256(path).encode() + b"\n")
    return h.hexdigest()


def read_marker(stage_dir: Path, name: str = "_SUCCESS") -> dict | None:
    path = stage_dir / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def check_invariant(stage: str, ledger_keys: list[str], verdicts: list[str], reasons: list[str],
                    upstream_kept: list[str] | None) -> dict:
    """in = kept + dropped, and exactly the upstream's kept samples came in. Returns the counts."""
    if len(set(ledger_keys)) != len(ledger_keys):
        raise RuntimeError(f"stage {stage}: a sample has more than one verdict")
    if upstream_kept is not None:
        came, got = set(upstream_kept), set(ledger_keys)
        if came != got:
            lost, extra = sorted(came - got), sorted(got - came)
            raise RuntimeError(f"stage {stage}: {len(lost)} samples entered without a verdict "
                               f"(e.g. {lost[:3]}), {len(extra)} verdicts for samples that never "
                               f"entered (e.g. {extra[:3]})")
    kept = sum(v == KEPT for v in verdicts)
    dropped = Counter(r for v, r in zip(verdicts, reasons) if v != KEPT)
    if kept + sum(dropped.values()) != len(ledger_keys):
        raise RuntimeError(f"stage {stage}: in != kept + dropped")
    return {"in": len(ledger_keys), "kept": kept, "dropped": dict(sorted(dropped.items()))}


def input_fingerprints(cfg: RunConfig) -> dict:
    if cfg.source.kind == "urls":
        return {"source": {"kind": "urls", "path": str(cfg.source.path),
                           "files": {f.name: file_sha256(f) for f in partition_files(cfg.source)}}}
    if cfg.source.kind == "openclipart":
        from stages import openclipart

        root = openclipart.svg_root(cfg.source.path)
        files = openclipart.list_svgs(root)
        return {"source": {"kind": "openclipart", "path": str(root), "files": len(files),
                           "digest": openclipart.tree_digest(root, files), "limit": cfg.source.limit}}
    return {"source": {"kind": cfg.source.kind, "seed": cfg.seed, "num_samples": cfg.source.num_samples}}


def preflight(cfg: RunConfig) -> None:
    """Checks that need no cluster, run before one starts: bad inputs fail in a second, not mid-run."""
    if cfg.source.kind == "urls":
        check_url_list(cfg.source)
    if cfg.source.kind == "openclipart":
        from stages.openclipart import svg_root

        svg_root(cfg.source.path)
    dedup_preflight(cfg.stages.dedup, None)
    language_preflight(cfg.stages.language)
    clip_score_preflight(cfg.stages.clip_score)
    for es in cfg.stages.dedup.eval_sets:
        if es.kind == "builtin" and es.path == "demo_heldout" and cfg.source.kind != "synthetic":
            raise UserError(f"stages.dedup.eval_sets: {es.name} (builtin demo_heldout) exists only for "
                            "source.kind synthetic; remove it or list your own evaluation sets")


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) if cfg.run_dir else Path("runs") / cfg.name


def select(until: str | None, only: str | None, stages: list[Stage] | None = None) -> set[str]:
    names = stage_names(stages)
    for flag, value in (("--until", until), ("--only", only)):
        if value is not None and value not in names:
            raise UserError(f"{flag} {value}: no such stage; stages are {', '.join(names)}")
    if only:
        return {only}
    if until:
        return set(names[: names.index(until) + 1])
    return set(names)


def run_pipeline(cfg: RunConfig, run_dir: Path, until: str | None = None, only: str | None = None,
                 log=print, stages: list[Stage] | None = None, store=None) -> dict:
    """Run (or resume) the selected stages. Returns {stage: stats}."""
    stages = stages or STAGES
    wanted = select(until, only, stages)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    manifest = Manifest.open(run_dir, cfg.to_dict(), cfg.digest(), cfg.seed, input_fingerprints(cfg))
    prev_digest = ""
    upstream: dict[str, Path] = {}
    upstream_kept: list[str] | None = None
    summary = {}
    for stage in stages:
        sdir = run_dir / stage.name
        in_digest = hashlib.sha256((stage.fingerprint(cfg) + prev_digest).encode()).hexdigest()
        marker = read_marker(sdir)
        if marker and marker.get("input_digest") == in_digest:
            log(f"{stage.name}: done before with the same input, skipped")
        elif stage.name not in wanted:
            if only:
                raise UserError(f"--only {only}: stage {stage.name} before it has not finished; "
                                f"run `capline run --until {stage.name}` first")
            break
        else:
            marker, artifacts = _run_stage(stage, cfg, run_dir, sdir, in_digest, upstream, upstream_kept, log,
                                           store.location if store is not None and store.uri else None)
            manifest.record_stage(stage.name, marker, artifacts)
            if artifacts.get("mlflow_run_id"):
                manifest.data["mlflow_runs"][stage.name] = artifacts["mlflow_run_id"]
                manifest.save()
            if store is not None:
                store.push(stage.name, log)
        stats = json.loads((sdir / "stats.json").read_text())
        summary[stage.name] = stats
        ledger = pq.read_table(sdir / "ledger.parquet", columns=["key", "verdict"]).to_pydict()
        upstream_kept = [k for k, v in zip(ledger["key"], ledger["verdict"]) if v == KEPT]
        upstream[stage.name] = sdir
        prev_digest = marker["output_digest"]
        if stage.name == "shard" and cfg.track_data:
            from .data_tracking import log_data_build

            log_data_build(run_dir, manifest, summary, cfg, log)
        if until == stage.name or only == stage.name:
            break
    else:
        # every stage finished: what a later `--incremental` run compares its source with
        manifest.data["completed"] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                      "inputs": input_fingerprints(cfg)}
        manifest.save()
    return summary


def _run_stage(stage: Stage, cfg: RunConfig, run_dir: Path, sdir: Path, in_digest: str,
               upstream: dict[str, Path], upstream_kept: list[str] | None, log, location=None) -> dict:
    started = read_marker(sdir, "_STARTED")
    if sdir.exists() and (started is None or started.get("input_digest") != in_digest):
        # made from other inputs: nothing in it can be trusted, except the stage's own
        # content-addressed caches (ingest's per-partition downloads)
        for child in sdir.iterdir():
            if child.name in stage.preserve:
                continue
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    sdir.mkdir(parents=True, exist_ok=True)
    (sdir / "_SUCCESS").unlink(missing_ok=True)
    write_json_atomic(sdir / "_STARTED", {"input_digest": in_digest})
    log(f"{stage.name}: running" + (" (resuming partial work)" if started else ""))
    t0 = time.time()
    ctx = StageContext(run_dir=run_dir, stage_dir=sdir, config=cfg, upstream=dict(upstream),
                       upstream_kept=upstream_kept, log=log, location=location)
    result = stage.run(ctx)
    table = result.ledger.table()
    counts = check_invariant(stage.name, table.column("key").to_pylist(),
                             table.column("verdict").to_pylist(), table.column("reason").to_pylist(),
                             upstream_kept)
    pq.write_table(table, sdir / "ledger.parquet")
    wall = time.time() - t0
    stats = {"stage": stage.name, **counts, "wall_seconds": round(wall, 3), **result.extra_stats}
    write_json_atomic(sdir / "stats.json", stats)
    marker = {"input_digest": in_digest, "output_digest": output_digest(sdir),
              "completed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json_atomic(sdir / "_SUCCESS", marker)
    dropped = ", ".join(f"{k}={v}" for k, v in counts["dropped"].items()) or "none"
    log(f"{stage.name}: {counts['in']} in, {counts['kept']} kept, dropped: {dropped} ({wall:.1f}s)")
    if cfg.source.kind == "synthetic":
        audit.after_stage(stage.name, run_dir, log)
    return marker, result.artifacts
