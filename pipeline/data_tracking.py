"""The data-build run in MLflow: what a dataset is, logged once per shard digest.

The run opens when the first stage of a run finishes (status RUNNING, named after the config hash)
and gets each stage's counts as that stage finishes, so a long download is visible while it runs;
an interrupted run is continued by the next one. After the shard stage it is completed in the
experiment `capline-data`: the config hash, seed,
source and every filter's thresholds (`stages.basic.min_words`, ...) as params; per stage in, kept,
kept fraction, dropped by reason and wall seconds as metrics; the manifest, the resolved config, the
dataset card and every stage's stats.json as artifacts (the run report is added when `capline run`
writes it); the shards as its dataset, in context "output". The run spans the stages' wall time. Its tag `capline.dataset_digest`
is the shard stage's output digest, the same tag the training runs on those shards carry: search
`tags.capline.dataset_digest = '<digest>'` to find both. If the server cannot be reached the run
goes on and says so; the next run of the folder logs it (nothing is recorded until it succeeds).
"""
from __future__ import annotations

import re
from pathlib import Path

EXPERIMENT = "capline-data"


def _metric_name(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z_\-. /]", "/", text)


LIVE = "data_live"      # manifest.data["mlflow_runs"][LIVE]: the data-build run open while stages run


def _params(manifest, cfg) -> dict:
    from infra.tracking import flatten

    from .dataset_card import thresholds

    params = flatten({"config_hash": manifest.data["config_hash"], "seed": cfg.seed,
                      "source": {"kind": cfg.source.kind, "path": cfg.source.path},
                      "stages": {k: {n: v for n, v in sec.items() if n != "eval_sets"}
                                 for k, sec in thresholds(cfg).items()}})
    params["stages.dedup.eval_sets"] = ",".join(e.name for e in cfg.stages.dedup.eval_sets)
    return params


def _tags(run_dir: Path, manifest) -> dict:
    return {"capline.run_dir": str(Path(run_dir).resolve()), "capline.kind": "data-build",
            "mlflow.source.git.commit": manifest.data.get("git_revision", ""),
            "mlflow.source.name": "capline run", "mlflow.source.type": "JOB"}


def _stage_metrics(stage: str, stats: dict, now: int) -> list:
    from mlflow.entities import Metric

    out = [Metric(f"{stage}.in", stats["in"], now, 0), Metric(f"{stage}.kept", stats["kept"], now, 0),
           Metric(f"{stage}.wall_seconds", stats.get("wall_seconds") or 0, now, 0)]
    if stats["in"]:
        out.append(Metric(f"{stage}.kept_fraction", stats["kept"] / stats["in"], now, 0))
    return out + [Metric(_metric_name(f"{stage}.dropped.{r}"), n, now, 0) for r, n in stats["dropped"].items()]


def log_stage(run_dir: Path, manifest, stage: str, stats: dict, cfg, log=print) -> str | None:
    """A stage that just ran, into the open data-build run (opened here by the first one). -> its id,
    or None when tracking is unreachable (said once; the final stage tries again)."""
    import time

    from infra.tracking import client, redact, start_run, tracking_uri

    runs = manifest.data.setdefault("mlflow_runs", {})
    if runs.get(LIVE) == "unreachable" or not stats:
        return None
    uri = tracking_uri(run_dir)
    try:
        if not runs.get(LIVE):
            runs[LIVE] = start_run(uri, run_dir, EXPERIMENT, f"{cfg.name}-data-{manifest.data['config_hash'][:8]}",
                                   _params(manifest, cfg), _tags(run_dir, manifest))
            manifest.save()
            log(f"mlflow: data-build run {runs[LIVE]} open at {redact(uri)}: each stage's counts as it finishes")
        client(uri).log_batch(runs[LIVE], metrics=_stage_metrics(stage, stats, int(time.time() * 1000)))
        return runs[LIVE]
    except Exception as err:  # noqa: BLE001 - tracking is not the data
        log(f"mlflow: no live data-build run at {redact(uri)} ({type(err).__name__}); the shard stage tries again")
        runs[LIVE] = "unreachable"
        return None


