"""Image-caption scorers for the CLIP-score stage, and the bootstrapped one it can train itself.

A scorer is a folder: a capline checkpoint (`model.json` + `model.safetensors`, trainers/models/
checkpoint.py) of a family that embeds both images and text (clip, siglip, coca), plus the
SentencePiece model its text tower reads (`spm.model` in the folder unless named). The score is the
cosine of the image and caption embeddings.

The bootstrapped scorer (Data Filtering Networks, Fang et al. 2023: a filter trained on the data you
trust): a SentencePiece model and a small CLIP* trained from scratch, in one Ray task, on a trusted
subset of keys or on the stage's own input. Trained with a fixed seed in one process, it is the same
model on every rerun; its checksum is in the stage's stats.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from infra.configtools import join, require
from infra.errors import UserError

from trainers.families import with_text_embedding

SCORING_FAMILIES = with_text_embedding()   # a scorer needs an image and a caption embedding


@dataclass
class BootstrapConfig:
    trusted_keys: str | None = None   # a Parquet/CSV file with a `key` column; default: the stage's input
    max_samples: int = 20000          # train on at most this many (the first in seeded order)
    steps: int = 300                 # more overfits: on the demo 600 steps memorise the mismatched pairs
    batch_size: int = 128  # pairs per contrastive training step of the bootstrap scorer
    image_size: int = 48  # pixels the bootstrap scorer sees
    max_len: int = 24  # caption tokens the bootstrap scorer reads
    vocab_size: int = 1000            # a soft limit, as in the tokenizer stage
    model_args: dict[str, int] = field(default_factory=lambda: {"width": 64, "depth": 2, "heads": 2, "mlp": 256, "patch": 8})  # the bootstrap CLIP*'s width, depth, heads, MLP and patch size
    lr: float = 0.001  # the bootstrap scorer's learning rate
    cpus: float = 2.0  # CPUs the bootstrap scorer's training task asks for
    # keep the scorer the first run of this run folder trained, for every later (scheduled) run:
    # the scores of unchanged partitions are then reused; false trains anew on the data as it is
    reuse: bool = False

    def validate(self, prefix: str) -> None:
        require(self.steps >= 1, join(prefix, "steps"), "must be >= 1")
        require(self.batch_size >= 2, join(prefix, "batch_size"), "a contrastive batch needs >= 2 pairs")
        require(self.max_samples >= 2, join(prefix, "max_samples"), "must be >= 2")
        require(self.lr > 0, join(prefix, "lr"), "must be > 0")
        require(self.cpus > 0, join(prefix, "cpus"), "must be > 0")
        if self.trusted_keys:
            require(Path(self.trusted_keys).is_file(), join(prefix, "trusted_keys"),
                    f"{self.trusted_keys}: no such file (a Parquet or CSV file with a `key` column)")


def dir_sha256(directory: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(directory).iterdir()):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def check_scorer(checkpoint: str, tokenizer: str | None) -> dict:
    """Fail before any work if the scorer folder is missing or does not fit. -> a description."""
    import sentencepiece as spm

    from trainers.models.checkpoint import load_config

    path = Path(checkpoint)
    if not path.is_dir():
        raise UserError(f"stages.clip_score.checkpoint {checkpoint}: no such folder")
    cfg = load_config(path)
    if cfg.family not in SCORING_FAMILIES:
        raise UserError(f"stages.clip_score.checkpoint {checkpoint}: a {cfg.family} model has no text "
                        f"embedding to score with; use a {', '.join(SCORING_FAMILIES)} checkpoint")
    tok = Path(tokenizer) if tokenizer else path / "spm.model"
    if not tok.is_file():
        raise UserError(f"stages.clip_score: no tokenizer at {tok}; put the run's tokenizer/spm.model in the "
                        "checkpoint folder or set stages.clip_score.tokenizer")
    sp = spm.SentencePieceProcessor(model_file=str(tok))
    if sp.get_piece_size() != cfg.vocab_size:
        raise UserError(f"stages.clip_score: tokenizer {tok} has {sp.get_piece_size()} pieces but the "
                        f"checkpoint's model expects vocab_size {cfg.vocab_size}; they were not trained together")
    if not (path / "model.safetensors").is_file():
        raise UserError(f"stages.clip_score.checkpoint {checkpoint}: model.safetensors is missing")
    return {"kind": "checkpoint", "path": str(path), "family": cfg.family, "tokenizer": str(tok),
            "sha256": dir_sha256(path)}


# The bootstrap scorer is cross-fitted: a CLIP* it trains on a pair scores that pair ~0.9 and a pair
# it never saw ~0.4, so a cut drawn over its own training pairs kept 1 of ~50 new pairs of a dataset
# line. FOLDS scorers, each trained on one fold of the pairs (by key, so a later run's pair has a
# fold too); a pair is scored by a scorer that did not train on it, old and new alike.
FOLDS = 2


def fold_of(key: str) -> int:
    """A sample's fold, from its key alone (the same in every run, on every worker)."""
    return hashlib.sha256(key.encode()).digest()[0] % FOLDS


