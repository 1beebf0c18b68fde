"""Evaluations that train something on top of a frozen image encoder (the paper's Table 2 and 4, Fig. 3).

Shape key: B batch, N image tokens, D encoder width, L caption positions, K classes.

- LiT decoder: a fresh Cap decoder (the paper's shape: the encoder's width, heads and MLP, half its
  depth) cross-attending to the frozen encoder's final tokens (B, N, D), trained autoregressively on
  the run's shards; any family's encoder gets a captioning score this way.
- LiT text tower: a fresh text encoder trained contrastively (CLIP loss, learned temperature)
  against the frozen image features (B, D), so a captioner's encoder gets a cosine zero-shot score.
- MAP-head probe: attention pooling over the frozen tokens (B, N, D) -> (B, D), then a linear layer
  to K classes, trained with Adam on the few-shot examples only.
The encoder never changes: its parameters are frozen and it runs in eval mode under no_grad.
"""
from __future__ import annotations

import dataclasses
from trainers.fit import fit
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainers.data import as_input
from trainers.models import ModelConfig
from trainers.models.captioner import Captioner
from trainers.models.layers import MAPHead
from trainers.models.losses import caption_loss, clip_loss
from trainers.models.text import TextEncoder, self_mask, shift_right


def encoder_of(model) -> nn.Module:
    """The ViT of any family (ClipCap: its frozen image model's)."""
    inner = getattr(model, "image_encoder", None)
    return (inner if inner is not None else model).encoder


def features_from_tokens(model, tokens: torch.Tensor) -> torch.Tensor:
    """(B, N, D) final encoder tokens -> (B, D) what `model.image_features` gives for the same images
    (the contrastive towers pool with their own GAP or MAP head, the others average), so a probe that
    needs both runs the encoder once."""
    inner = getattr(model, "image_encoder", None)
    inner = inner if inner is not None else model
    from trainers.families import spec

    if spec(inner.cfg.family).pooled_by_head:
        return inner.encoder.pooled(tokens)
    return tokens.mean(1)


def _batches(shards: list[Path], tokenizer: Path, batch: int, image_size: int, max_len: int, seed: int):
    from trainers.data import LoaderState, ShardStream

    return iter(ShardStream(shards, str(tokenizer), batch, image_size, max_len, seed, 0, 1, LoaderState()))


def _fit(params, batches, steps: int, lr: float, loss_of) -> tuple[float, float]:
    """These evaluations' towers: AdamW (weight decay 0.01) on `params`, the next batch each step."""
    return fit(params, steps, lambda _: loss_of(next(batches)), lr, weight_decay=0.01)


def _frozen(module: nn.Module) -> nn.Module:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def train_lit_decoder(model, cfg: ModelConfig, shards: list[Path], tokenizer: Path, budget, seed: int = 0,
                      log=print) -> Captioner:
    enc = encoder_of(model)
    enc_cfg = getattr(getattr(model, "image_encoder", None), "cfg", None) or cfg
    dec_cfg = ModelConfig(**{**dataclasses.asdict(enc_cfg), "family": "cap", "masked_pred_prob": 0.0,
                             "vocab_size": cfg.vocab_size, "max_len": cfg.max_len})
    torch.manual_seed(seed)
    dev = next(enc.parameters()).device
    lit = Captioner(dec_cfg)
    lit.encoder = _frozen(enc)
    lit.to(dev)
    def loss_of(b):
        with torch.no_grad():
            memory = lit.encoder(as_input(b["images"].to(dev)))                       # (B, N, D), frozen
        labels = b["labels"].to(dev)                                        # (B, L)
        mask = self_mask(None, labels.shape[1], labels.shape[0], labels.device)
        return caption_loss(lit.decoder(shift_right(labels), mask, memory), labels)

    data = _batches(shards, tokenizer, budget.batch_size, dec_cfg.image_size, dec_cfg.max_len, seed)
    loss, secs = _fit(lit.decoder.parameters(), data, budget.steps, budget.lr, loss_of)
    log(f"eval: LiT decoder on the frozen {cfg.family} encoder, {budget.steps} steps of {budget.batch_size}, "
        f"final loss {loss:.3f} ({secs:.0f}s)")
    return lit.eval()