def log_data_build(run_dir: Path, manifest, summary: dict, cfg, log=print, shards: str | None = None) -> str | None:
    from infra.tracking import client, log_dataset, redact, start_run, tracking_uri

    digest = manifest.data["stages"]["shard"]["output_digest"]
    runs = manifest.data.setdefault("mlflow_runs", {})
    if runs.get("data") and manifest.data.get("mlflow_data_digest") == digest:
        return runs["data"]
    uri = tracking_uri(run_dir)
    try:
        import time

        now = int(time.time() * 1000)
        c = client(uri)
        live = runs.get(LIVE) if runs.get(LIVE) != "unreachable" else None
        if live:      # the run the stages logged into: it becomes this dataset's
            run_id = live
            c.set_tag(run_id, "capline.dataset_digest", digest)
            c.update_run(run_id, name=f"{cfg.name}-data-{digest[:8]}")
        else:
            began = now - int(1000 * sum(s.get("wall_seconds") or 0 for s in summary.values()))
            run_id = start_run(uri, run_dir, EXPERIMENT, f"{cfg.name}-data-{digest[:8]}", _params(manifest, cfg),
                               {"capline.dataset_digest": digest, **_tags(run_dir, manifest)}, start_time=began)
        metrics = [m for stage, stats in summary.items() if stats for m in _stage_metrics(stage, stats, now)]
        rebuilt = manifest.data.get("rebuild")
        if rebuilt:     # a rebuild names what it rebuilt and what had drifted on the web since
            from mlflow.entities import Metric

            c.set_tag(run_id, "capline.rebuild_of", str(rebuilt.get("of")))
            c.set_tag(run_id, "capline.rebuild_original_digest", str(rebuilt.get("original_digest")))
            metrics += [Metric(f"drift.{k}", v, now, 0) for k, v in sorted(rebuilt.get("drift", {}).items())]
        for i in range(0, len(metrics), 900):
            c.log_batch(run_id, metrics=metrics[i:i + 900])
        log_dataset(uri, run_id, name=f"{Path(run_dir).name}-shards", digest=digest,
                    source=shards or str((Path(run_dir) / "shard" / "shards").resolve()), context="output")
        c.log_artifact(run_id, str(Path(run_dir) / "manifest.json"))
        for extra in (Path(run_dir) / "config.yaml", Path(run_dir) / "shard" / "README.md"):
            if extra.is_file():
                c.log_artifact(run_id, str(extra))
        for stage in summary:
            c.log_artifact(run_id, str(Path(run_dir) / stage / "stats.json"), f"stats/{stage}")
        c.set_terminated(run_id)
    except Exception as err:  # noqa: BLE001 - tracking is not the data; say so and let the run go on
        log(f"mlflow: could not log the data-build run to {redact(uri)} ({type(err).__name__}: "
            f"{redact(str(err).splitlines()[0][:160]) if str(err) else ''}); the next run of this folder tries again")
        return None
    runs["data"] = run_id
    runs.pop(LIVE, None)
    manifest.data["mlflow_data_digest"] = digest
    manifest.save()
    log(f"mlflow: data-build run {run_id} at {redact(uri)} (dataset digest {digest[:12]})")
    return run_id


def log_report(run_dir: Path, report: Path, log=print) -> None:
    """The run report, once written, as an artifact of the data-build run (best effort)."""
    import json

    from infra.tracking import client, redact, tracking_uri

    manifest = json.loads((Path(run_dir) / "manifest.json").read_text())
    run_id = manifest.get("mlflow_runs", {}).get("data")
    if not run_id or not Path(report).is_file():
        return
    try:
        client(tracking_uri(run_dir)).log_artifact(run_id, str(report))
    except Exception as err:  # noqa: BLE001
        log(f"mlflow: report not logged to {redact(tracking_uri(run_dir))} ({type(err).__name__})")
