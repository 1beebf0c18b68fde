"""`capline experiment paper`: Cap vs CapPa vs CLIP* (and SigLIP / CoCa on request) on the same
shards, at the same model size and number of training examples, each evaluated the same way;
writes `paper_table.md` and logs it, with the learning curves, to MLflow.

Budgets scale the run: `smoke` (seconds: does everything run?), `cpu-10min` (tiny models, 300 steps of 32), `cpu-1h`, `cluster` (S/16 at
224 px, 20k steps of 1024 on GPUs).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from trainers.configtools import build
from trainers.errors import UserError

BUDGETS = {
    "smoke": {"size": "tiny", "image_size": 32, "steps": 30, "global_batch": 16,   # does it all run?
              "model_args": {"width": 32, "depth": 2, "heads": 2, "mlp": 64, "patch": 8}},
    "cpu-10min": {"size": "tiny", "image_size": 64, "steps": 300, "global_batch": 32,
                  "model_args": {"width": 96, "depth": 4, "heads": 4, "mlp": 384, "patch": 8}},
    "cpu-1h": {"size": "tiny", "image_size": 64, "steps": 2000, "global_batch": 64,
               "model_args": {"width": 128, "depth": 6, "heads": 4, "mlp": 512, "patch": 8}},
    "cluster": {"size": "s16", "image_size": 224, "steps": 20000, "global_batch": 1024, "model_args": {},
                "use_gpu": True},
}
NAMES = {"cap": "Cap", "cappa": "CapPa", "clip": "CLIP*", "siglip": "SigLIP", "coca": "CoCa"}


def run_experiment(run_dir: Path, train_cfg, seed: int, models=("cap", "cappa", "clip"), budget="cpu-10min",
                   log=print) -> Path:
    from trainers.models.checkpoint import load_model
    from stages.dataplane import Storage
    from trainers.run import train
    from trainers.train_config import TrainConfig

    from .run import evaluate

    if budget not in BUDGETS:
        raise UserError(f"--budget {budget}: choose one of {', '.join(BUDGETS)}")
    bad = [m for m in models if m not in NAMES]
    if bad:
        raise UserError(f"--models {','.join(bad)}: choose from {', '.join(NAMES)}")
    shards, tok = run_dir / "shard" / "shards", run_dir / "tokenizer" / "spm.model"
    if not shards.is_dir() or not tok.is_file():
        raise UserError(f"{run_dir}: no final shards and tokenizer; run `capline run --until shard` first")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    digest = manifest["stages"]["shard"]["output_digest"]
    rows, curves = [], {}
    for m in models:
        base = {k: v for k, v in dataclasses.asdict(train_cfg).items() if k not in ("optim",)}
        base.update(BUDGETS[budget], model=m, sample_every=0, experiment="capline-paper")
        tc = build(TrainConfig, {**base, "optim": dataclasses.asdict(train_cfg.optim)}, "train")
        out = run_dir / "experiment" / m
        log(f"experiment: training {NAMES[m]} ({tc.size}, {tc.steps} steps of {tc.global_batch})")
        t0 = time.perf_counter()
        result = train(Storage.local(run_dir), "shard/shards", "tokenizer/spm.model", tc, seed, digest,
                       f"experiment/{m}", run_dir, log=log)
        wall = time.perf_counter() - t0
        model, cfg = load_model(out / "model")
        params = sum(p.numel() for p in model.parameters())
        ev = evaluate(out / "model", run_dir, log=log, mlflow_run_id=result["mlflow_run_id"], strict=False)
        from trainers.tracking import client, tracking_uri

        c = client(tracking_uri(run_dir))
        curves[NAMES[m]] = [(x.step, x.value) for x in c.get_metric_history(result["mlflow_run_id"], "loss")]
        rows.append((NAMES[m], params, tc.steps * tc.global_batch / wall, ev))
    table = _table(rows)
    path = run_dir / "paper_table.md"
    path.write_text(f"# Cap vs CapPa vs CLIP* on {run_dir.name} (budget {budget})\n\n{table}\n")
    _log(run_dir, path, curves)
    return path


def _fmt(v, pct=True):
    return "-" if v is None else (f"{100 * v:.1f}" if pct else f"{v:.3f}")


def _table(rows) -> str:
    fewshot_sets = sorted({k for *_, ev in rows for k in ev.get("fewshot", {})})
    cats = ["relation_order", "attribute_swap", "added_object"]
    head = (["model"] + [f"10-shot {s}" for s in fewshot_sets] + ["CIDEr", "zero-shot"] +
            [f"word order: {c}" for c in cats] + ["params (M)", "train ex/s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, params, eps, ev in rows:
        fs = [ev.get("fewshot", {}).get(s, {}) for s in fewshot_sets]
        ten = [f.get(10, f.get("10", {})).get("mean") if f else None for f in fs]
        cider = ev.get("captioning", {}).get("greedy", {}).get("cider")
        zs = ev.get("zeroshot", {})
        zero = (zs.get("ar") or zs.get("cosine") or {}).get("accuracy")
        wo = [ev.get("wordorder", {}).get(c, {}).get("accuracy") for c in cats]
        cells = [name] + [_fmt(v) for v in ten] + [_fmt(cider, False), _fmt(zero)] + [_fmt(v) for v in wo] + \
                [f"{params / 1e6:.2f}", f"{eps:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _log(run_dir: Path, table: Path, curves: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainers.tracking import client, start_run, tracking_uri

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in curves.items():
        ax.plot([s for s, _ in pts], [v for _, v in pts], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    png = run_dir / "paper_curves.png"
    fig.savefig(png, dpi=100, bbox_inches="tight")
    uri = tracking_uri(run_dir)
    run_id = start_run(uri, run_dir, "capline-paper", "paper-table", {}, {"capline.run_dir": str(run_dir)})
    c = client(uri)
    c.log_artifact(run_id, str(table))
    c.log_artifact(run_id, str(png))
    c.set_terminated(run_id)
