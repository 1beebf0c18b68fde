"""`capline eval`: the paper's evaluations of a trained checkpoint, on the datasets of the run's
`eval:` section (trainers/evaluation/config.py; files read by trainers/evaluation/datasets.py).

Tasks: `fewshot` (big_vision's closed-form linear probe on frozen features, and a MAP-head probe
on the frozen tokens), `captioning` (greedy and beam-4 CIDEr/BLEU-4 of the model's own decoder, and
of a LiT decoder trained on the frozen encoder for every family), `zeroshot` (class prompts x
templates: summed autoregressive log-likelihood and one parallel pass for Cap/CapPa, cosine for
the contrastive ones and CoCa, and cosine through a LiT text tower for Cap/CapPa), `wordorder`
(the true caption against its perturbations). Results go to `<run>/eval/<name>.json` and, when the
run's training is in MLflow, to that MLflow run as a table and headline metrics.
"""
from __future__ import annotations

from infra.media import to_input
from trainers.families import spec

import json
import time
from pathlib import Path

import numpy as np
import torch

from infra.errors import UserError

from .config import EvalConfig

TASKS = ("fewshot", "captioning", "zeroshot", "wordorder")


def central_square(image):
    """The largest centred square of an image (PIL or array): with the resize in to_input, the probes'
    and zero-shot's resize + central crop (CLIP's and big_vision's evaluation preprocessing), where a
    plain resize would squash a non-square image."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        arr = np.asarray(image)
        h, w = arr.shape[:2]
        side = min(h, w)
        return arr[(h - side) // 2:(h - side) // 2 + side, (w - side) // 2:(w - side) // 2 + side]
    w, h = image.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    return image.crop((left, top, left + side, top + side))


PREPROCESSING = {
    # zero-shot: a captioner's scores (ar, parallel, lit) as big_vision's probes; the contrastive
    # towers' cosine as CLIP's (shorter side to size, central crop, bicubic)
    "big_vision": {"fewshot": "squash to size*256/224, central crop to size, bilinear",
                   "zeroshot": "captioners (ar, parallel, lit): squash to size*256/224, central crop, bilinear; "
                               "contrastive (cosine): CLIP's, largest centred square resized to size, bicubic",
                   "captioning": "squash to size, bilinear", "wordorder": "squash to size, bilinear"},
    "square_crop": {"fewshot": "largest centred square, resize to size, bicubic",
                    "zeroshot": "largest centred square, resize to size, bicubic",
                    "captioning": "whole image resized to size, bicubic", "wordorder": "whole image resized to size, bicubic"},
}


def _squash_crop(image, size: int):
    """big_vision's few-shot preprocessing: squash to size*256/224 (224 -> 256), central crop `size`."""
    from PIL import Image

    big = round(size * 256 / 224)
    img = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image).astype(np.uint8))
    img = img.convert("RGB").resize((big, big), Image.BILINEAR)
    off = (big - size) // 2
    return img.crop((off, off, off + size, off + size))


def _prep(images: list, size: int, crop: bool = False, mode: str = "square_crop") -> torch.Tensor:
    """Images as the model reads them (PREPROCESSING says how, per mode and task). crop: the
    classification preprocessing; else the whole image (captioning and word order, whose captions
    may speak of the edges)."""
    if mode == "big_vision":
        return torch.from_numpy(np.stack([to_input(_squash_crop(im, size) if crop else im, size, "bilinear")
                                          for im in images]))
    return torch.from_numpy(np.stack([to_input(central_square(im) if crop else im, size) for im in images]))


