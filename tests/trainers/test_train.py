"""End to end: Ray Train workers pretrain tiny CapPa and CLIP* from the pipeline's shards, tracked in
MLflow; a training worker killed mid-run is replaced and the job resumes from its checkpoint."""
import json
from pathlib import Path
import tempfile
import re
import os
import signal
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from pipeline.config import load_config
from pipeline.runner import run_pipeline
from helpers import capline

pytestmark = pytest.mark.slow

DATA = ["source.num_samples=500", "source.eval_size=30", "source.slow_seconds=3", "stages.ingest.timeout=2",
        "stages.shard.samples_per_shard=100", "train.model_args={width: 64, depth: 2, heads: 2, mlp: 128, patch: 8}",
        "train.image_size=32", "train.max_len=24", "train.global_batch=32", "train.num_workers=2",
        "train.loader_workers=1", "train.optim.warmup_steps=10", "stages.clip_score.bootstrap.steps=30"]


@pytest.fixture(scope="module")
def data_run(tmp_path_factory, ray_local):
    run = tmp_path_factory.mktemp("train") / "run"
    cache = run.parent / "cache"
    run_pipeline(load_config(None, DATA + [f"stages.dedup.cache_dir={cache}", "train.steps=0"]), run,
                 log=lambda m: None)
    return run, cache


def _history(client, run_id, key):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_cappa_and_clip_train_and_land_in_mlflow(data_run):
    run, cache = data_run
    ids = {}
    for model in ("cappa", "clip"):
        cfg = load_config(None, DATA + [f"stages.dedup.cache_dir={cache}", f"train.model={model}",
                                        "train.steps=200", "train.checkpoint_every=50", "train.sample_every=100",
                                        "train.system_metrics_every=1", "train.eval_every=100"])
        summary = run_pipeline(cfg, run, only="train", log=lambda m: None)
        ids[model] = summary["train"]["mlflow_run_id"]
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    for model, run_id in ids.items():
        r = client.get_run(run_id)
        assert r.data.params["train.model"] == model and r.data.params["train.global_batch"] == "32"
        assert r.info.status == "FINISHED"
        loss = _history(client, run_id, "loss")
        assert [s for s, _ in loss] == list(range(1, 201))            # every step, once
        first, last = sum(v for _, v in loss[:10]) / 10, sum(v for _, v in loss[-10:]) / 10
        assert last < 0.8 * first, (model, first, last)
        for key in ("lr", "examples_per_s", "tokens_per_s", "data_wait_fraction"):
            assert len(_history(client, run_id, key)) == 200
        # few-shot probes on the checkpoints of steps 100 and 200, run by Ray Train beside training
        during = sorted(k for k in r.data.metrics if k.startswith("train_eval.fewshot."))
        assert during and all([s for s, _ in _history(client, run_id, k)] == [100, 200] for k in during), during
        assert not list(run.glob("eval/capline-train-eval-*"))     # nothing in the run's own eval/ results
        # the node's own figures beside the training's, sampled every second while it trained
        assert {"system/node0/cpu_utilization_percentage", "system/node0/system_memory_usage_megabytes"} \
            <= set(r.data.metrics), sorted(r.data.metrics)
        arts = {a.path for a in client.list_artifacts(run_id)}
        assert {"model", "encoder", "tokenizer"} <= arts
        assert r.inputs.dataset_inputs and r.inputs.dataset_inputs[0].dataset.digest
    samples = {a.path for a in client.list_artifacts(ids["cappa"], "samples")}
    assert samples == {"samples/step_000100.txt", "samples/step_000200.txt"}
    # the exported encoder loads with nothing but safetensors
    from safetensors.torch import load_file

    enc = load_file(str(run / "train" / "export" / "encoder.safetensors"))
    meta = json.loads((run / "train" / "export" / "encoder.json").read_text())
    assert enc["pos"].shape[-1] == meta["width"] == 64 and "blocks.0.attn.q.weight" in enc


