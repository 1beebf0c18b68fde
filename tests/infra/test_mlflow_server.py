"""A shared MLflow server (infra/mlflow/serve.py) on loopback: a pipeline logs its data-build run and
its training run there, linked by the dataset digest; the server going down mid-training costs no
step and no crash, and what cannot be logged is named."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from helpers import ROOT, capline, eval_index_cache
from infra.mlflow.serve import start, stop
from infra.tracking import MetricBuffer, client

BASE = ["--set", "source.num_samples=300", "--set", "source.eval_size=30", "--set", "stages.ingest.samples_per_shard=60",
        "--set", "stages.shard.samples_per_shard=100", "--set", "stages.clip_score.bootstrap.steps=30",
        "--set", f"stages.dedup.cache_dir={eval_index_cache()}", "--until", "train"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metric_buffer_survives_an_unreachable_server(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")   # refused at once: no backoff to wait out
    said = []
    buf = MetricBuffer(f"http://127.0.0.1:{_free_port()}", "0123456789abcdef", log=said.append)
    for step in (1, 2, 3):
        buf.add(step, {"loss": 1.0 / step})
    assert buf.flush() is False
    buf.add(4, {"loss": 0.2})
    info = buf.close(tmp_path / "unlogged.jsonl")
    assert info["unlogged"] == 4 and info["steps"] == [1, 4]
    lines = [json.loads(x) for x in (tmp_path / "unlogged.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert sum("could not log" in m for m in said) == 1          # said once, not at every flush
    assert any("steps 1..4 could not be logged" in m for m in said)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One MLflow server for the module: [process, url, root, port] (the down test restarts it)."""
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    proc, url = start(root / "server", port, log_file=root / "server.log")
    state = [proc, url, root, port]
    yield state
    stop(state[0])


@pytest.fixture(scope="module")
def data_run(server, tmp_path_factory):
    """The data pipeline, once, tracked on the server: the training tests start from its shards."""
    run_dir = tmp_path_factory.mktemp("data") / "run"
    out = capline("run", "--run-dir", str(run_dir), *BASE[:-2], "--until", "shard",
                  env={"MLFLOW_TRACKING_URI": _with_password(server[1])}, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "mlflow: data-build run" in out.stdout
    assert SECRET not in out.stdout + out.stderr
    return run_dir


SECRET = "s3cret-tr4cking-pw"


def _with_password(url: str) -> str:
    """The tracking URI as a user with a password in it writes it (the server here ignores it)."""
    return url.replace("http://", f"http://capline:{SECRET}@")


@pytest.mark.slow
def test_data_build_and_training_runs_linked_by_digest(server, data_run):
    url = server[1]
    args = ["run", "--run-dir", str(data_run), *BASE, "--set", "train.steps=20", "--set", "train.checkpoint_every=10",
            "--set", "train.sample_every=10"]
    out = capline(*args, env={"MLFLOW_TRACKING_URI": _with_password(url)}, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not (data_run / "mlflow.db").exists()               # everything went to the server
    # the password is in no log and no file of the run folder (stats, manifest, Ray Train's files)
    assert SECRET not in out.stdout + out.stderr
    leaked = [p for p in data_run.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert json.loads((data_run / "train" / "stats.json").read_text())["tracking_uri"] == url
    manifest = json.loads((data_run / "manifest.json").read_text())
    digest = manifest["stages"]["shard"]["output_digest"]
    c = client(url)
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()],
                         filter_string=f"tags.`capline.dataset_digest` = '{digest}'")
    kinds = {r.data.tags.get("capline.kind", "training"): r for r in runs}
    assert set(kinds) == {"data-build", "training"}, [r.data.tags for r in runs]
    data, train = kinds["data-build"], kinds["training"]
    assert data.info.run_id == manifest["mlflow_runs"]["data"] and train.info.run_id == manifest["mlflow_runs"]["train"]
    assert data.data.metrics["ingest.dropped.http_404"] > 0 and data.data.metrics["shard.kept"] > 0
    assert [m.step for m in c.get_metric_history(train.info.run_id, "loss")] == list(range(1, 21))
    assert {a.path for a in c.list_artifacts(train.info.run_id)} >= {"model", "encoder", "tokenizer", "config"}
    # the data-build run: every filter's thresholds, per-stage wall time and share kept, its files, its span
    assert data.data.params["stages.basic.min_words"] == "3" and "stages.language.min_confidence" in data.data.params
    assert data.data.params["stages.clip_score.keep_fraction"] and data.data.params["stages.dedup.eval_sets"]
    assert 0 < data.data.metrics["language.kept_fraction"] <= 1 and data.data.metrics["ingest.wall_seconds"] > 0
    assert {a.path for a in c.list_artifacts(data.info.run_id)} >= {"config.yaml", "README.md", "manifest.json",
                                                                   "report.html"}
    assert (data.info.end_time - data.info.start_time) / 1000 > 5     # the stages' time, not the logging's
    assert [t.value for i in data.inputs.dataset_inputs for t in i.tags if t.key == "mlflow.data.context"] == ["output"]
    assert [t.value for i in train.inputs.dataset_inputs for t in i.tags if t.key == "mlflow.data.context"] == ["training"]
    # the training run: where its code and data came from, a name of its own, the resolved config
    assert train.data.tags["capline.data_run_id"] == data.info.run_id
    assert len(train.data.tags["mlflow.source.git.commit"]) >= 40 and train.data.tags["mlflow.source.name"]
    import re

    assert re.fullmatch(r"cappa-tiny-\d{8}-\d{6}", train.info.run_name), train.info.run_name
    cfg = json.loads(open(c.download_artifacts(train.info.run_id, "config/train.json", str(data_run))).read())
    assert cfg["train"]["steps"] == 20 and cfg["model"]["family"] == "cappa"
    # evaluation: a table artifact and a few headline metrics, not one metric per number
    ev = capline("eval", str(data_run / "train" / "model"), "--tasks", "zeroshot,wordorder",
                 env={"MLFLOW_TRACKING_URI": url}, timeout=600)
    assert ev.returncode == 0, ev.stderr[-2000:]
    table = json.loads(open(c.download_artifacts(train.info.run_id, "eval/results_table.json", str(data_run))).read())
    assert set(table["columns"]) >= {"task", "dataset", "shots", "metric", "value"} and len(table["data"]) >= 4
    evals = {k for k in c.get_run(train.info.run_id).data.metrics if k.startswith("eval.")}
    assert "eval.wordorder.demo.precision_at_1" in evals and len(evals) <= 20, evals
    # the run's page and status show it: the report refreshed, the eval row no longer `pending`
    assert f"report: {data_run / 'report.html'} (refreshed with this evaluation)" in ev.stdout
    assert "word order" in (data_run / "report.html").read_text().lower()
    status = json.loads(capline("status", str(data_run), "--json").stdout)
    assert next(r for r in status if r["stage"] == "eval")["state"] == "evaluated"
    # a rerun of the finished folder logs nothing twice
    again = capline(*args, env={"MLFLOW_TRACKING_URI": url}, timeout=600)
    assert again.returncode == 0 and "mlflow: data-build run" not in again.stdout


@pytest.mark.slow
def test_server_down_mid_training_then_back(server, data_run, tmp_path):
    import shutil

    url = server[1]
    run_dir = tmp_path / "run"
    shutil.copytree(data_run, run_dir, ignore=shutil.ignore_patterns("train", "eval"))
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--run-dir", str(run_dir), *BASE, "--set", "train.steps=160",
           "--set", "train.checkpoint_every=10", "--set", "train.sample_every=0"]
    log = open(tmp_path / "capline.log", "w")
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, "MLFLOW_TRACKING_URI": url})
    try:
        id_file = run_dir / "train" / "mlflow_run_id"
        deadline = time.time() + 600
        while time.time() < deadline:
            if id_file.is_file() and client(url).get_metric_history(id_file.read_text().strip(), "loss"):
                break
            assert job.poll() is None, (tmp_path / "capline.log").read_text()[-3000:]
            time.sleep(1)
        else:
            pytest.fail("training never logged a step")
        stop(server[0])                     # the server goes down mid-training ...
        time.sleep(5)
        server[0], _ = start(server[2] / "server", server[3], log_file=server[2] / "server.log")   # ... and comes back
        assert job.wait(timeout=900) == 0, (tmp_path / "capline.log").read_text()[-3000:]
        text = (tmp_path / "capline.log").read_text()
        assert "mlflow: could not log" in text
        assert "mlflow: reachable again" in text or "mlflow: logged" in text
        run_id = id_file.read_text().strip()
        steps = [m.step for m in client(url).get_metric_history(run_id, "loss")]
        assert sorted(steps) == list(range(1, 161))                # every step once, none lost
        assert not (run_dir / "train" / "unlogged_metrics.jsonl").exists()
    finally:
        if job.poll() is None:
            job.kill()


