"""Text transformers: a decoder (causal or full, optional cross-attention) and an encoder tower.

Shape key: B batch, L positions, D width, V vocabulary, M memory tokens (image tokens).
Token ids: 0 pad (also the decoder's BOS), 1 EOS, V the extra input-only id ([MASK] / [CLS]).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import PAD_ID, ModelConfig
from .layers import Block, MAPHead, causal_mask, init_linear, layer_norm


class TextDecoder(nn.Module):
    """Embedding (V+1 rows, std 1) + learned positions + blocks + final LN + untied, zero-init head."""

    def __init__(self, cfg: ModelConfig, layers: int, cross: bool, max_len: int | None = None,
                 head: bool = True, embed: bool = True, positions: bool = True):
        super().__init__()
        d = cfg.dim
        self.embed = nn.Embedding(cfg.vocab_size + 1, d) if embed else None  # init N(0, 1)
        # big_vision's CapPa decoder: positions N(0, 1/D), attention with flax's default lecun_normal
        self.pos = nn.Parameter(torch.randn(1, max_len or cfg.max_len, d) * d ** -0.5) if positions else None
        self.blocks = nn.ModuleList(Block(d, cfg.num_heads, cfg.mlp_dim, cross=cross, bias=cfg.bias, attn_init="lecun")
                                    for _ in range(layers))
        # big_vision's decoder ends in a LayerNorm with its bias (flax's default) even where the
        # blocks have none (decoder_bias off)
        self.ln = layer_norm(d, True)
        self.head = nn.Linear(d, cfg.vocab_size) if head else None
        if self.head is not None:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def hidden(self, x: torch.Tensor, mask: torch.Tensor | None, memory: torch.Tensor | None = None,
               cache: list | None = None, start: int = 0) -> torch.Tensor:
        """x: (B, L, D) input embeddings (positions are added here, from `start`) -> (B, L, D)."""
        if self.pos is not None:
            x = x + self.pos[:, start:start + x.shape[1]]
        for i, blk in enumerate(self.blocks):
            x = blk(x, mask=mask, memory=memory, cache=None if cache is None else cache[i])
        return self.ln(x)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None, memory: torch.Tensor | None = None,
                cache: list | None = None, start: int = 0) -> torch.Tensor:
        """tokens (B, L) -> logits (B, L, V)."""
        return self.head(self.hidden(self.embed(tokens), mask, memory, cache, start))

    def new_cache(self) -> list:
        return [{} for _ in self.blocks]


class TextEncoder(nn.Module):
    """The text tower of CLIP* / SigLIP: bidirectional over non-pad tokens, pooled, projected.

    tokens (B, L) -> embedding (B, E), not yet normalised.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.dim
        # big_vision's text tower is its ViT encoder over token embeddings: flax's Embed init
        # N(0, 1/D), positions N(0, 1/D), xavier blocks with the encoder's biases
        bias = cfg.encoder_bias
        self.embed = nn.Embedding(cfg.vocab_size, d)
        nn.init.normal_(self.embed.weight, std=d ** -0.5)
        self.pos = nn.Parameter(torch.randn(1, cfg.max_len, d) * d ** -0.5)
        self.blocks = nn.ModuleList(Block(d, cfg.num_heads, cfg.mlp_dim, bias=bias) for _ in range(cfg.num_layers))
        self.ln = layer_norm(d, bias)
        self.map = MAPHead(d, cfg.num_heads, cfg.mlp_dim, bias=bias) if cfg.pool == "map" else None
        self.proj = nn.Linear(d, cfg.out_dim, bias=False)
        init_linear(self.proj, "lecun")     # flax's default Dense init, as big_vision's text head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        valid = tokens != PAD_ID                                    # (B, L)
        valid = valid | (~valid.any(1, keepdim=True) & (torch.arange(tokens.shape[1], device=tokens.device) == 0))  # empty text
        mask = valid[:, None, None, :]                              # keys only
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x, mask=mask)
        x = self.ln(x)
        if self.map is not None:
            pooled = self.map(x, key_mask=valid)[:, 0]
        else:
            w = valid.unsqueeze(-1).to(x.dtype)
            pooled = (x * w).sum(1) / w.sum(1)
        return self.proj(pooled)


def shift_right(labels: torch.Tensor) -> torch.Tensor:
    """Decoder inputs for teacher forcing: labels shifted right, pad (0) acting as BOS."""
    return torch.cat([torch.full_like(labels[:, :1], PAD_ID), labels[:, :-1]], dim=1)


def self_mask(pa_rows: torch.Tensor | None, length: int, batch: int, device: torch.device) -> torch.Tensor:
    """(B, 1, L, L): causal for autoregressive rows, full for parallel-prediction rows (on `device`,
    the tokens': a mask made elsewhere fails on a GPU)."""
    causal = causal_mask(length, device)
    mask = causal.expand(batch, 1, length, length)
    if pa_rows is None:
        return mask
    return mask | pa_rows[:, None, None, None]