def fold_dir(folder, k: int) -> str:
    return f"{folder}/fold{k}"


class CrossFitScorer:
    """The FOLDS scorers of a cross-fitted bootstrap folder: `score(images, captions, keys)`, each pair
    by the scorer of the next fold (trained on the other pairs)."""

    def __init__(self, folders: list[str], device: str = "cpu"):
        self.parts = [Scorer(f, None, device) for f in folders]

    def score(self, images: list, captions: list[str], keys: list[str]) -> np.ndarray:
        out = np.zeros(len(keys), np.float64)
        by = np.array([(fold_of(k) + 1) % FOLDS for k in keys], np.int64)
        for k, scorer in enumerate(self.parts):
            idx = np.flatnonzero(by == k)
            if len(idx):
                out[idx] = scorer.score([images[i] for i in idx], [captions[i] for i in idx])
        return out


class Scorer:
    """Loads a scorer folder once; `score(images, captions)` -> cosine per pair."""

    def __init__(self, checkpoint: str, tokenizer: str | None = None, device: str = "cpu"):
        import sentencepiece as spm
        import torch

        from trainers.models.checkpoint import load_model

        self.torch = torch
        self.device = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        self.model, self.cfg = load_model(checkpoint)
        self.model.to(self.device).eval()
        self.sp = spm.SentencePieceProcessor(model_file=str(tokenizer or Path(checkpoint) / "spm.model"))

    CHUNK = 64   # every forward pass has exactly this many rows

    def score(self, images: list, captions: list[str]) -> np.ndarray:
        """Cosine per pair, in fixed-size chunks (in_chunks). `images`: encoded bytes or decoded PIL
        images (the data plane's `pictures`, without a resize's bars)."""
        from trainers.data import decode_image, encode_caption

        torch = self.torch

        def cosines(imgs, caps):
            x = torch.from_numpy(np.stack([decode_image(b, self.cfg.image_size) for b in imgs])).to(self.device)
            t = torch.from_numpy(np.stack([encode_caption(self.sp, c, self.cfg.max_len) for c in caps])).to(self.device)
            with torch.no_grad():
                return self.model.score(x, t).diagonal().float().cpu().numpy()

        return in_chunks(images, captions, self.CHUNK, cosines)


def in_chunks(images: list, captions: list, chunk: int, cosines) -> np.ndarray:
    """`cosines(images, captions)` over chunks of exactly `chunk` pairs (the last padded with copies of
    its first): a matrix product's last bits depend on its row count, so a pair's score must not
    depend on which other pairs shared its batch. -> float64 cosine per pair."""
    out = []
    for i in range(0, len(images), chunk):
        imgs, caps = images[i:i + chunk], captions[i:i + chunk]
        n = len(imgs)
        got = cosines(imgs + [imgs[0]] * (chunk - n), caps + [caps[0]] * (chunk - n))
        out.append(np.asarray(got, np.float64)[:n])
    return np.concatenate(out) if out else np.zeros(0)


def _decode_all(images: list[bytes], size: int) -> np.ndarray:
    from trainers.data import decode_image

    return np.stack([decode_image(b, size) for b in images]).astype(np.float32)


