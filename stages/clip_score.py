"""The CLIP-score stage: keep image-caption pairs whose embeddings agree.

The score is the cosine of the image and caption embeddings of a scorer (stages/scorer.py):
- `scorer: checkpoint`: a capline CLIP* / SigLIP / CoCa checkpoint folder (and its tokenizer);
- `scorer: bootstrap`: a small CLIP* trained here, first, on a trusted subset
  (`bootstrap.trusted_keys`) or on this stage's own input (deduplicated, language-filtered data).
Scoring runs as a Ray Data actor pool over the ingest shards; each actor loads the scorer once and
scores batches on CPU or GPU (`device`).

What is kept: score >= `threshold` (LAION: 0.28 with CLIP B/32), or the top `keep_fraction` by one
global sort over every score of the stage (DataComp: top 30 %), ties broken by key. Scores are
rounded to 1e-6 first, so the last bits of a float sum cannot change a verdict. Dropped samples get
reason `clip_score` with the score and the cut in the detail. Stats name the scorer, its checksum,
the cut and a histogram of scores.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainers.configtools import join, require
from trainers.errors import UserError

from .actor_map import collect, ingest_dataset, map_actors
from .base import Ledger, Stage, StageContext, StageResult
from .captions import caption_map
from .examples import read_images, write_examples
from .scorer import BootstrapConfig, Scorer, check_scorer, read_trusted_keys, train_bootstrap
from .tokenizer import order_key


@dataclass
class ClipScoreConfig:
    enabled: bool = True
    scorer: Literal["bootstrap", "checkpoint"] = "bootstrap"
    checkpoint: str | None = None     # scorer: checkpoint -> a capline clip/siglip/coca model folder
    tokenizer: str | None = None      # default: <checkpoint>/spm.model
    threshold: float | None = None    # keep score >= threshold ...
    keep_fraction: float | None = 0.3  # ... or the top fraction (DataComp's best: 30 %); set one of them
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    num_workers: int = 2
    cpus_per_worker: float = 0.75    # < 1: see stages/actor_map.py
    gpus_per_worker: float = 0.0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    batch_size: int = 256
    examples_per_reason: int = 20

    def validate(self, prefix: str) -> None:
        require((self.threshold is None) != (self.keep_fraction is None), join(prefix, "threshold"),
                "set exactly one of threshold and keep_fraction (set the other to null)")
        if self.keep_fraction is not None:
            require(0 < self.keep_fraction <= 1, join(prefix, "keep_fraction"),
                    f"must be in (0, 1], got {self.keep_fraction}")
        if self.threshold is not None:
            require(-1 <= self.threshold <= 1, join(prefix, "threshold"), f"a cosine in [-1, 1], got {self.threshold}")
        if self.scorer == "checkpoint":
            require(bool(self.checkpoint), join(prefix, "checkpoint"), "scorer: checkpoint needs the checkpoint folder")
        require(self.num_workers >= 1, join(prefix, "num_workers"), "must be >= 1")
        require(self.batch_size >= 1, join(prefix, "batch_size"), "must be >= 1")


def preflight(cfg: ClipScoreConfig) -> None:
    if cfg.enabled and cfg.scorer == "checkpoint":
        check_scorer(cfg.checkpoint, cfg.tokenizer)


def select(keys: list[str], scores: np.ndarray, threshold: float | None, keep_fraction: float | None):
    """-> (boolean keep mask, the cut). Pure and deterministic: ties go to the smaller key."""
    scores = np.round(np.asarray(scores, np.float64), 6)
    if threshold is not None:
        return scores >= threshold, float(threshold)
    n = len(keys)
    n_keep = min(n, math.ceil(keep_fraction * n - 1e-9))
    order = sorted(range(n), key=lambda i: (-scores[i], keys[i]))
    keep = np.zeros(n, bool)
    keep[order[:n_keep]] = True
    return keep, float(scores[order[n_keep - 1]]) if n_keep else float("inf")


class _Score:
    """Ray Data actor: score the batch's pairs that are in this stage's input."""

    def __init__(self, checkpoint: str, tokenizer: str | None, device: str, pairs_path: str):
        t = pq.read_table(pairs_path).to_pydict()
        self.captions = dict(zip(t["key"], t["caption"]))
        self.scorer = Scorer(checkpoint, tokenizer, device)

    def __call__(self, batch: dict) -> dict:
        keys, images, caps = [], [], []
        for img, meta in zip(batch["jpg"], batch["json"]):
            key = json.loads(meta)["uid"]
            if key in self.captions:
                keys.append(key)
                images.append(bytes(img))
                caps.append(self.captions[key])
        scores = self.scorer.score(images, caps) if keys else np.zeros(0)
        return {"key": np.array(keys, dtype=object), "score": np.asarray(scores, np.float64)}


class ClipScoreStage(Stage):
    name = "clip_score"

    def section(self, config) -> ClipScoreConfig:
        return config.stages.clip_score

    def run(self, ctx: StageContext) -> StageResult:
        cfg: ClipScoreConfig = ctx.config.stages.clip_score
        ledger = Ledger(self.name)
        keys = sorted(ctx.upstream_kept or [])
        if not cfg.enabled or not keys:
            for k in keys:
                ledger.keep(k)
            return StageResult(ledger, {"enabled": cfg.enabled})
        captions = caption_map(ctx.upstream)
        scorer = self._scorer(ctx, cfg, keys, captions)
        work = ctx.stage_dir / "_work"
        work.mkdir(exist_ok=True)
        pairs = work / "pairs.parquet"
        pq.write_table(pa.table({"key": keys, "caption": [captions[k] for k in keys]}), pairs)
        ds = map_actors(ingest_dataset(ctx.upstream["ingest"]), _Score,
                        (scorer["path"], scorer.get("tokenizer"), cfg.device, str(pairs)),
                        cfg.num_workers, cfg.batch_size, cfg.cpus_per_worker, cfg.gpus_per_worker)
        out = collect(ds, ["key", "score"])
        got = [str(k) for k in out["key"]]
        if got != keys:
            raise RuntimeError(f"clip_score: scored {len(got)} of {len(keys)} samples; "
                               f"missing e.g. {sorted(set(keys) - set(got))[:3]}")
        keep, cut = select(keys, out["score"], cfg.threshold, cfg.keep_fraction)
        how = (f"threshold {cfg.threshold}" if cfg.threshold is not None
               else f"top {cfg.keep_fraction:.0%} cut {cut:.6f}")
        for k, s, kept in zip(keys, out["score"], keep):
            if kept:
                ledger.keep(k, score=round(float(s), 6))
            else:
                ledger.drop(k, "clip_score", score=round(float(s), 6), detail=f"below {how}")
        counts, edges = np.histogram(out["score"], bins=40)
        shown = write_examples(ctx, ledger.table(), captions, cfg.examples_per_reason, "CLIP-score filter")
        ctx.log(f"clip_score: {scorer['kind']} scorer {scorer['sha256'][:12]}, kept {int(keep.sum())} "
                f"of {len(keys)} at {how}; examples in {shown}")
        return StageResult(ledger, {
            "enabled": True, "scorer": scorer, "threshold": cfg.threshold, "keep_fraction": cfg.keep_fraction,
            "cut": cut, "score_mean": float(np.mean(out["score"])),
            "histogram": {"counts": counts.tolist(), "edges": [round(float(e), 6) for e in edges]}},
            artifacts={"scorer": scorer["path"], "scorer_sha256": scorer["sha256"], "report": "clip_score/report.html"})

    def _scorer(self, ctx: StageContext, cfg: ClipScoreConfig, keys: list[str], captions: dict[str, str]) -> dict:
        if cfg.scorer == "checkpoint":
            return check_scorer(cfg.checkpoint, cfg.tokenizer)
        out = ctx.stage_dir / "scorer"
        done = out / "scorer.json"
        if done.is_file():   # trained before this stage was interrupted: same input, same model
            ctx.log("clip_score: reusing the bootstrap scorer trained before the interruption")
            return json.loads(done.read_text())
        b = cfg.bootstrap
        pool = keys
        if b.trusted_keys:
            trusted = set(read_trusted_keys(b.trusted_keys))
            pool = [k for k in keys if k in trusted]
            if len(pool) < 2:
                raise UserError(f"stages.clip_score.bootstrap.trusted_keys: {len(pool)} of its keys reach this "
                                f"stage ({len(trusted)} listed); name keys of samples that survive the earlier stages")
        train_keys = sorted(pool, key=lambda k: order_key(ctx.config.seed, k))[: b.max_samples]
        images = read_images(ctx.upstream["ingest"], train_keys)
        ctx.log(f"clip_score: training the bootstrap scorer on {len(train_keys)} "
                f"{'trusted' if b.trusted_keys else 'input'} pairs ({b.steps} steps of {b.batch_size})")
        info = _train_remote(images=[images[k] for k in train_keys], captions=[captions[k] for k in train_keys],
                             cfg=b, seed=ctx.config.seed, out_dir=str(out))
        info["trusted_keys"] = b.trusted_keys
        done.write_text(json.dumps(info, indent=1, sort_keys=True))
        return info


def _train_remote(**kwargs) -> dict:
    """Train in a Ray task (a worker with the CPUs or a GPU), not in the driver."""
    import ray

    cpus = min(kwargs["cfg"].cpus, ray.cluster_resources().get("CPU", 1))
    task = ray.remote(num_cpus=cpus)(_train_task)
    return ray.get(task.remote(**kwargs))


def _train_task(**kwargs) -> dict:
    import torch

    torch.set_num_threads(max(1, int(kwargs["cfg"].cpus)))
    return train_bootstrap(**kwargs)