def test_credentials_leave_the_tracking_uri_and_every_printed_uri():
    from infra.tracking import move_credentials_out_of_uri, redact

    env = {"MLFLOW_TRACKING_URI": "https://ann:p%40ss@mlflow.example:5000/base"}
    assert move_credentials_out_of_uri(env)
    assert env == {"MLFLOW_TRACKING_URI": "https://mlflow.example:5000/base", "MLFLOW_TRACKING_USERNAME": "ann",
                   "MLFLOW_TRACKING_PASSWORD": "p@ss"}
    assert not move_credentials_out_of_uri(env)        # nothing left to move
    assert redact("at https://u:pw@h:1/x, and postgresql://mlflow:PASS@db/mlflow") == \
        "at https://u:***@h:1/x, and postgresql://mlflow:***@db/mlflow"
    assert redact("s3://bucket/key and http://host/path") == "s3://bucket/key and http://host/path"


def test_serve_refuses_an_exposed_address_without_authentication(tmp_path):
    from infra.mlflow.serve import check_exposure

    out = subprocess.run([sys.executable, "-m", "infra.mlflow.serve", "--root", str(tmp_path), "--host", "0.0.0.0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "--host 0.0.0.0 would let anyone" in out.stderr and "--auth basic" in out.stderr
    assert not (tmp_path / "mlflow.db").exists()       # nothing started
    assert check_exposure("127.0.0.1", "none") is None and check_exposure("::1", "none") is None
    assert check_exposure("10.0.0.5", "proxy") is None and check_exposure("0.0.0.0", "basic") is None
    assert check_exposure("192.168.1.4", "none")


@pytest.mark.slow
def test_experiments_open_on_the_runs_table(tmp_path):
    """MLflow 3 opens an untagged experiment in its GenAI overview ("Traces 0"); capline's say they
    are model training, and an older capline's experiment gets the tag on its next run."""
    from infra.tracking import EXPERIMENT_KIND, start_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    start_run(uri, tmp_path, "capline-data", "r1", {}, {})
    assert client(uri).get_experiment_by_name("capline-data").tags[EXPERIMENT_KIND] == "custom_model_development"
    old = client(uri).create_experiment("older")
    start_run(uri, tmp_path, "older", "r2", {}, {})
    assert client(uri).get_experiment(old).tags[EXPERIMENT_KIND] == "custom_model_development"