class LitText(nn.Module):
    """A text tower trained against frozen image features; score() as the contrastive models'."""

    def __init__(self, model, cfg: ModelConfig):
        super().__init__()
        self.model = model
        dim = cfg.dim
        self.text = TextEncoder(ModelConfig(**{**dataclasses.asdict(cfg), "family": "clip", "embed_dim": dim}))
        self.logit_scale = nn.Parameter(torch.tensor(np.log(1 / 0.07), dtype=torch.float32))

    def embed_image(self, images):
        with torch.no_grad():
            return F.normalize(self.model.image_features(images), dim=-1)

    def embed_text(self, tokens):
        return F.normalize(self.text(tokens), dim=-1)

    @torch.no_grad()
    def score(self, images, candidates):
        return self.embed_image(images) @ self.embed_text(candidates).T


def train_lit_text(model, cfg: ModelConfig, shards: list[Path], tokenizer: Path, budget, seed: int = 0,
                   log=print) -> LitText:
    _frozen(model)
    torch.manual_seed(seed)
    dev = next(model.parameters()).device
    lit = LitText(model, cfg).to(dev)
    def loss_of(b):
        return clip_loss(lit.embed_image(as_input(b["images"].to(dev))), lit.embed_text(b["labels"].to(dev)), lit.logit_scale)

    data = _batches(shards, tokenizer, budget.batch_size, cfg.image_size, cfg.max_len, seed + 1)
    loss, secs = _fit([*lit.text.parameters(), lit.logit_scale], data, budget.steps, budget.lr, loss_of)
    log(f"eval: LiT text tower on the frozen {cfg.family} encoder, {budget.steps} steps of {budget.batch_size}, "
        f"final loss {loss:.3f} ({secs:.0f}s)")
    return lit.eval()


def map_probe(train: tuple[torch.Tensor, np.ndarray], val: tuple[torch.Tensor, np.ndarray],
              test: tuple[torch.Tensor, np.ndarray], cfg: ModelConfig, steps: int, lrs: list[float],
              seed: int = 0) -> dict:
    """A MAP head + linear layer trained on `train` (tokens (B, N, D), labels) alone, full batch with
    Adam, for each learning rate of `lrs`, read at half and all of `steps`: the setting best on `val`
    (drawn from the few-shot pool, never the test split) is the one whose `test` accuracy counts, as
    the paper sweeps its probe's hyperparameters (Appendix A).
    -> {"accuracy": test accuracy, "lr": chosen, "steps": chosen, "val_accuracy": its val accuracy}."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    k = int(max(train[1].max(), val[1].max(), test[1].max())) + 1
    d = train[0].shape[-1]
    x, y = train[0].to(dev), torch.from_numpy(train[1]).to(dev)
    reads = sorted({max(1, steps // 2), steps})
    best = None

    def accuracy(pool, linear, tokens, labels):
        with torch.no_grad():
            pred = torch.cat([linear(pool(tokens[i:i + 256].to(dev))[:, 0]).argmax(1).cpu()
                              for i in range(0, len(tokens), 256)]).numpy()
        return float((pred == labels).mean())

    for lr in lrs:
        torch.manual_seed(seed)
        pool = MAPHead(d, cfg.num_heads, cfg.mlp_dim).to(dev)
        linear = nn.Linear(d, k).to(dev)

        def read(step, _loss):
            if step + 1 in reads:
                nonlocal best
                v = accuracy(pool, linear, *val)
                if best is None or v > best["val_accuracy"]:
                    best = {"accuracy": accuracy(pool, linear, *test), "lr": lr, "steps": step + 1, "val_accuracy": v}

        fit([*pool.parameters(), *linear.parameters()], steps,
            lambda _: F.cross_entropy(linear(pool(x)[:, 0]), y), lr, optimizer="adam", on_step=read)
    return best
