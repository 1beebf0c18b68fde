"""`capline experiment paper`: Cap vs CapPa vs CLIP* (and SigLIP / CoCa on request) on the same
shards, at the same model size and number of training examples, each evaluated the same way;
writes `paper_table.md` and logs it, with the learning curves, to MLflow.

Budgets scale the run: `smoke` (seconds: does everything run?), `cpu-10min` (tiny models, 300 steps
of 32), `cpu-1h`, `cluster` (S/16 at 224 px, 20k steps of 1024 on GPUs), and with them the LiT
decoder, LiT text tower and MAP-head probe the evaluation trains. `--models ...,clipcap` adds
ClipCap on the frozen CLIP* encoder trained in the same experiment.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from infra.configtools import build
from infra.errors import UserError
from trainers.families import SPECS

# per budget: the training of each model, and the evaluations that train something on top of it
BUDGETS = {
    "smoke": {"size": "tiny", "image_size": 32, "steps": 30, "global_batch": 16,   # does it all run?
              "model_args": {"width": 32, "depth": 2, "heads": 2, "mlp": 64, "patch": 8}},
    "cpu-10min": {"size": "tiny", "image_size": 64, "steps": 300, "global_batch": 32,
                  "model_args": {"width": 96, "depth": 4, "heads": 4, "mlp": 384, "patch": 8}},
    "cpu-1h": {"size": "tiny", "image_size": 64, "steps": 2000, "global_batch": 64,
               "model_args": {"width": 128, "depth": 6, "heads": 4, "mlp": 512, "patch": 8}},
    "cluster": {"size": "s16", "image_size": 224, "steps": 20000, "global_batch": 1024, "model_args": {},
                "use_gpu": True},
    # one lent GPU for about 8 minutes (benchmarks/gpu.sh): S/16 at 224 px, 1,500 steps of 128 per model
    "gpu-8min": {"size": "s16", "image_size": 224, "steps": 1500, "global_batch": 128, "model_args": {},
                 "use_gpu": True, "num_workers": 1, "checkpoint_every": 500},
}
EVAL_BUDGETS = {
    "smoke": {"lit_decoder": {"steps": 10, "batch_size": 16}, "lit": {"steps": 10, "batch_size": 16},
              "map_probe": {"steps": 20}},
    "cpu-10min": {"lit_decoder": {"steps": 200, "batch_size": 32}, "lit": {"steps": 200, "batch_size": 64},
                  "map_probe": {"steps": 200}},
    "cpu-1h": {"lit_decoder": {"steps": 1000, "batch_size": 64}, "lit": {"steps": 1000, "batch_size": 128},
               "map_probe": {"steps": 300}},
    "cluster": {"lit_decoder": {"steps": 10000, "batch_size": 256}, "lit": {"steps": 10000, "batch_size": 1024},
                "map_probe": {"steps": 1000}},
    "gpu-8min": {"lit_decoder": {"steps": 300, "batch_size": 64}, "lit": {"steps": 300, "batch_size": 128},
                 "map_probe": {"steps": 200}},
}
NAMES = {name: s.title for name, s in SPECS.items()}


def check_experiment(run_dir: Path, models, budget: str, clipcap_lm: str | None = None) -> None:
    """Everything about the arguments and the run folder that can be wrong, before a cluster starts."""
    if clipcap_lm:
        from trainers.models.hf_lm import check_folder

        check_folder(clipcap_lm, "--clipcap-lm")
        if "clipcap" not in models:
            raise UserError("--clipcap-lm is ClipCap's language model: add clipcap (and clip) to --models")
    if budget not in BUDGETS:
        raise UserError(f"--budget {budget}: choose one of {', '.join(BUDGETS)}")
    bad = [m for m in models if m not in NAMES]
    if bad or not models:
        raise UserError(f"--models {','.join(bad) or '(none)'}: choose from {', '.join(NAMES)}")
    if "clipcap" in models and "clip" not in models:
        raise UserError("--models clipcap: ClipCap trains on the frozen CLIP* encoder of this experiment; add clip")
    shards, tok = run_dir / "shard" / "shards", run_dir / "tokenizer" / "spm.model"
    if not (run_dir / "shard" / "_SUCCESS").is_file() or not shards.is_dir() or not tok.is_file():
        raise UserError(f"{run_dir}: no final shards and tokenizer; run `capline run --until shard` first")


RECIPE_CHOICES = ("paper", "config")


def experiment_optim(model: str, steps: int, recipe: str, configured: dict) -> dict:
    """The optimiser a model trains with in the experiment. recipe "paper": the CapPa paper's (big_vision
    Adafactor, lr 1e-3, decay 1e-4 on every kernel, cosine) for every family but ClipCap, which keeps
    its own paper's (AdamW 2e-5, linear); warmup as the papers' share of their runs (10k of 650k
    steps; ClipCap 5k of its ~150k). recipe "config": the run config's train.optim as it is."""
    from trainers.train_config import RECIPES

    if recipe == "config":
        return configured
    if recipe not in RECIPE_CHOICES:
        raise UserError(f"--recipe {recipe}: choose one of {', '.join(RECIPE_CHOICES)}")
    name, share = ("clipcap", 5_000 / 150_000) if model == "clipcap" else ("paper", 10_000 / 650_000)
    return {**configured, **RECIPES[name]["optim"], "warmup_steps": max(1, round(steps * share))}