def test_killed_worker_is_replaced_and_training_resumes(data_run):
    run, cache = data_run
    cfg = load_config(None, DATA + [f"stages.dedup.cache_dir={cache}", "train.model=cappa", "train.steps=150",
                                    "train.checkpoint_every=25", "train.sample_every=0", "train.max_failures=2"])
    pids = run / "train" / "_pids"
    killed = {}

    def registered_step():
        for snap in (run / "train" / "ray").glob("*/checkpoint_manager_snapshot.json"):
            try:
                latest = json.loads(snap.read_text()).get("latest_checkpoint_result") or {}
                return latest.get("metrics", {}).get("step", 0)
            except ValueError:
                return 0
        return 0

    def killer():
        deadline = time.time() + 300
        while time.time() < deadline:
            # kill once Ray has registered a checkpoint, mid-run
            if registered_step() >= 50 and (pids / "rank1").is_file():
                pid = int((pids / "rank1").read_text())
                os.kill(pid, signal.SIGKILL)
                killed["pid"] = pid
                return
            time.sleep(0.3)

    for f in pids.glob("*") if pids.exists() else ():
        f.unlink()
    t = threading.Thread(target=killer, daemon=True)
    t.start()
    summary = run_pipeline(cfg, run, only="train", log=lambda m: None)
    t.join(timeout=5)
    assert killed, "the worker was never killed"
    assert int((pids / "rank1").read_text()) != killed["pid"]      # a new worker took rank 1
    assert summary["train"]["step"] == 150
    log = "\n".join(p.read_text() for p in (run / "train").glob("_resumed_from*"))
    assert "resumed from step" in log and "step 0" not in log                # not from scratch
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    steps = [s for s, _ in _history(client, summary["train"]["mlflow_run_id"], "loss")]
    assert steps == list(range(1, 151))                               # each step logged once


def test_bad_training_input_is_a_one_line_error(data_run, tmp_path):
    run, cache = data_run
    out = capline("train", "--run-dir", str(run), "--set", "train.global_batch=33", "--set", "train.steps=5")
    assert out.returncode == 2 and "train.global_batch" in out.stderr and "divisible" in out.stderr
    out = capline("train", "--run-dir", str(run), "--set", "train.steps=5", "--set",
                  "train.model_args={vocab_size: 32000}", "--set", f"stages.dedup.cache_dir={cache}", *sum(
                      (["--set", d] for d in DATA if not d.startswith("train.model_args")), []))
    assert out.returncode == 2 and "the tokenizer has" in out.stderr and "Traceback" not in out.stderr
    from infra.configtools import build
    from infra.errors import UserError
    from trainers.run import train
    from trainers.train_config import TrainConfig

    from stages.dataplane import Storage

    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no shards"):
        train(Storage.local(tmp_path), "empty", "tokenizer/spm.model", build(TrainConfig, {"steps": 5}), 0, "x",
              "out", tmp_path)


