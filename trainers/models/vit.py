"""Vision Transformer encoder.

Shape key: B batch, C=3 channels, S image side, P patch side, N = (S/P)^2 patches, D width.
images (B, 3, S, S) in [-1, 1] -> tokens (B, N, D) after the final LayerNorm; pooled (B, D).
Learned position embeddings, no class token (pooling is GAP or a MAP head), pre-LN blocks.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import Block, MAPHead, layer_norm, lecun_normal_


class ViT(nn.Module):
    def __init__(self, cfg: ModelConfig, pool: str | None = None):
        super().__init__()
        d, p = cfg.dim, cfg.patch_size
        self.patch = p
        n = (cfg.image_size // p) ** 2
        bias = cfg.encoder_bias
        # big_vision's ViT: lecun-normal patch kernel, positions N(0, 1/D), xavier blocks with biases
        self.embed = nn.Conv2d(3, d, kernel_size=p, stride=p, bias=True)
        with torch.no_grad():
            lecun_normal_(self.embed.weight)
            nn.init.zeros_(self.embed.bias)
        self.pos = nn.Parameter(torch.randn(1, n, d) * d ** -0.5)
        self.blocks = nn.ModuleList(Block(d, cfg.num_heads, cfg.mlp_dim, bias=bias) for _ in range(cfg.num_layers))
        self.ln = layer_norm(d, bias)
        self.pool = pool or cfg.pool
        self.map = MAPHead(d, cfg.num_heads, cfg.mlp_dim, bias=bias) if self.pool == "map" else None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) -> all final patch tokens (B, N, D)."""
        x = self.embed(images).flatten(2).transpose(1, 2) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x)

    def pooled(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, N, D) -> (B, D) by global average or the MAP head."""
        if self.map is not None:
            return self.map(tokens)[:, 0]
        return tokens.mean(dim=1)
