"""The data-build run in MLflow: what a dataset is, logged once per shard digest.

After the shard stage, capline logs a run to the experiment `capline-data`: the config hash, seed,
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


def log_data_build(run_dir: Path, manifest, summary: dict, cfg, log=print, shards: str | None = None) -> str | None:
    from infra.tracking import client, flatten, log_dataset, redact, start_run, tracking_uri

    digest = manifest.data["stages"]["shard"]["output_digest"]
    if manifest.data.get("mlflow_runs", {}).get("data") and manifest.data.get("mlflow_data_digest") == digest:
        return manifest.data["mlflow_runs"]["data"]
    uri = tracking_uri(run_dir)
    try:
        import time

        from mlflow.entities import Metric

        from .dataset_card import thresholds

        params = flatten({"config_hash": manifest.data["config_hash"], "seed": cfg.seed,
                          "source": {"kind": cfg.source.kind, "path": cfg.source.path},
                          "stages": {k: {n: v for n, v in sec.items() if n != "eval_sets"}
                                     for k, sec in thresholds(cfg).items()}})
        params["stages.dedup.eval_sets"] = ",".join(e.name for e in cfg.stages.dedup.eval_sets)
        now = int(time.time() * 1000)
        began = now - int(1000 * sum(s.get("wall_seconds") or 0 for s in summary.values()))
        run_id = start_run(uri, run_dir, EXPERIMENT, f"{cfg.name}-data-{digest[:8]}", params,
                           {"capline.dataset_digest": digest, "capline.run_dir": str(Path(run_dir).resolve()),
                            "capline.kind": "data-build", "mlflow.source.git.commit": manifest.data.get("git_revision", ""),
                            "mlflow.source.name": "capline run", "mlflow.source.type": "JOB"}, start_time=began)
        c = client(uri)
        metrics = []
        for stage, stats in summary.items():
            metrics += [Metric(f"{stage}.in", stats["in"], now, 0), Metric(f"{stage}.kept", stats["kept"], now, 0),
                        Metric(f"{stage}.wall_seconds", stats.get("wall_seconds") or 0, now, 0)]
            if stats["in"]:
                metrics.append(Metric(f"{stage}.kept_fraction", stats["kept"] / stats["in"], now, 0))
            metrics += [Metric(_metric_name(f"{stage}.dropped.{r}"), n, now, 0) for r, n in stats["dropped"].items()]
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
    manifest.data["mlflow_runs"]["data"] = run_id
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