def train_bootstrap(images: list[bytes], captions: list[str], cfg: BootstrapConfig, seed: int, out_dir: str,
                    log=print, what: str = "") -> dict:
    """Train the SentencePiece model and a small CLIP* on (image, caption) pairs; save a scorer folder.
    Progress every tenth of the steps or 15 s, with the time left (it is minutes on a CPU); `what`
    names the scorer (a half of the cross-fit) in it."""
    import time

    import sentencepiece as spm
    import torch

    from trainers.data import encode_caption
    from trainers.models import build_model
    from trainers.models.checkpoint import save_model
    from trainers.models.config import ModelConfig
    from trainers.fit import fit
    from trainers.optim import lr_factor

    from ..tokenizer import TokenizerConfig, train_sentencepiece

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_bytes = train_sentencepiece(captions, TokenizerConfig(vocab_size=max(300, cfg.vocab_size)))
    (out / "spm.model").write_bytes(model_bytes)
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    x = torch.from_numpy(_decode_all(images, cfg.image_size))
    t = torch.from_numpy(np.stack([encode_caption(sp, c, cfg.max_len) for c in captions]))
    torch.manual_seed(seed)
    mcfg = ModelConfig(family="clip", size="tiny", vocab_size=sp.get_piece_size(), max_len=cfg.max_len,
                       image_size=cfg.image_size, **cfg.model_args)
    mcfg.validate("stages.clip_score.bootstrap.model_args")
    model = build_model(mcfg)
    rng = np.random.default_rng(seed)
    n, b = len(captions), min(cfg.batch_size, len(captions))
    losses = []
    model.train()

    def loss_of(step: int):
        idx = torch.from_numpy(rng.choice(n, size=b, replace=False))
        return model.loss(x[idx], t[idx])[0]

    t0 = said = time.perf_counter()

    def on_step(step: int, loss: float) -> None:
        nonlocal said
        losses.append(loss)
        now = time.perf_counter()
        if (step + 1) % max(1, cfg.steps // 10) == 0 or now - said >= 15 or step + 1 == cfg.steps:
            said, left = now, (now - t0) / (step + 1) * (cfg.steps - step - 1)
            log(f"clip_score: bootstrap scorer{' ' + what if what else ''} step {step + 1}/{cfg.steps}, loss "
                f"{np.mean(losses[-20:]):.3f}, {now - t0:.0f}s so far" + (f", about {left:.0f}s left" if left else ""))

    fit(model.parameters(), cfg.steps, loss_of, cfg.lr, weight_decay=0.05, clip_norm=1.0, on_step=on_step,
        schedule=lambda step: lr_factor(step, max(1, cfg.steps // 10), cfg.steps))
    save_model(model, mcfg, out)
    return {"kind": "bootstrap", "path": str(out), "family": "clip", "trained_on": n, "steps": cfg.steps,
            "final_loss": float(np.mean(losses[-20:])), "chance_loss": float(np.log(b)),
            "sha256": dir_sha256(out)}


# Below this many pairs a bootstrapped scorer cannot be trusted: benchmarks/bootstrap_size.py trains
# it, as this stage does, on N of the demo's pairs with 6 % of captions swapped. ROC AUC (clean vs
# swapped), two seeds: 100 pairs 0.74/0.90, 200 0.82/0.91, 400 0.71/0.70, 800 0.83/0.90, 1600
# 0.92/0.94; at 100-200 pairs every score fell in 0.86-0.96 (the bunching users saw). 800 is the
# smallest N from which every N reached 0.8 on every seed.
MIN_BOOTSTRAP_PAIRS = 800


def small_bootstrap(scorer: dict) -> str | None:
    """The warning for a bootstrapped scorer trained on too few pairs to mean much; None otherwise."""
    n = scorer.get("trained_on")
    if scorer.get("kind") != "bootstrap" or n is None or n >= MIN_BOOTSTRAP_PAIRS:
        return None
    return (f"the bootstrap scorer learnt from {n} pairs; below {MIN_BOOTSTRAP_PAIRS} its scores barely tell "
            "matching captions from swapped ones (benchmarks/bootstrap_size.py), so the cut is close to "
            "random: give it more data, or set stages.clip_score.scorer to hf, checkpoint or column")


def read_trusted_keys(path: str) -> list[str]:
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    p = Path(path)
    try:
        table = pq.read_table(p) if p.suffix == ".parquet" else pacsv.read_csv(p)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise UserError(f"stages.clip_score.bootstrap.trusted_keys {path}: not a readable Parquet/CSV file ({err})") from None
    if "key" not in table.column_names:
        raise UserError(f"stages.clip_score.bootstrap.trusted_keys {path}: needs a `key` column; it has "
                        f"{', '.join(table.column_names)}")
    return [str(k) for k in table.column("key").to_pylist()]
