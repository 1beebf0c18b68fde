"""CLIP* (softmax) and SigLIP (sigmoid) two-tower models.

Shape key: B batch, S image side, N image tokens, D width, L text positions, E embedding.
images (B, 3, S, S) -> ViT tokens (B, N, D) -> GAP or MAP (B, D) -> linear (B, E) -> L2-normalised.
tokens (B, L) -> text tower of the same size -> (B, E) -> L2-normalised.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import init_linear
from .losses import clip_loss, siglip_loss
from .text import TextEncoder
from .vit import ViT


class TwoTower(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = ViT(cfg)
        # big_vision's two towers: each tower's head a flax Dense at its default init (lecun normal;
        # the image head's head_zeroinit is off), not PyTorch's (a third of the variance)
        self.image_proj = nn.Linear(cfg.dim, cfg.out_dim, bias=False)
        init_linear(self.image_proj, "lecun")
        self.text = TextEncoder(cfg)
        if cfg.family == "siglip":
            self.t_prime = nn.Parameter(torch.tensor(math.log(10.0)))
            self.bias = nn.Parameter(torch.tensor(-10.0))
        else:
            self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def embed_image(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.image_proj(self.encoder.pooled(self.encoder(images))), dim=-1)

    def embed_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text(tokens), dim=-1)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) -> (B, D) pooled encoder output (before the projection), for probes."""
        return self.encoder.pooled(self.encoder(images))

    def loss(self, images, labels, generator=None) -> tuple[torch.Tensor, dict]:
        zi, zt = self.embed_image(images), self.embed_text(labels)
        if self.cfg.family == "siglip":
            loss = siglip_loss(zi, zt, self.t_prime, self.bias)
            return loss, {"contrastive_loss": loss.detach(), "temperature": self.t_prime.exp().detach()}
        loss = clip_loss(zi, zt, self.logit_scale)
        return loss, {"contrastive_loss": loss.detach(), "logit_scale": self.logit_scale.exp().detach()}

    @torch.no_grad()
    def score(self, images: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Cosine similarity of every image with every candidate text: (B, 3, S, S), (C, L) -> (B, C)."""
        return self.embed_image(images) @ self.embed_text(candidates).T
