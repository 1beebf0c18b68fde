"""MLflow for training runs: the driver creates the run; rank 0 logs to it by run id.

Metrics are buffered and flushed with each checkpoint. After a worker failure Ray restarts from the
last checkpoint it registered, which can be older than the last flush; so on every (re)start rank 0
reads the highest step already logged and skips steps up to it (training is deterministic from a
checkpoint, so those values are the ones already logged). Every step is logged once, in one run.
The store is a local SQLite file under the run folder unless MLFLOW_TRACKING_URI names a server.
"""
from __future__ import annotations

import os
import re
import urllib.parse
import time
from pathlib import Path


# the password runs to the *last* "@" of the word: raw passwords hold "/" and "@" (a URI should
# percent-encode them; people paste them as they are), and cutting short would print the rest
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^/@:\s]*):(?P<pw>\S*)@")


def redact(text) -> str:
    """Any `scheme://user:password@host` in `text` with the password replaced: for every URI capline
    writes (stats, manifests) or prints (logs, errors). A tracking URI may carry a password."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", str(text))


def move_credentials_out_of_uri(environ=os.environ) -> bool:
    """`MLFLOW_TRACKING_URI=https://user:pw@host` -> the URI without them, and MLflow's own
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD holding them: MLflow prints and stores the
    URI it is given (run links on stdout, run tags), the variables it only sends. Called first
    thing, before any process starts, so the processes capline starts inherit the split. -> moved."""
    uri = environ.get("MLFLOW_TRACKING_URI", "")
    parts = urllib.parse.urlsplit(uri)
    if not uri or parts.password is None and not parts.username:
        return False
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    environ.setdefault("MLFLOW_TRACKING_USERNAME", urllib.parse.unquote(parts.username or ""))
    if parts.password is not None:
        environ.setdefault("MLFLOW_TRACKING_PASSWORD", urllib.parse.unquote(parts.password))
    environ["MLFLOW_TRACKING_URI"] = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return True


def tracking_uri(run_dir: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


def client(uri: str):
    # a server that is down should cost seconds per call, not MLflow's default minutes of retries
    for key, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"), ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                       ("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")):
        os.environ.setdefault(key, value)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def run_pages(uri: str, run_ids: dict[str, str], ui: str) -> dict[str, str]:
    """kind -> the UI page of each run (`<ui>/#/experiments/<id>/runs/<run>`): where a person lands on
    the run itself, not on MLflow 3's welcome page two clicks away. Runs the store lacks are left out."""
    c = client(uri)
    out = {}
    for kind, run_id in run_ids.items():
        try:
            exp = c.get_run(run_id).info.experiment_id
        except Exception:  # noqa: BLE001 - a run removed from the store, or a store that is down
            continue
        out[kind] = f"{ui.rstrip('/')}/#/experiments/{exp}/runs/{run_id}"
    return out


# MLflow 3's UI opens an experiment in its GenAI overview ("Traces 0") unless the experiment says it
# is model training: then it opens on the runs table, where capline's runs are
EXPERIMENT_KIND, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"


def start_run(uri: str, run_dir: Path, experiment: str, name: str, params: dict, tags: dict,
              start_time: int | None = None) -> str:
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        artifacts = (Path(run_dir) / "mlartifacts").resolve().as_uri() if uri.startswith("sqlite") else None
        exp_id = c.create_experiment(experiment, artifact_location=artifacts, tags={EXPERIMENT_KIND: TRAINING_KIND})
    else:
        exp_id = exp.experiment_id
        if exp.tags.get(EXPERIMENT_KIND) is None:   # made by an older capline: the UI would guess
            c.set_experiment_tag(exp_id, EXPERIMENT_KIND, TRAINING_KIND)
    run = c.create_run(exp_id, run_name=name, tags=tags, start_time=start_time)
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        c.log_batch(run.info.run_id, params=items[i:i + 100])
    return run.info.run_id


