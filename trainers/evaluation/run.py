"""`capline eval`: run the paper's evaluations on a trained checkpoint.

Tasks: `fewshot` (linear probe on frozen features: the demo's held-out labels, digits, and
Fashion-MNIST when installed), `captioning` (greedy and beam-4 on held-out images, CIDEr and
BLEU-4), `zeroshot` (class prompts scored by summed autoregressive log-likelihood and by one
parallel pass for captioners, cosine for contrastive models and CoCa), `wordorder` (relation
order, attribute swap, added object). Results go to `<run>/eval/<name>.json` and, when the run's
training is in MLflow, to that MLflow run.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from trainers.errors import UserError

TASKS = ("fewshot", "captioning", "zeroshot", "wordorder")


def _prep(images: list, size: int) -> torch.Tensor:
    out = []
    for im in images:
        arr = np.asarray(im)
        if arr.ndim == 2:
            arr = np.stack([arr] * 3, -1)
        im = Image.fromarray(arr.astype(np.uint8)).convert("RGB").resize((size, size), Image.BICUBIC)
        out.append(np.asarray(im, np.float32).transpose(2, 0, 1) / 127.5 - 1)
    return torch.from_numpy(np.stack(out))


@torch.no_grad()
def _features(model, images: torch.Tensor, batch: int = 128) -> np.ndarray:
    return torch.cat([model.image_features(images[i:i + batch]) for i in range(0, len(images), batch)]).numpy()


def _heldout(run_dir: Path):
    import pyarrow.parquet as pq

    from stages.synthetic import scene_from_json

    path = run_dir / "source" / "eval" / "eval.parquet"
    if not path.is_file():
        return None
    rows = pq.read_table(path).to_pylist()
    images = [Image.open(run_dir / "source" / "eval" / r["path"]).convert("RGB") for r in rows]
    return rows, images, [scene_from_json(r["scene"]) for r in rows]


def _encode(sp, texts: list[str], max_len: int, eos: bool) -> torch.Tensor:
    out = torch.zeros(len(texts), max_len, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = sp.encode(t)[: max_len - 1] + ([1] if eos else [])
        out[i, : len(ids)] = torch.tensor(ids)
    return out


def evaluate(model_dir: Path, run_dir: Path, tasks=TASKS, log=print, mlflow_run_id: str | None = None,
             shots: tuple[int, ...] = (1, 5, 10, 25), strict: bool = True) -> dict:
    """strict: asked shots that a dataset cannot serve are an error; else they are left out (noted)."""
    import sentencepiece as spm

    from trainers.models.checkpoint import load_model

    from .fewshot import probe
    from .textmetrics import caption_scores
    from .wordorder import word_order_eval

    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UserError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    model, cfg = load_model(model_dir)
    model.eval()
    tok = run_dir / "tokenizer" / "spm.model"
    if not tok.is_file():
        raise UserError(f"{run_dir}: no tokenizer/spm.model to evaluate with")
    sp = spm.SentencePieceProcessor(model_file=str(tok))
    held = _heldout(run_dir)
    writes = cfg.family in ("cap", "cappa", "coca")
    captioner = cfg.family in ("cap", "cappa")
    results: dict = {"model": cfg.family, "size": cfg.size, "checkpoint": str(model_dir)}
    timings = {}
    if "fewshot" in tasks:
        t0 = time.perf_counter()
        fs = {}
        sets = []
        if held:
            rows, images, _ = held
            feats = _features(model, _prep(images, cfg.image_size))
            for label in ("shape", "colour", "count"):
                sets.append((f"demo_{label}", feats, np.array([r[label] for r in rows])))
        from sklearn.datasets import load_digits

        d = load_digits()
        sets.append(("digits", _features(model, _prep(list((d.images * 255 / 16).astype(np.uint8)), cfg.image_size)),
                     d.target))
        from stages.eval_sets import FASHION_MNIST

        if FASHION_MNIST.is_file():
            from stages.eval_sets import EvalSetConfig, iter_images

            imgs = [im for _, im in zip(range(2000), (x for _, x in iter_images(
                EvalSetConfig(name="f", kind="builtin", path="fashion_mnist"), None)))]
            labels = _fashion_labels()[:2000]
            sets.append(("fashion_mnist", _features(model, _prep(imgs, cfg.image_size)), labels))
        for name, feats, labels in sets:
            values, counts = np.unique(labels, return_counts=True)
            fitting = tuple(k for k in shots if k < counts.min())
            if not strict and fitting != tuple(shots):
                results.setdefault("notes", []).append(
                    f"few-shot on {name}: {sorted(set(shots) - set(fitting))}-shot left out, a class has "
                    f"only {counts.min()} examples")
                if not fitting:
                    continue
                fs[name] = probe(feats, labels, shots=fitting)
                continue
            if max(shots) >= counts.min():
                raise UserError(f"few-shot on {name}: class {values[counts.argmin()]!r} has {counts.min()} examples, "
                                f"too few for {max(shots)}-shot (some must remain for testing); ask fewer --shots "
                                "or a larger held-out split (source.eval_size)")
            fs[name] = probe(feats, labels, shots=shots)
        results["fewshot"] = fs
        timings["fewshot"] = time.perf_counter() - t0
    if "captioning" in tasks and writes and held:
        from trainers.models.decoding import beam_search, greedy

        t0 = time.perf_counter()
        rows, images, _ = held
        x = _prep(images, cfg.image_size)
        refs = {r["id"]: [r["caption"]] for r in rows}
        out = {}
        for name, fn in (("greedy", lambda b: greedy(model, b, cfg.max_len)),
                         ("beam4", lambda b: beam_search(model, b, cfg.max_len, beam=4))):
            ids = torch.cat([fn(x[i:i + 64]) for i in range(0, len(x), 64)])
            cands = {r["id"]: sp.decode([int(t) for t in row if t > 1]) for r, row in zip(rows, ids)}
            out[name] = caption_scores(refs, cands)
            out[name]["examples"] = [[rows[i]["caption"], cands[rows[i]["id"]]] for i in range(3)]
        results["captioning"] = out
        timings["captioning"] = time.perf_counter() - t0
    if "zeroshot" in tasks and held:
        from stages.synthetic import COLOURS, SHAPES, SIZES

        rows, images, _ = held
        x = _prep(images, cfg.image_size)
        classes = list(SHAPES)
        prompts = [f"a {s} {c} {shape}" for shape in classes for s in SIZES for c in COLOURS]
        per = len(prompts) // len(classes)
        truth = np.array([classes.index(r["shape"]) for r in rows])
        zs = {}
        scorers = []
        if captioner:
            cands = _encode(sp, prompts, cfg.max_len, eos=False)
            scorers += [("ar", lambda: model.score_ar(x, cands), "logsumexp"),
                        ("parallel", lambda: model.score_parallel(x, cands), "logsumexp")]
        if cfg.family in ("clip", "siglip", "coca"):
            cands = _encode(sp, prompts, cfg.max_len, eos=True)
            scorers.append(("cosine", lambda: model.score(x, cands), "max"))
        for name, fn, agg in scorers:
            t0 = time.perf_counter()
            s = fn().reshape(len(rows), len(classes), per)
            s = torch.logsumexp(s, -1) if agg == "logsumexp" else s.max(-1).values
            zs[name] = {"accuracy": float((s.argmax(1).numpy() == truth).mean()),
                        "seconds_per_1000_images": (time.perf_counter() - t0) * 1000 / len(rows)}
        results["zeroshot"] = {"task": "demo shape (3 classes, 12 prompts each)", **zs}
    if "wordorder" in tasks and held and cfg.family != "clipcap":
        t0 = time.perf_counter()
        rows, images, scenes = held
        x = _prep(images, cfg.image_size)

        def score(i, caps):
            if captioner or cfg.family == "coca":
                return model.score_ar(x[i:i + 1], _encode(sp, caps, cfg.max_len, eos=True))[0].tolist()
            return model.score(x[i:i + 1], _encode(sp, caps, cfg.max_len, eos=True))[0].tolist()

        results["wordorder"] = word_order_eval(scenes, score)
        timings["wordorder"] = time.perf_counter() - t0
    results["seconds"] = timings
    out_dir = run_dir / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{Path(model_dir).resolve().parent.name}-{cfg.family}-{cfg.size}.json"
    path.write_text(json.dumps(results, indent=1))
    _log_to_mlflow(run_dir, results, path, log, mlflow_run_id)
    return results


def _fashion_labels() -> np.ndarray:
    import gzip

    from stages.eval_sets import FASHION_MNIST

    with gzip.open(FASHION_MNIST.with_name("t10k-labels-idx1-ubyte.gz")) as f:
        return np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)


def _log_to_mlflow(run_dir: Path, results: dict, path: Path, log, run_id: str | None) -> None:
    id_file = Path(results["checkpoint"]).parent / "mlflow_run_id"
    if run_id is None and not id_file.is_file():
        return
    from trainers.tracking import client, flatten, tracking_uri

    c = client(tracking_uri(run_dir))
    run_id = run_id or id_file.read_text().strip()
    metrics = {k: v for k, v in flatten({k: results[k] for k in TASKS if k in results}).items()
               if isinstance(v, (int, float)) and not k.endswith(".n")}
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    c.log_batch(run_id, metrics=[Metric(f"eval.{k}", float(v), now, 0) for k, v in metrics.items()][:1000])
    c.log_artifact(run_id, str(path), "eval")
    log(f"eval: logged {len(metrics)} results to MLflow run {run_id}")


def summary(results: dict) -> str:
    lines = [f"evaluation of {results['model']}/{results['size']}:"]
    for name, fs in results.get("fewshot", {}).items():
        best = 10 if 10 in fs else max(fs, key=lambda k: int(k))
        lines.append(f"  few-shot {name:<14} {best:>2}-shot {100 * fs[best]['mean']:5.1f}% (+-{100 * fs[best]['std']:.1f})")
    for name, r in results.get("captioning", {}).items():
        lines.append(f"  captioning {name:<7} CIDEr {r['cider']:.3f}  BLEU-4 {r['bleu4']:.3f}")
    for name, r in results.get("zeroshot", {}).items():
        if isinstance(r, dict):
            lines.append(f"  zero-shot {name:<8} {100 * r['accuracy']:5.1f}%  ({r['seconds_per_1000_images']:.2f}s / 1000 images)")
    for cat, r in results.get("wordorder", {}).items():
        lines.append(f"  word order {cat:<15} {100 * r['accuracy']:5.1f}% of {r['n']}")
    return "\n".join(lines)
