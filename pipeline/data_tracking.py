"""The data-build run in MLflow: what a dataset is, logged once per shard digest.

After the shard stage, capline logs a run to the experiment `capline-data`: the config hash, seed
and source as params; in / kept / dropped-by-reason of every stage as metrics; the manifest and every
stage's stats.json as artifacts; the shards as its dataset input. Its tag `capline.dataset_digest`
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
    from trainers.tracking import client, flatten, log_dataset, redact, start_run, tracking_uri

    digest = manifest.data["stages"]["shard"]["output_digest"]
    if manifest.data.get("mlflow_runs", {}).get("data") and manifest.data.get("mlflow_data_digest") == digest:
        return manifest.data["mlflow_runs"]["data"]
    uri = tracking_uri(run_dir)
    try:
        params = flatten({"config_hash": manifest.data["config_hash"], "seed": cfg.seed,
                          "source": {"kind": cfg.source.kind, "path": cfg.source.path}})
        run_id = start_run(uri, run_dir, EXPERIMENT, f"{cfg.name}-data", params,
                           {"capline.dataset_digest": digest, "capline.run_dir": str(Path(run_dir).resolve()),
                            "capline.kind": "data-build"})
        c = client(uri)
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for stage, stats in summary.items():
            metrics += [Metric(f"{stage}.in", stats["in"], now, 0), Metric(f"{stage}.kept", stats["kept"], now, 0)]
            metrics += [Metric(_metric_name(f"{stage}.dropped.{r}"), n, now, 0) for r, n in stats["dropped"].items()]
        for i in range(0, len(metrics), 900):
            c.log_batch(run_id, metrics=metrics[i:i + 900])
        log_dataset(uri, run_id, name=f"{Path(run_dir).name}-shards", digest=digest,
                    source=shards or str((Path(run_dir) / "shard" / "shards").resolve()))
        c.log_artifact(run_id, str(Path(run_dir) / "manifest.json"))
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
