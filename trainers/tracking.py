"""MLflow for training runs: the driver creates the run; rank 0 logs to it by run id.

Metrics are buffered and flushed with each checkpoint. After a worker failure Ray restarts from the
last checkpoint it registered, which can be older than the last flush; so on every (re)start rank 0
reads the highest step already logged and skips steps up to it (training is deterministic from a
checkpoint, so those values are the ones already logged). Every step is logged once, in one run.
The store is a local SQLite file under the run folder unless MLFLOW_TRACKING_URI names a server.
"""
from __future__ import annotations

import os
import time
from pathlib import Path


def tracking_uri(run_dir: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def start_run(uri: str, run_dir: Path, experiment: str, name: str, params: dict, tags: dict) -> str:
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        artifacts = (Path(run_dir) / "mlartifacts").resolve().as_uri() if uri.startswith("sqlite") else None
        exp_id = c.create_experiment(experiment, artifact_location=artifacts)
    else:
        exp_id = exp.experiment_id
    run = c.create_run(exp_id, run_name=name, tags=tags)
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        c.log_batch(run.info.run_id, params=items[i:i + 100])
    return run.info.run_id


def log_dataset(uri: str, run_id: str, name: str, digest: str, source: str) -> None:
    from mlflow.entities import Dataset, DatasetInput, InputTag

    ds = Dataset(name=name, digest=digest[:36], source_type="capline-webdataset", source=source)
    client(uri).log_inputs(run_id, datasets=[DatasetInput(ds, tags=[InputTag("mlflow.data.context", "training")])])


class MetricBuffer:
    """Collects (step, {name: value}) and writes them in one batch on flush(); skips logged steps."""

    def __init__(self, uri: str | None, run_id: str | None, key: str = "loss"):
        self.uri, self.run_id, self.rows = uri, run_id, []
        history = client(uri).get_metric_history(run_id, key) if run_id else []
        self.logged_through = max((m.step for m in history), default=0)

    def add(self, step: int, values: dict) -> None:
        if step <= self.logged_through:
            return
        now = int(time.time() * 1000)
        self.rows += [(k, float(v), now, step) for k, v in values.items()]

    def flush(self) -> None:
        if not self.rows or not self.run_id:
            self.rows = []
            return
        from mlflow.entities import Metric

        c = client(self.uri)
        metrics = [Metric(k, v, t, s) for k, v, t, s in self.rows]
        for i in range(0, len(metrics), 900):
            c.log_batch(self.run_id, metrics=metrics[i:i + 900])
        self.rows = []


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out