def run_experiment(run_dir: Path, train_cfg, seed: int, models=("cap", "cappa", "clip"), budget="cpu-10min",
                   log=print, eval_cfg=None, recipe: str = "paper", clipcap_lm: str | None = None) -> Path:
    from trainers.models.checkpoint import load_model
    from trainers.run import train
    from infra.storage import Storage
    from trainers.train_config import TrainConfig

    from .config import EvalConfig
    from .run import evaluate, run_eval_config

    check_experiment(run_dir, models, budget, clipcap_lm)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    digest = manifest["stages"]["shard"]["output_digest"]
    ec = dataclasses.asdict(eval_cfg or run_eval_config(run_dir))
    for key, values in EVAL_BUDGETS[budget].items():
        ec[key].update(values)
    ec = build(EvalConfig, ec, "eval")
    order = [m for m in models if m != "clipcap"] + (["clipcap"] if "clipcap" in models else [])
    rows, curves = [], {}
    for m in order:
        base = {k: v for k, v in dataclasses.asdict(train_cfg).items() if k not in ("optim",)}
        base.update(BUDGETS[budget], model=m, sample_every=0, experiment="capline-paper")
        optim = experiment_optim(m, base["steps"], recipe, dataclasses.asdict(train_cfg.optim))
        base["lm_path"] = None
        if m == "clipcap":   # on the frozen CLIP* encoder trained above
            base["image_encoder"] = str(run_dir / "experiment" / "clip" / "model")
            base["model_args"] = {k: v for k, v in base["model_args"].items() if k != "patch"}
            if clipcap_lm:   # the paper's lightweight ClipCap: a frozen pretrained LM, the transformer mapper
                base["lm_path"] = clipcap_lm
                base["model_args"] = {**base["model_args"], "mapper": "transformer"}
        tc = build(TrainConfig, {**base, "optim": optim}, "train")
        out = run_dir / "experiment" / m
        done = out / "experiment.json"   # a rerun reuses the models it finished, with the same budget
        if done.is_file() and json.loads(done.read_text()).get("budget") == budget and \
                json.loads(done.read_text()).get("optim") == optim:
            saved = json.loads(done.read_text())
            log(f"experiment: {NAMES[m]} done before with budget {budget}, reused")
            curves[NAMES[m]] = saved["curve"]
            rows.append((NAMES[m], saved["params"], saved["examples_per_s"], saved["eval"]))
            continue
        log(f"experiment: training {NAMES[m]} ({tc.size}, {tc.steps} steps of {tc.global_batch})")
        t0 = time.perf_counter()
        result = train(Storage.local(run_dir), "shard/shards", "tokenizer/spm.model", tc, seed, digest,
                       f"experiment/{m}", run_dir, log=log)
        wall = time.perf_counter() - t0
        model, cfg = load_model(out / "model")
        params = sum(p.numel() for p in model.parameters() if p.requires_grad or m != "clipcap")
        ev = evaluate(out / "model", run_dir, log=log, mlflow_run_id=result["mlflow_run_id"], strict=False,
                      eval_cfg=ec, seed=seed)
        from infra.tracking import client, tracking_uri

        c = client(tracking_uri(run_dir))
        curves[NAMES[m]] = [(x.step, x.value) for x in c.get_metric_history(result["mlflow_run_id"], "loss")]
        rows.append((NAMES[m], params, tc.steps * tc.global_batch / wall, ev))
        done.write_text(json.dumps({"budget": budget, "optim": optim, "params": params, "examples_per_s": rows[-1][2],
                                    "curve": curves[NAMES[m]], "eval": ev}))
    table = _table(rows)
    path = run_dir / "paper_table.md"
    recipe_line = ("the CapPa paper's recipe (Adafactor, lr 1e-3, weight decay 1e-4 on every kernel, cosine with "
                   "warmup; ClipCap: its paper's AdamW 2e-5)" if recipe == "paper" else
                   f"the run config's train.optim ({train_cfg.optim.name}, lr {train_cfg.optim.lr:g}, "
                   f"weight decay {train_cfg.optim.weight_decay:g})")
    path.write_text(f"# Cap vs CapPa vs CLIP* on {run_dir.name} (budget {budget})\n\nTrained with {recipe_line}.\n\n"
                    f"{table}\n\n"
                    "Few-shot: 10-shot accuracy (%) of the linear (big_vision fewshot_lsr) and MAP-head probes. "
                    "CIDEr (x100, as the papers print it): greedy, of the model's own decoder and of a LiT decoder trained on its frozen encoder. "
                    "Zero-shot (%): cos = the contrastive towers, ar/par = a captioner's autoregressive and "
                    "parallel scores, lit = a text tower trained against the frozen encoder. Word order (%): ARO's "
                    "precision@1, the true caption above all its perturbations at once.\n"
                    + _protocol(rows))
    _log(run_dir, path, curves)
    return path