def end_abandoned(uri: str, experiment: str, tags: dict) -> list[str]:
    """Mark KILLED the runs of `experiment` still RUNNING whose tags include all of `tags` (a
    training job whose folder a deciding change wiped: it will never be resumed, and MLflow would
    show it running forever). -> their ids. The run folder's lock keeps a live job from matching."""
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    ended = []
    for run in c.search_runs([exp.experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000):
        if all(run.data.tags.get(k) == v for k, v in tags.items()):
            c.set_terminated(run.info.run_id, status="KILLED")
            ended.append(run.info.run_id)
    return ended


def log_dataset(uri: str, run_id: str, name: str, digest: str, source: str, context: str = "training") -> None:
    """The shards as a dataset of the run: context "training" for a run that trained on them,
    "output" for the data-build run that made them."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    ds = Dataset(name=name, digest=digest[:36], source_type="capline-webdataset", source=source)
    client(uri).log_inputs(run_id, datasets=[DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)])])


class MetricBuffer:
    """Collects (step, {name: value}) and writes them in one batch on flush(); skips logged steps.

    An MLflow server that is down must not stop training: a failed flush keeps its values and says
    so once; the next flush retries and says when it caught up. `close()` makes a last attempt and
    saves whatever could not be logged to a JSON-lines file, so what was lost is named, not dropped.
    """

    def __init__(self, uri: str | None, run_id: str | None, key: str = "loss", log=print):
        self.uri, self.run_id, self.key, self.rows, self.log = uri, run_id, key, [], log
        self.logged_through: int | None = None
        self.failing_since: str | None = None
        self._sync_logged()

    def _sync_logged(self) -> None:
        if self.logged_through is not None or not self.run_id:
            self.logged_through = self.logged_through or 0
            return
        try:
            history = client(self.uri).get_metric_history(self.run_id, self.key)
            self.logged_through = max((m.step for m in history), default=0)
        except Exception as err:  # noqa: BLE001 - unknown until the server answers; flush asks again
            self._failed(err)

    def add(self, step: int, values: dict) -> None:
        if self.logged_through is not None and step <= self.logged_through:
            return
        now = int(time.time() * 1000)
        self.rows += [(k, float(v), now, step) for k, v in values.items()]

    def flush(self) -> bool:
        """Log what is held; -> True when nothing is left to log."""
        if not self.rows or not self.run_id:
            self.rows = []
            return True
        from mlflow.entities import Metric

        try:
            self._sync_logged()
            if self.logged_through is None:
                return False
            self.rows = [r for r in self.rows if r[3] > self.logged_through] if self.failing_since else self.rows
            c = client(self.uri)
            metrics = [Metric(k, v, t, s) for k, v, t, s in self.rows]
            for i in range(0, len(metrics), 900):
                c.log_batch(self.run_id, metrics=metrics[i:i + 900])
        except Exception as err:  # noqa: BLE001 - any failure to log is a logging failure, not a training one
            self._failed(err)
            return False
        if self.failing_since:
            self.log(f"mlflow: reachable again; logged the {len(self.rows)} values held since step {self.failing_since}")
            self.failing_since = None
        self.logged_through = max([self.logged_through or 0] + [r[3] for r in self.rows])
        self.rows = []
        return True

    def _failed(self, err: Exception) -> None:
        if self.failing_since is None:
            first = min((r[3] for r in self.rows), default=None)
            self.failing_since = str(first) if first is not None else "the start"
            self.log(f"mlflow: could not log to {redact(self.uri)} ({type(err).__name__}: "
                     f"{redact(str(err).splitlines()[0][:160]) if str(err) else ''}); "
                     "training goes on, values are kept and retried at the next checkpoint")

    def close(self, spill: Path) -> dict:
        """Last attempt; -> {"unlogged": N, "steps": [first, last], "file": path} for what stays unlogged."""
        import json

        if self.flush():
            return {"unlogged": 0}
        spill = Path(spill)
        with open(spill, "a") as f:
            for k, v, t, s in self.rows:
                f.write(json.dumps({"key": k, "value": v, "timestamp": t, "step": s}) + "\n")
        steps = [r[3] for r in self.rows]
        info = {"unlogged": len(self.rows), "steps": [min(steps), max(steps)], "file": str(spill)}
        self.log(f"mlflow: {len(self.rows)} metric values of steps {min(steps)}..{max(steps)} could not be logged; "
                 f"saved to {spill} (capline logs them when the server is back and the run is repeated)")
        self.rows = []
        return info


def replay_unlogged(uri: str, run_id: str, spill: Path, log=print) -> int:
    """Log values a MetricBuffer saved while MLflow was down; the file goes when they are in. -> count."""
    import json

    from mlflow.entities import Metric

    spill = Path(spill)
    if not spill.is_file():
        return 0
    rows = [json.loads(line) for line in spill.read_text().splitlines() if line.strip()]
    c = client(uri)
    logged = {m.step for m in c.get_metric_history(run_id, "loss")}
    metrics = [Metric(r["key"], r["value"], r["timestamp"], r["step"]) for r in rows if r["step"] not in logged]
    for i in range(0, len(metrics), 900):
        c.log_batch(run_id, metrics=metrics[i:i + 900])
    spill.unlink()
    log(f"mlflow: logged {len(metrics)} metric values saved while the server was down")
    return len(metrics)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out