def test_main_job_ends_with_an_evaluated_model(data_run):
    run, cache = data_run
    args = sum((["--set", d] for d in DATA + [f"stages.dedup.cache_dir={cache}", "train.model=cappa",
                                              "train.steps=40", "train.checkpoint_every=20"]), [])
    # the job's temp folder, where the training workers' scratch goes: short, since Ray puts its
    # sockets under it too (an AF_UNIX path holds 107 bytes)
    tmp = Path(tempfile.mkdtemp(prefix="ct-", dir="/tmp"))
    out = capline("run", "--run-dir", str(run), *args, timeout=900, env={"TMPDIR": str(tmp)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "evaluation of cappa/tiny:" in out.stdout
    assert not list(tmp.glob("capline-train-*")), list(tmp.iterdir())   # removed when the loop ended
    for line in ("    demo_shape", "captioning demo greedy", "zero-shot demo_shape ar", "zero-shot demo_shape parallel",
                 "word order demo precision@1", "word order demo relation_order (pairwise)",
                 "word order demo_aro precision@1", "word order demo_aro shuffle_nouns_and_adj (pairwise)",
                 f"run folder {run.resolve()}", "mlflow ui --backend-store-uri"):
        assert line in out.stdout, line
    # the run's own MLflow page, not MLflow 3's welcome page: #/experiments/<id>/runs/<run id>
    manifest = json.loads((run / "manifest.json").read_text())
    assert re.search(rf"  train run: http://127\.0\.0\.1:5000/#/experiments/\d+/runs/{manifest['mlflow_runs']['train']}",
                     out.stdout), out.stdout[-1500:]
    results = json.loads(next((run / "eval").glob("train-cappa-tiny.json")).read_text())
    assert set(results["fewshot"]) >= {"demo_shape", "demo_count", "digits"}   # 30 held-out images: colour may not fit
    assert set(results["fewshot"]["digits"]) == {"1", "5", "10", "25"}
    assert any("left out" in n for n in results["skipped"])   # the small demo split cannot do 25-shot
    assert set(results["fewshot_map"]["digits"]) == {"10"}
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    run_id = (run / "train" / "mlflow_run_id").read_text().strip()
    assert "eval.fewshot.digits.linear.10shot" in client.get_run(run_id).data.metrics


def test_experiment_paper_writes_its_table(data_run):
    run, cache = data_run
    args = sum((["--set", d] for d in DATA + [f"stages.dedup.cache_dir={cache}"]), [])
    out = capline("experiment", "paper", "--run-dir", str(run), "--budget", "smoke", "--models", "cap,clip",
                  *args, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = (run / "paper_table.md").read_text()
    assert "| Cap |" in table and "| CLIP* |" in table and "| linear digits | MAP digits |" in table
    assert "CIDEr demo own | CIDEr demo LiT" in table and "word order demo P@1 |" in table
    assert (run / "paper_curves.png").is_file()
    cap = next(ln for ln in table.splitlines() if ln.startswith("| Cap |")).split("|")
    clip = next(ln for ln in table.splitlines() if ln.startswith("| CLIP* |")).split("|")
    head = [c.strip() for c in next(ln for ln in table.splitlines() if ln.startswith("| model |")).split("|")]
    assert "Trained with the CapPa paper's recipe (Adafactor, lr 1e-3, weight decay 1e-4" in table
    lit = head.index("CIDEr demo LiT")
    assert cap[lit].strip() != "-" and clip[lit].strip() != "-"      # every family gets a LiT-decoder CIDEr
    assert clip[head.index("CIDEr demo own")].strip() == "-"
    # what the numbers were measured on: the preprocessing and every set's split and size
    assert "Preprocessing: big_vision (fewshot: squash to size*256/224, central crop to size, bilinear;" in table
    assert "contrastive (cosine): CLIP's" in table
    assert "- fewshot digits: all 1797 images, no official split, test: eval.holdout of each class, 10 classes, whole" in table
    bad = capline("experiment", "paper", "--run-dir", str(run), "--budget", "huge", *args)
    assert bad.returncode == 2 and "--budget huge" in bad.stderr


def test_a_vit_size_reads_the_papers_input_size_unless_told():
    from trainers.run import model_config
    from trainers.train_config import TrainConfig

    assert model_config(TrainConfig(size="b16"), 1000).image_size == 224       # not 64: 4x4 patches
    assert model_config(TrainConfig(size="tiny"), 1000).image_size == 64
    assert model_config(TrainConfig(size="b16", image_size=384), 1000).image_size == 384


def test_ctrl_c_during_training_says_interrupted_and_exits_130(data_run):
    """Ray Train takes SIGINT for itself during fit(); capline train still ends like every other
    stage on Ctrl-C: one line saying how to resume, exit 130 (it used to exit 1 saying nothing)."""
    import subprocess
    import sys

    from helpers import ROOT

    run, cache = data_run
    progress = run / "train" / "progress.json"
    progress.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", "--run-dir", str(run), "--set", "train.steps=2000",
                             "--set", "train.checkpoint_every=1000", "--set", "train.sample_every=0",
                             "--set", f"stages.dedup.cache_dir={cache}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads(progress.read_text()).get("step", 0) >= 2:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, (proc.returncode, out[-1500:], err[-1500:])
    assert "capline: interrupted; rerun the same command to resume" in err


def test_changing_how_the_job_runs_or_extending_steps_resumes_the_same_run(data_run):
    """Every train.* setting was in the stage's fingerprint: a rerun with only max_failures changed
    started a new MLflow run at step 1 and deleted the checkpoints. How-settings (max_failures,
    loader_workers, checkpoint cadence) and more steps now go on from the last checkpoint, in the
    same MLflow run, each step logged once; a setting that decides (the model) starts anew. The job
    trains in fp16 (its loss scaler checkpointed and restored) and the resumed part with activation
    checkpointing, which changes nothing it decides."""
    import torch

    run, cache = data_run
    base = DATA + [f"stages.dedup.cache_dir={cache}", "train.model=cappa", "train.checkpoint_every=10",
                   "train.optim.warmup_steps=2", "train.precision=fp16"]
    first = run_pipeline(load_config(None, base + ["train.steps=20"]), run, only="train", log=lambda m: None)
    logs = []
    states = sorted((run / "train").rglob("train_state.pt"))
    assert states and all(torch.load(p, weights_only=True)["scaler"]["scale"] > 0 for p in states)
    again = run_pipeline(load_config(None, base + ["train.steps=30", "train.max_failures=-1", "train.loader_workers=0",
                                                   "train.checkpoint_every=15", "train.activation_checkpointing=true"]),
                         run, only="train", log=logs.append)
    run_id = first["train"]["mlflow_run_id"]
    assert again["train"]["mlflow_run_id"] == run_id and again["train"]["step"] == 30
    assert any(m.startswith("train: resuming MLflow run") for m in logs), logs
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    assert [s for s, _ in _history(client, run_id, "loss")] == list(range(1, 31))   # 21..30 added, none twice
    assert client.get_run(run_id).info.status == "FINISHED"
    # the same settings again: done, nothing trained
    logs.clear()
    run_pipeline(load_config(None, base + ["train.steps=30"]), run, only="train", log=logs.append)
    assert any(m.startswith("train: done before with the same input") for m in logs), logs
    # a deciding change after a job that never ended (what a killed driver leaves: the run RUNNING):
    # the new job marks the old run KILLED, since nothing will resume it, and says so
    client.update_run(run_id, "RUNNING")
    logs.clear()
    other = run_pipeline(load_config(None, base + ["train.steps=10", "train.model=clip"]), run, only="train",
                         log=logs.append)
    assert other["train"]["mlflow_run_id"] != run_id
    assert client.get_run(run_id).info.status == "KILLED"
    assert any(m.startswith(f"train: MLflow run {run_id} trained this folder") for m in logs), logs
    assert client.get_run(other["train"]["mlflow_run_id"]).info.status == "FINISHED"


def test_fsdp_trains_as_ddp_does_and_resumes_from_its_sharded_state(data_run):
    """train.parallel fsdp (FSDP2 over 2 gloo workers): the same losses as DDP step for step (one
    initialisation on every worker, the same data), its checkpoint gathered whole, and a job
    extended from 6 to 10 steps resumes it (weights and each worker's optimiser shard)."""
    run, cache = data_run
    base = DATA + [f"stages.dedup.cache_dir={cache}", "train.model=siglip", "train.checkpoint_every=3",
                   "train.optim.warmup_steps=2", "train.optim.lr=0.003"]
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    for steps in (6, 10):   # the same two jobs as below, so the schedule's change of shape is the same
        ddp = run_pipeline(load_config(None, base + [f"train.steps={steps}"]), run, only="train", log=lambda m: None)
    plain = _history(client, ddp["train"]["mlflow_run_id"], "loss")
    run_pipeline(load_config(None, base + ["train.steps=6", "train.parallel=fsdp"]), run, only="train", log=lambda m: None)
    logs = []
    fsdp = run_pipeline(load_config(None, base + ["train.steps=10", "train.parallel=fsdp"]), run, only="train",
                        log=logs.append)
    assert any(m.startswith("train: resuming MLflow run") for m in logs), logs
    sharded = _history(client, fsdp["train"]["mlflow_run_id"], "loss")
    assert [s for s, _ in sharded] == [s for s, _ in plain] == list(range(1, 11))
    assert all(abs(a - b) <= 1e-3 * abs(a) for (_, a), (_, b) in zip(plain, sharded)), (plain, sharded)
    assert plain[-1][1] < plain[0][1]
    from safetensors.torch import load_file

    assert "blocks.0.attn.q.weight" in load_file(str(run / "train" / "export" / "encoder.safetensors"))


def test_an_elastic_job_runs_on_the_workers_the_cluster_has_with_the_same_global_batch(data_run, tmp_path):
    """train.min_workers 1 with num_workers 4 on a 2-CPU cluster: Ray Train starts the worker group
    with the 2 it can place (no wait for 4), each takes half of the global batch, and the losses are a
    fixed 2-worker job's, step for step. The fixed job is torch.compiled (inductor, through Ray Train's
    DDP workers): the same losses as eager within float32 noise."""
    import shutil

    run, cache = data_run
    base = DATA + [f"stages.dedup.cache_dir={cache}", "train.model=clip", "train.steps=4", "train.global_batch=24",
                   "train.checkpoint_every=4", "train.optim.warmup_steps=2"]
    elastic_run = tmp_path / "run"
    shutil.copytree(run, elastic_run, ignore=lambda d, names: ["train"] if Path(d) == run else [])
    fixed = run_pipeline(load_config(None, base + ["train.compile=true"]), run, only="train", log=lambda m: None)
    logs = []
    elastic = run_pipeline(load_config(None, base + ["train.num_workers=4", "train.min_workers=1"]), elastic_run,
                           only="train", log=logs.append)
    assert any("on 1-4 workers as the cluster has them" in m for m in logs), logs
    assert json.loads((elastic_run / "train" / "final.json").read_text())["workers"] == 2
    losses = [_history(MlflowClient(f"sqlite:///{r / 'mlflow.db'}"), s["train"]["mlflow_run_id"], "loss")
              for r, s in ((run, fixed), (elastic_run, elastic))]
    assert [s for s, _ in losses[0]] == [s for s, _ in losses[1]] == [1, 2, 3, 4]
    assert all(abs(a - b) <= 1e-4 * abs(a) for (_, a), (_, b) in zip(*losses)), losses