def _protocol(rows) -> str:
    """What the numbers were measured on: the preprocessing, and each set's split and size (with
    any limit), from the evaluations' own records."""
    ev = next((r[3] for r in rows if r[3].get("preprocessing")), None)
    if not ev:
        return ""
    pre = ev["preprocessing"]
    lines = [f"\nPreprocessing: {pre['name']} ("
             + "; ".join(f"{task}: {how}" for task, how in pre.items() if task != "name") + ")."]
    # the sets by task (a captioning set and a word-order set may share a name)
    tasks = ("fewshot", "captioning", "zeroshot", "wordorder")   # (records of this session's first runs were flat: left out)
    for task, name, d in [(t, n, d) for t, sets in ev.get("sets", {}).items() if t in tasks
                          for n, d in sorted(sets.items())]:
        name = f"{task} {name}"
        if "images" in d and isinstance(d["images"], dict):
            sizes = ", ".join(f"{k} {v}" + (f" of {d['of'][k]}" if d["of"].get(k, v) != v else "")
                              for k, v in d["images"].items())
            split = "official split" if d["split"] == "official" else f"no official split, test: {d['split']}"
            lines.append(f"- {name}: {sizes} images, {split}, {d['classes']} classes"
                         + (f", limit {d['limit']} per split" if d.get("limit") else ", whole"))
        else:
            size = d.get("images", d.get("cases"))
            lines.append(f"- {name}: {size} {'images' if 'images' in d else 'cases'}"
                         + (f", split {d['split']}" if d.get("split") else "")
                         + (f", limit {d['limit']}" if d.get("limit") else ", whole"))
    return "\n".join(lines) + "\n"


def _fmt(v, pct=True):
    return "-" if v is None else (f"{100 * v:.1f}" if pct else f"{v:.1f}")


def _table(rows) -> str:
    from .run import eval_rows

    all_rows = [(name, params, eps, eval_rows(ev)) for name, params, eps, ev in rows]
    fewshot = sorted({r["dataset"] for *_, er in all_rows for r in er if r["task"] == "few-shot"})
    captioning = sorted({r["dataset"] for *_, er in all_rows for r in er if r["task"] == "captioning"})
    zeroshot = sorted({r["dataset"] for *_, er in all_rows for r in er if r["task"] == "zero-shot"})
    wordorder = sorted({r["dataset"] for *_, er in all_rows for r in er if r["task"] == "word order"})
    head = (["model"] + [f"{p} {s}" for s in fewshot for p in ("linear", "MAP")]
            + [f"CIDEr {s} {d}" for s in captioning for d in ("own", "LiT")]
            + [f"zero-shot {s} {v}" for s in zeroshot for v in ("cos", "ar", "par", "lit")]
            + [f"word order {s} P@1" for s in wordorder] + ["params (M)", "train ex/s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, params, eps, er in all_rows:
        def pick(task, dataset, variant, metric="accuracy", shots=None):
            for r in er:
                if (r["task"], r["dataset"], r["variant"], r["metric"]) == (task, dataset, variant, metric) and \
                        (shots is None or r["shots"] == shots):
                    return r["value"]
            return None

        cells = [name]
        cells += [_fmt(pick("few-shot", s, v, shots=10)) for s in fewshot for v in ("linear", "map")]
        cells += [_fmt(pick("captioning", s, v, "cider"), False) for s in captioning for v in ("greedy", "lit_greedy")]
        cells += [_fmt(pick("zero-shot", s, v)) for s in zeroshot for v in ("cosine", "ar", "parallel", "lit")]
        cells += [_fmt(pick("word order", s, "all", "precision@1")) for s in wordorder]
        cells += [f"{params / 1e6:.2f}", f"{eps:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _log(run_dir: Path, table: Path, curves: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from infra.tracking import client, start_run, tracking_uri

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