@torch.no_grad()
def _dev(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def _batched(fn, x: torch.Tensor, *rest, device: torch.device, batch: int = 128) -> torch.Tensor:
    """fn over x in batches on `device` (rest: moved there whole), results back on the CPU."""
    rest = [r.to(device) for r in rest]
    return torch.cat([fn(x[i:i + batch].to(device), *rest).float().cpu() for i in range(0, len(x), batch)])


@torch.no_grad()
def _prompt_ensemble(model, x: torch.Tensor, cands: torch.Tensor, classes: int, device) -> torch.Tensor:
    """CLIP's prompt ensembling: a class is the normalised mean of its prompts' unit text embeddings;
    an image's score for it, their cosine. x (B, 3, S, S); cands (classes*per, L), class-major -> (B, classes)."""
    text = torch.cat([model.embed_text(cands[i:i + 256].to(device)).float() for i in range(0, len(cands), 256)])
    cls = torch.nn.functional.normalize(text.reshape(classes, -1, text.shape[-1]).mean(1), dim=-1)
    return _batched(lambda b: model.embed_image(b).float() @ cls.T, x, device=device)


def _features(model, images: torch.Tensor, batch: int = 128) -> np.ndarray:
    return _batched(model.image_features, images, device=_dev(model), batch=batch).numpy()


def _encode(sp, texts: list[str], max_len: int, eos: bool) -> torch.Tensor:
    out = torch.zeros(len(texts), max_len, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = sp.encode(t)[: max_len - 1] + ([1] if eos else [])
        out[i, : len(ids)] = torch.tensor(ids)
    return out


def run_eval_config(run_dir: Path) -> EvalConfig:
    """The run's own `eval:` section (its config.yaml), else the defaults."""
    from infra.configtools import MAX_CONFIG_BYTES, build, parse_yaml

    path = Path(run_dir) / "config.yaml"
    data = None
    if path.is_file():
        with open(path, "rb") as f:
            doc = parse_yaml(f.read(MAX_CONFIG_BYTES + 1), f"config file {path}")
        data = doc.get("eval") if isinstance(doc, dict) else None
    return build(EvalConfig, data or {}, "eval")


@torch.no_grad()
def _tokens(model, images: torch.Tensor, batch: int = 128) -> torch.Tensor:
    from .lit import encoder_of

    enc = encoder_of(model).eval()
    return _batched(enc, images, device=_dev(model), batch=batch)


def _shards(run_dir: Path) -> list[Path]:
    return sorted((Path(run_dir) / "shard" / "shards").glob("*.tar"))


def _fewshot(model, cfg, sets, ec: EvalConfig, shots, strict, results, run_dir: Path, log=print,
             asked: bool = False) -> None:
    """sets: the eval.fewshot entries, loaded one at a time (a set's images are dropped before the next).
    Shots are drawn from the set's official train split and scored on its test split (or, without
    one, from and on the two sides of eval.holdout); only the images drawn and tested are read.
    asked: the shots came from the command line: the MAP-head probe runs only if they name its own."""
    from .datasets import labelled_set
    from .fewshot import few_shot_split, fewest_in, holdout_split, probe
    from .lit import features_from_tokens, map_probe

    fs, maps = {}, {}
    for s in sets:
        data = labelled_set(s, run_dir)
        sel = np.array(data.selected)
        labels = np.array(data.labels)[sel]
        values = np.unique(labels)
        classes = {c: i for i, c in enumerate(values.tolist())}
        y = np.array([classes[c] for c in labels.tolist()])
        if data.split:
            split = np.array(data.split)[sel]
            pool, test = np.flatnonzero(split == "train"), np.flatnonzero(split == "test")
            where = "in its train split"
        else:
            pool, test = holdout_split(y, ec.holdout)
            where = f"outside the held-out test split ({ec.holdout:.0%} of each class, eval.holdout)"
        fewest = fewest_in(y, pool)
        said = results["sets"].setdefault("fewshot", {})[s.name] = {**data.describe(), "test_images": int(len(test))}
        log(f"eval: {s.name}: {_said(said)}")
        fitting = tuple(k for k in shots if k <= fewest)
        if fitting != tuple(shots):
            if strict:
                raise UserError(f"few-shot on {s.name}: a class has only {fewest} examples {where}, too few for "
                                f"{max(shots)}-shot; ask fewer --shots or a larger set")
            results["skipped"].append(f"few-shot on {s.name}: {sorted(set(shots) - set(fitting))}-shot left out, "
                                      f"a class has only {fewest} examples {where}")
        k = ec.map_probe.shots
        unasked = asked and k not in shots
        if unasked and ec.map_probe.steps:
            results["skipped"].append(f"MAP-head probe on {s.name}: its {'whole-split' if k is None else f'{k}-shot'} "
                                      f"probe (eval.map_probe.shots) is not among --shots {','.join(map(str, shots))}")
        # at least one validation image per class beside the training ones
        map_probe_runs = (bool(ec.map_probe.steps) and not unasked
                          and (fewest >= 2 if k is None else k + 1 <= fewest))
        draws = [few_shot_split(y, n, seed, pool) for n in fitting for seed in range(ec.seeds)]
        map_draws = []
        for seed in range(ec.seeds if map_probe_runs else 0):
            if k is None:      # the paper's probe: the whole train split, a tenth of each class for validation
                map_draws.append(_whole_pool(y, pool, seed))
                continue
            tr, rest = few_shot_split(y, k, seed, pool, extra=1)
            map_draws.append((tr, np.concatenate([rest[y[rest] == c][:k] for c in range(len(values))])))
        # the images any probe reads: the test split and every draw's shots (and validation)
        needed = np.unique(np.concatenate([test, *(tr for tr, _ in draws), *(a for d in map_draws for a in d)]))
        row = np.full(len(y), -1)
        row[needed] = np.arange(len(needed))
        x = _prep([data.image(int(sel[i])) for i in needed], cfg.image_size, crop=True, mode=ec.preprocess)
        tokens = _tokens(model, x) if map_probe_runs else None     # the encoder runs once for both probes
        if fitting:
            feats = (_batched(lambda t: features_from_tokens(model, t), tokens, device=_dev(model)).numpy()
                     if tokens is not None else _features(model, x))
            full = np.zeros((len(y), feats.shape[1]), feats.dtype)   # rows no probe reads stay zero
            full[needed] = feats
            fs[s.name] = probe(full, labels, shots=fitting, seeds=tuple(range(ec.seeds)), holdout=ec.holdout,
                               pool=pool, test=test)
        if map_probe_runs:
            mp = ec.map_probe
            lrs = [mp.lr / 3, mp.lr, mp.lr * 3] if mp.sweep else [mp.lr]
            runs, t0 = [], time.perf_counter()
            for seed, (tr, val) in enumerate(map_draws):
                # the probe trains len(lrs) heads of mp.steps steps a draw: minutes on a CPU, so said as it goes
                left = "" if not seed else f", about {(time.perf_counter() - t0) / seed * (len(map_draws) - seed):.0f}s left"
                log(f"eval: {s.name}: MAP-head probe, draw {seed + 1}/{len(map_draws)} ({len(lrs)} learning rate(s) x "
                    f"{mp.steps} steps{left})")
                runs.append(map_probe((tokens[row[tr]], y[tr]), (tokens[row[val]], y[val]),
                                      (tokens[row[test]], y[test]), cfg, mp.steps, lrs, seed))
            accs = [r["accuracy"] for r in runs]
            maps[s.name] = {("all" if k is None else str(k)): {"mean": float(np.mean(accs)), "std": float(np.std(accs)), "runs": accs,
                                     "chosen": [{"lr": r["lr"], "steps": r["steps"]} for r in runs]}}
        elif ec.map_probe.steps and not unasked:
            results["skipped"].append(f"MAP-head probe on {s.name}: a class has only {fewest} examples {where} "
                                      f"for {'training' if k is None else f'{k}-shot'} and validation")
    results["fewshot"], results["fewshot_map"] = fs, maps


def _whole_pool(y: np.ndarray, pool: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (train, validation): every pool image, a tenth of each class (at least one) held out by seed."""
    rng = np.random.default_rng(seed)
    val = []
    for c in np.unique(y[pool]):
        idx = pool[y[pool] == c]
        val += list(rng.choice(idx, size=max(1, len(idx) // 10), replace=False))
    val = np.array(sorted(val), dtype=np.int64)
    return np.setdiff1d(pool, val), val


def _said(d: dict) -> str:
    """A set's description (LabelledSet.describe) in words, for the log."""
    sizes = ", ".join(f"{k} {v}" + (f" of {d['of'][k]}" if d["of"].get(k, v) != v else "") for k, v in d["images"].items())
    split = "official split" if d["split"] == "official" else f"no official split, test: {d['split']}"
    return (f"{sizes} images ({split}), {d['classes']} classes"
            + (f"; limit {d['limit']} per split (eval set's limit)" if d["limit"] else "; the whole set"))


def _decode_scores(model, cfg, sp, x, ids, refs) -> dict:
    from trainers.families import stop_ids
    from trainers.models.decoding import beam_search, greedy

    from .textmetrics import caption_scores

    stop = stop_ids(sp, spec(cfg.family).stop_text)     # ClipCap: its captions end at "."
    out = {}
    for name, fn in (("greedy", lambda b: greedy(model, b, cfg.max_len, stop=stop)),
                     ("beam4", lambda b: beam_search(model, b, cfg.max_len, beam=4, stop=stop))):
        seqs = _batched(fn, x, device=_dev(model), batch=64).long()
        cands = {i: sp.decode([int(t) for t in row if t > 1]) for i, row in zip(ids, seqs)}
        out[name] = caption_scores(refs, cands)
        out[name]["examples"] = [[refs[i][0], cands[i]] for i in ids[:3]]
    return out


def evaluate(model_dir: Path, run_dir: Path, tasks=TASKS, log=print, mlflow_run_id: str | None = None,
             shots: tuple[int, ...] | None = None, strict: bool = True, eval_cfg: EvalConfig | None = None,
             seed: int = 0, record: bool = True) -> dict:
    """Every task of `tasks` on every dataset of the run's `eval:` section (or `eval_cfg`). A task
    with no dataset, or a model it does not apply to, is listed in results["skipped"] with the
    reason, never left out silently. strict: asked shots a dataset cannot serve are an error.
    record: write the results into the run folder's eval/ and its MLflow run (false: an evaluation
    during training, trainers/eval_during.py, which logs its own)."""

    from trainers.models.checkpoint import load_model

    from .datasets import labelled_set, load_captions, load_wordorder, prompt_texts
    from .wordorder import word_order_eval

    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UserError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    ec = eval_cfg or run_eval_config(run_dir)
    asked, shots = shots is not None, tuple(shots or ec.shots)
    model, cfg = load_model(model_dir)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(dev).eval()
    tok = run_dir / "tokenizer" / "spm.model"
    if not tok.is_file():
        raise UserError(f"{run_dir}: no tokenizer/spm.model to evaluate with")
    from trainers.tokenizer import open_tokenizer

    sp = open_tokenizer(cfg.hf_lm or tok)     # ClipCap on a Hugging Face LM speaks that LM's tokens
    family = spec(cfg.family)
    writes, captioner = family.writes, family.captioner
    results: dict = {"model": cfg.family, "size": cfg.size, "checkpoint": str(model_dir), "skipped": [], "sets": {},
                     "preprocessing": {"name": ec.preprocess, **{t: PREPROCESSING[ec.preprocess][t] for t in tasks}}}
    skip = results["skipped"].append
    timings = {}
    shards = _shards(run_dir)
    for task in tasks:
        if not getattr(ec, task):
            skip(f"{task}: no datasets in eval.{task} of the run's config")
    captions = {}
    if "captioning" in tasks or "wordorder" in tasks:
        captions = {s.name: load_captions(s, run_dir) for s in ec.captioning}
        for s in ec.captioning:
            results["sets"].setdefault("captioning", {})[s.name] = {"images": len(captions[s.name]), "limit": s.limit,
                                       **({"split": s.split} if s.kind == "karpathy" else {})}
            log(f"eval: {s.name}: {len(captions[s.name])} captioned images"
                + (f" of split {s.split}" if s.kind == "karpathy" else "")
                + (f"; limit {s.limit} (eval set's limit)" if s.limit else "; the whole set"))
    if "fewshot" in tasks and ec.fewshot:
        t0 = time.perf_counter()
        log(f"eval: few-shot probes on {', '.join(s.name for s in ec.fewshot)} ({', '.join(map(str, shots))} shots)")
        _fewshot(model, cfg, ec.fewshot, ec, shots, strict, results, run_dir, log, asked=asked)
        timings["fewshot"] = time.perf_counter() - t0
        log(f"eval: few-shot probes done ({timings['fewshot']:.0f}s)")
    lit_decoder = None
    if "captioning" in tasks and ec.captioning:
        t0 = time.perf_counter()
        log(f"eval: captioning on {', '.join(s.name for s in ec.captioning)}")
        if ec.lit_decoder.steps and shards and family.lit_decoder:
            from .lit import train_lit_decoder

            lit_decoder = train_lit_decoder(model, cfg, shards, tok, ec.lit_decoder, seed, log)
        elif not family.lit_decoder:
            skip(f"captioning (LiT decoder): {cfg.family} is itself a decoder trained on a frozen encoder")
        elif not ec.lit_decoder.steps:
            skip("captioning (LiT decoder): eval.lit_decoder.steps is 0")
        else:
            skip(f"captioning (LiT decoder): no shards in {run_dir}/shard/shards to train it on")
        if not writes:
            skip(f"captioning (native): {cfg.family} has no decoder of its own; see the LiT decoder's scores")
        out = {}
        for s in ec.captioning:
            rows = captions[s.name]
            x = _prep([img for _, img, _ in rows], cfg.image_size, mode=ec.preprocess)
            ids = [i for i, _, _ in rows]
            refs = {i: r for i, _, r in rows}
            out[s.name] = {}
            if writes:
                out[s.name].update(_decode_scores(model, cfg, sp, x, ids, refs))
            if lit_decoder is not None:
                out[s.name].update({f"lit_{k}": v for k, v in _decode_scores(lit_decoder, lit_decoder.cfg, sp, x,
                                                                            ids, refs).items()})
        results["captioning"] = out
        timings["captioning"] = time.perf_counter() - t0
        log(f"eval: captioning done ({timings['captioning']:.0f}s)")
    if "zeroshot" in tasks and ec.zeroshot:
        t0 = time.perf_counter()
        log(f"eval: zero-shot on {', '.join(s.name for s in ec.zeroshot)}")
        lit_text = None
        if captioner and ec.lit.steps and shards:
            from .lit import train_lit_text

            lit_text = train_lit_text(model, cfg, shards, tok, ec.lit, seed, log)
        elif captioner and ec.lit.steps:
            skip(f"zero-shot (LiT): no shards in {run_dir}/shard/shards to train a text tower on")
        elif captioner:
            skip("zero-shot (LiT): eval.lit.steps is 0")
        if not (captioner or family.embeds_text):
            skip(f"zero-shot: {cfg.family}'s prefix LM scores are not a zero-shot classifier here")
        zs = {}
        for s in ec.zeroshot:
            data = labelled_set(s, run_dir)
            # scored on the test split where the set has one, else on every image within its limit
            idx = [i for i in data.selected if not data.split or data.split[i] == "test"]
            said = results["sets"].setdefault("zeroshot", {})[s.name] = {**data.describe(), "test_images": len(idx)}
            log(f"eval: {s.name}: {_said(said)}")
            images = [data.image(i) for i in idx]
            x = _prep(images, cfg.image_size, crop=True, mode=ec.preprocess)
            # the contrastive towers read CLIP's preprocessing (the square crop) in every mode
            x_clip = _prep(images, cfg.image_size, crop=True) if family.embeds_text and ec.preprocess != "square_crop" else x
            del images
            labels = [data.labels[i] for i in idx]
            classes = sorted(set(data.labels))
            names, templates = prompt_texts(s, classes, run_dir)
            prompts = [t.format(names[c]) for c in classes for t in templates]
            per = len(templates)
            truth = np.array([classes.index(c) for c in labels])
            cands = _encode(sp, prompts, cfg.max_len, eos=ec.eos)
            scorers = []
            if captioner:
                def likelihood(fn):     # a class's score: log-sum-exp of its prompts' log-likelihoods
                    return torch.logsumexp(_batched(fn, x, cands, device=dev).reshape(len(x), len(classes), per), -1)

                scorers += [("ar", lambda: likelihood(model.score_ar)),
                            ("parallel", lambda: likelihood(model.score_parallel))]
            if family.embeds_text:
                scorers.append(("cosine", lambda: _prompt_ensemble(model, x_clip, cands, len(classes), dev)))
            if lit_text is not None:
                scorers.append(("lit", lambda: _prompt_ensemble(lit_text, x, cands, len(classes), dev)))
            res = {"classes": len(classes), "prompts_per_class": per}
            for name, fn in scorers:
                t1 = time.perf_counter()
                sc = fn()
                res[name] = {"accuracy": float((sc.argmax(1).numpy() == truth).mean()),
                             "seconds_per_1000_images": (time.perf_counter() - t1) * 1000 / len(x)}
            zs[s.name] = res
        results["zeroshot"] = zs
        timings["zeroshot"] = time.perf_counter() - t0
        log(f"eval: zero-shot done ({timings['zeroshot']:.0f}s)")
    if "wordorder" in tasks and ec.wordorder:
        t0 = time.perf_counter()
        log(f"eval: word order on {', '.join(s.name for s in ec.wordorder)}")
        wo = {}
        for s in ec.wordorder:
            cases = load_wordorder(s, run_dir, captions)
            x = _prep([img for img, _, _ in cases], cfg.image_size, mode=ec.preprocess)

            def score(i, caps):
                c = _encode(sp, caps, cfg.max_len, eos=family.stop_text is None)   # as the family was trained
                fn = model.score_ar if writes else model.score
                return _batched(fn, x[i:i + 1], c, device=dev)[0].tolist()

            wo[s.name] = word_order_eval([(t, n) for _, t, n in cases], score)
            results["sets"].setdefault("wordorder", {})[s.name] = {"kind": s.kind, "cases": len(cases), "limit": s.limit}
            if s.kind == "vg_relation":     # ARO's VG-Relation headline: the mean over relations
                per = [v["accuracy"] for v in wo[s.name]["pairwise"].values()]
                wo[s.name]["macro_accuracy"] = {"accuracy": float(np.mean(per)) if per else 0.0, "relations": len(per)}
        results["wordorder"] = wo
        timings["wordorder"] = time.perf_counter() - t0
        log(f"eval: word order done ({timings['wordorder']:.0f}s)")
    for note in results["skipped"]:
        log(f"eval: skipped {note}")
    results["seconds"] = timings
    if not record:
        return results
    out_dir = run_dir / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{Path(model_dir).resolve().parent.name}-{cfg.family}-{cfg.size}.json"
    path.write_text(json.dumps(results, indent=1))
    _log_to_mlflow(run_dir, results, path, log, mlflow_run_id)
    return results


def _log_to_mlflow(run_dir: Path, results: dict, path: Path, log, run_id: str | None) -> None:
    id_file = Path(results["checkpoint"]).parent / "mlflow_run_id"
    if run_id is None and not id_file.is_file():
        return
    from infra.tracking import client, tracking_uri

    c = client(tracking_uri(run_dir))
    run_id = run_id or id_file.read_text().strip()
    rows = eval_rows(results)
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    c.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in headline(rows).items()])
    # log_table appends to a table logged before: each row says which evaluation it came from
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    table = {k: [r[k] for r in rows] for k in ROW_KEYS}
    table.update(checkpoint=[results["checkpoint"]] * len(rows), evaluated_at=[stamp] * len(rows))
    c.log_table(run_id, data=table, artifact_file="eval/results_table.json")
    c.log_artifact(run_id, str(path), "eval")
    log(f"eval: logged {len(rows)} results to MLflow run {run_id} (table eval/results_table.json, "
        f"{len(headline(rows))} headline metrics)")


ROW_KEYS = ("task", "dataset", "variant", "shots", "metric", "value", "std")


def eval_rows(results: dict) -> list[dict]:
    """Every result as one row: what the MLflow table, the report and the experiment table show."""
    rows = []
    for variant, key in (("linear", "fewshot"), ("map", "fewshot_map")):
        for name, fs in results.get(key, {}).items():
            for shots, r in sorted(fs.items(), key=lambda kv: int(kv[0])):
                rows.append({"task": "few-shot", "dataset": name, "variant": variant, "shots": int(shots),
                             "metric": "accuracy", "value": r["mean"], "std": r.get("std")})
    for name, decoders in results.get("captioning", {}).items():
        for dec, r in decoders.items():
            for metric in ("cider", "bleu4"):
                rows.append({"task": "captioning", "dataset": name, "variant": dec, "shots": None,
                             "metric": metric, "value": r[metric], "std": None})
    for name, zs in results.get("zeroshot", {}).items():
        for scorer, r in zs.items():
            if isinstance(r, dict):
                rows.append({"task": "zero-shot", "dataset": name, "variant": scorer, "shots": None,
                             "metric": "accuracy", "value": r["accuracy"], "std": None})
    for name, wo in results.get("wordorder", {}).items():
        rows.append({"task": "word order", "dataset": name, "variant": "all", "shots": None,
                     "metric": "precision@1", "value": wo["precision_at_1"]["accuracy"], "std": None})
        for cat, r in wo["pairwise"].items():
            rows.append({"task": "word order", "dataset": name, "variant": cat, "shots": None,
                         "metric": "pairwise accuracy", "value": r["accuracy"], "std": None})
    return rows


def headline(rows: list[dict]) -> dict[str, float]:
    """A few metrics to sort runs by: 10-shot accuracy per set and probe, CIDEr per set and decoder,
    zero-shot per set and scorer, word order's precision@1 per set."""
    out = {}
    for r in rows:
        if r["task"] == "few-shot" and r["shots"] == 10:
            out[f"eval.fewshot.{r['dataset']}.{r['variant']}.10shot"] = r["value"]
        elif r["task"] == "captioning" and r["metric"] == "cider":
            out[f"eval.captioning.{r['dataset']}.{r['variant']}.cider"] = r["value"]
        elif r["task"] == "zero-shot":
            out[f"eval.zeroshot.{r['dataset']}.{r['variant']}"] = r["value"]
        elif r["task"] == "word order" and r["metric"] == "precision@1":
            out[f"eval.wordorder.{r['dataset']}.precision_at_1"] = r["value"]
    return out


def summary(results: dict) -> str:
    lines = [f"evaluation of {results['model']}/{results['size']}:"]
    for title, key in (("few-shot linear probe", "fewshot"), ("few-shot MAP-head probe", "fewshot_map")):
        fewshot = results.get(key, {})
        shots = sorted({int(k) for fs in fewshot.values() for k in fs})
        if fewshot:
            lines.append(f"  {title:<22}" + "".join(f"{f'{k}-shot':>16}" for k in shots))
        for name, fs in fewshot.items():
            cells = {int(k): f"{100 * r['mean']:5.1f}% (+-{100 * r['std']:.1f})" for k, r in fs.items()}
            lines.append(f"    {name:<20}" + "".join(f"{cells.get(k, '-'):>16}" for k in shots))
    for name, decoders in results.get("captioning", {}).items():
        for dec, r in decoders.items():
            lines.append(f"  captioning {name} {dec:<11} CIDEr {r['cider']:.1f}  BLEU-4 {r['bleu4']:.1f}")
    for name, zs in results.get("zeroshot", {}).items():
        for scorer, r in zs.items():
            if isinstance(r, dict):
                lines.append(f"  zero-shot {name} {scorer:<9} {100 * r['accuracy']:5.1f}%  "
                             f"({r['seconds_per_1000_images']:.2f}s / 1000 images)")
    for name, wo in results.get("wordorder", {}).items():
        p1 = wo["precision_at_1"]
        lines.append(f"  word order {name} {'precision@1':<28} {100 * p1['accuracy']:5.1f}% of {p1['n']}")
        for cat, r in wo["pairwise"].items():
            lines.append(f"  word order {name} {cat + ' (pairwise)':<28} {100 * r['accuracy']:5.1f}% of {r['n']}")
    for note in results.get("skipped", []):
        lines.append(f"  skipped: {note}")
    return "\n".join(lines)
