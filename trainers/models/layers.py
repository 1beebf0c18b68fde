"""Transformer building blocks shared by every model family.

Shape key: B batch, N image tokens, L text positions, D width, H heads, Dh = D / H, V vocabulary.
Attention masks are boolean, True = may attend, broadcastable to (B, H, Lq, Lk).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def layer_norm(d: int, bias: bool) -> nn.LayerNorm:
    return nn.LayerNorm(d, eps=1e-6, bias=bias)


# big_vision's initialisers (flax): a PyTorch default Linear has std 1/sqrt(3 fan_in) (0.0208 for
# fan_in 768), xavier_uniform sqrt(2/(fan_in+fan_out)) (0.0361 for 768x768, 0.0228 for 768x3072).
def lecun_normal_(w: torch.Tensor) -> torch.Tensor:
    """flax lecun_normal: truncated normal (at 2 std) of variance 1/fan_in, corrected for the truncation."""
    fan_in = w[0].numel()
    return nn.init.trunc_normal_(w, std=(1.0 / fan_in) ** 0.5 / 0.87962566103423978, a=-2 * (1.0 / fan_in) ** 0.5
                                 / 0.87962566103423978, b=2 * (1.0 / fan_in) ** 0.5 / 0.87962566103423978)


def init_linear(layer: nn.Linear, kind: str, bias_std: float = 0.0) -> None:
    """kind "xavier" (big_vision's ViT attention and every MLP) or "lecun" (flax's default, the CapPa
    decoder's attention); biases zero, or normal(bias_std) as big_vision's MLP biases (1e-6)."""
    with torch.no_grad():
        nn.init.xavier_uniform_(layer.weight) if kind == "xavier" else lecun_normal_(layer.weight)
        if layer.bias is not None:
            nn.init.normal_(layer.bias, std=bias_std) if bias_std else nn.init.zeros_(layer.bias)


class Attention(nn.Module):
    """Multi-head attention via scaled_dot_product_attention, with an optional key/value cache.

    cache: a dict this module fills. For self-attention it appends this call's keys/values to the
    cached ones (incremental decoding); for cross-attention (`static_kv=True`) it computes the
    memory's keys/values once and reuses them.
    """

    def __init__(self, d: int, heads: int, bias: bool = False, init: str = "xavier", kv_dim: int | None = None):
        super().__init__()
        assert d % heads == 0, f"width {d} is not divisible by {heads} heads"
        self.heads = heads
        self.q = nn.Linear(d, d, bias=bias)
        self.k = nn.Linear(kv_dim or d, d, bias=bias)       # kv_dim: keys and values from a wider (image) side
        self.v = nn.Linear(kv_dim or d, d, bias=bias)
        self.out = nn.Linear(d, d, bias=bias)
        for layer in (self.q, self.k, self.v, self.out):
            init_linear(layer, init)

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, D) -> (B, H, L, Dh)
        b, n, d = x.shape
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                cache: dict | None = None, static_kv: bool = False) -> torch.Tensor:
        q = self._split(self.q(x))
        src = x if kv is None else kv
        if cache is not None and static_kv and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            k, v = self._split(self.k(src)), self._split(self.v(src))
            if cache is not None:
                if not static_kv and "k" in cache:
                    k = torch.cat([cache["k"], k], dim=2)
                    v = torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, h, n, dh = y.shape
        return self.out(y.transpose(1, 2).reshape(b, n, h * dh))


class MLP(nn.Sequential):
    def __init__(self, d: int, hidden: int, bias: bool = False):
        super().__init__(nn.Linear(d, hidden, bias=bias), nn.GELU(approximate="tanh"),
                         nn.Linear(hidden, d, bias=bias))
        init_linear(self[0], "xavier", 1e-6)
        init_linear(self[2], "xavier", 1e-6)


class Block(nn.Module):
    """Pre-LN block: x = t + SelfAttn(LN(t), mask); [x = x + CrossAttn(LN(x), memory)]; x + MLP(LN(x))."""

    def __init__(self, d: int, heads: int, mlp: int, cross: bool = False, bias: bool = False,
                 attn_init: str = "xavier"):
        super().__init__()
        self.ln1 = layer_norm(d, bias)
        self.attn = Attention(d, heads, bias, attn_init)
        self.cross = cross
        if cross:
            self.ln_x = layer_norm(d, bias)
            self.xattn = Attention(d, heads, bias, attn_init)
        self.ln2 = layer_norm(d, bias)
        self.mlp = MLP(d, mlp, bias)

    def forward(self, x, mask=None, memory=None, memory_mask=None, cache: dict | None = None):
        x = x + self.attn(self.ln1(x), mask=mask, cache=None if cache is None else cache.setdefault("self", {}))
        if self.cross:
            x = x + self.xattn(self.ln_x(x), kv=memory, mask=memory_mask,
                               cache=None if cache is None else cache.setdefault("cross", {}), static_kv=True)
        return x + self.mlp(self.ln2(x))


class MAPHead(nn.Module):
    """Multihead attention pooling: `queries` learned probes attend to the tokens, then a residual MLP.

    (B, N, K) -> (B, queries, D), K = kv_dim (default D)
    """

    def __init__(self, d: int, heads: int, mlp: int, queries: int = 1, bias: bool = False, kv_dim: int | None = None):
        super().__init__()
        # big_vision: xavier_uniform over a (1, 1, D) probe, i.e. U(+-sqrt(6 / (1 + D)))
        self.probe = nn.Parameter(torch.empty(1, queries, d).uniform_(-(6 / (1 + d)) ** 0.5, (6 / (1 + d)) ** 0.5))
        self.attn = Attention(d, heads, bias, kv_dim=kv_dim)
        self.ln = layer_norm(d, bias)
        self.mlp = MLP(d, mlp, bias)

    def forward(self, tokens: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        probe = self.probe.expand(tokens.shape[0], -1, -1)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        x = self.attn(probe, kv=tokens, mask=mask)
        return x + self.mlp(self.ln(x))


def causal_mask(n: int, device=None) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()
