"""Evaluation during training (`train.eval_every`): every so many steps Ray Train runs
`validate_checkpoint` as a task of its own on the checkpoint rank 0 just reported (ray.train's
ValidationConfig), beside training, never in the workers' step. It loads the checkpoint's weights
into the model, runs the run's few-shot probes (eval.fewshot; the closed-form linear probe, no MAP
head: seconds, not minutes) and, for the families that write, the run's captioning sets, and logs
their headline figures to the training's MLflow run at the checkpoint's step as `train_eval.*`
(the final evaluation's are `eval.*`, at step 0). Nothing is written to the run folder's eval/."""
from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path


def tasks_for(family: str) -> tuple[str, ...]:
    from .families import spec

    return ("fewshot", "captioning") if spec(family).writes else ("fewshot",)


def validate_checkpoint(checkpoint, run_dir: str, model, mlflow_uri: str, run_id: str) -> dict:
    """Ray Train's validation function: -> the metrics it logged (Ray keeps them with the checkpoint)."""
    import torch
    from mlflow.entities import Metric
    from safetensors.torch import load_file

    from infra.tracking import client

    from .evaluation.run import eval_rows, evaluate, run_eval_config
    from .models import build_model
    from .models.checkpoint import save_model

    torch.set_num_threads(1)    # beside the training workers, on a CPU Ray did not reserve for it
    ec = run_eval_config(Path(run_dir))
    ec = dataclasses.replace(ec, map_probe=dataclasses.replace(ec.map_probe, steps=0))
    with checkpoint.as_directory() as d, tempfile.TemporaryDirectory(prefix="capline-train-eval-") as tmp:
        step = json.loads((Path(d) / "meta.json").read_text())["step"]
        net = build_model(model)
        net.load_state_dict(load_file(str(Path(d) / "model.safetensors")), strict=False)
        saved = save_model(net, model, Path(tmp) / "model")
        results = evaluate(saved, Path(run_dir), tasks_for(model.family), log=lambda m: None, strict=False,
                           eval_cfg=ec, record=False)
    metrics = {}
    for r in eval_rows(results):
        if r["task"] == "few-shot":
            metrics[f"train_eval.fewshot.{r['dataset']}.{r['variant']}.{r['shots']}shot"] = float(r["value"])
        elif r["task"] == "captioning" and r["metric"] == "cider":
            metrics[f"train_eval.captioning.{r['dataset']}.{r['variant']}.cider"] = float(r["value"])
    now = int(time.time() * 1000)
    client(mlflow_uri).log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])
    return metrics
