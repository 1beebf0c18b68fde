"""ClipCap (Mokady et al. 2021): a frozen image embedding mapped to a k-token prefix of a causal LM.

Shape key: B batch, E image embedding, k prefix length, D LM width, L caption positions, V vocabulary.

image embedding (B, E) -> mapper -> prefix (B, k, D)
sequence = prefix ++ embed([l1 .. l(L-1)])  (B, k + L - 1, D) -> causal LM -> logits
loss only on caption tokens: the logits at positions k-1 .. k+L-2 predict l1 .. lL.

Mapper "mlp": Linear(E, kD/2) -> tanh -> Linear(kD/2, kD), with the LM trained too.
Mapper "transformer": Linear(E, kD) gives k tokens, k learned constants join them, an 8-layer
8-head transformer runs over both, the constants' outputs are the prefix; the LM stays frozen.
The frozen image encoder is any capline encoder with `image_features(images) -> (B, E)` (or
precomputed embeddings); the LM is capline's decoder-only `TextDecoder`, trained from scratch with
the MLP mapper or loaded from a capline checkpoint's `lm.*` weights (`load_lm`). A frozen LM must
be a trained one: its output head starts at zero, so a fresh frozen LM gives logits of 0 and a
loss of ln V forever, and the transformer mapper refuses to start on one (`check_trainable`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .decoding import sequence_logprob
from .layers import causal_mask
from .losses import caption_loss
from .text import TextDecoder


class MLPMapper(nn.Module):
    def __init__(self, e: int, k: int, d: int):
        super().__init__()
        self.k, self.d = k, d
        self.net = nn.Sequential(nn.Linear(e, k * d // 2), nn.Tanh(), nn.Linear(k * d // 2, k * d))

    def forward(self, z):  # (B, E) -> (B, k, D)
        return self.net(z).view(z.shape[0], self.k, self.d)


class MapperBlock(nn.Module):
    """The reference mapper's layer: pre-LN; attention with no query/key/value biases (its output
    projection has one); an MLP of 2x width with ReLU. PyTorch's default initialisation, as there."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * d, bias=False)
        self.project = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x):  # (B, T, D) -> (B, T, D)
        b, t, d = x.shape
        h = self.norm1(x)
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        k, v = self.kv(h).chunk(2, dim=-1)
        y = F.scaled_dot_product_attention(split(self.q(h)), split(k), split(v))
        x = x + self.project(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TransformerMapper(nn.Module):
    """Linear(E, kD) gives k tokens, k learned constants (N(0, 1), as the reference) join them, the
    blocks run over both, the constants' outputs are the prefix."""

    def __init__(self, e: int, k: int, d: int, depth: int = 8, heads: int = 8):
        super().__init__()
        self.k, self.d = k, d
        self.proj = nn.Linear(e, k * d)
        self.const = nn.Parameter(torch.randn(1, k, d))
        heads = heads if d % heads == 0 else 1
        self.blocks = nn.ModuleList(MapperBlock(d, heads) for _ in range(depth))

    def forward(self, z):  # (B, E) -> (B, k, D)
        x = torch.cat([self.proj(z).view(z.shape[0], self.k, self.d), self.const.expand(z.shape[0], -1, -1)], 1)
        for blk in self.blocks:
            x = blk(x)
        return x[:, self.k:]


class ClipCap(nn.Module):
    def __init__(self, cfg: ModelConfig, image_encoder: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        k = cfg.prefix_length
        e = cfg.image_embed_dim or cfg.dim
        self.image_encoder = image_encoder
        if image_encoder is not None:
            for p in image_encoder.parameters():
                p.requires_grad_(False)
        if cfg.hf_lm:
            from .hf_lm import HFCausalLM

            self.lm = HFCausalLM(cfg.hf_lm)
            self.lm_loaded = True          # pretrained: it may stay frozen
        else:
            self.lm = TextDecoder(cfg, cfg.num_layers, cross=False, max_len=cfg.max_len + k)
        d = self.lm.width if cfg.hf_lm else cfg.dim
        self.mapper = MLPMapper(e, k, d) if cfg.mapper == "mlp" else TransformerMapper(e, k, d, depth=cfg.mapper_depth)
        if cfg.frozen_lm:
            for p in self.lm.parameters():
                p.requires_grad_(False)

    def train(self, mode: bool = True):
        """As the reference's ClipCaptionPrefix: a frozen LM stays in eval mode (no dropout) whatever
        the model is switched to, the frozen image encoder too; a trained LM follows `mode` (dropout
        while training, none while sampling)."""
        super().train(mode)
        if self.image_encoder is not None:
            self.image_encoder.eval()
        if self.cfg.frozen_lm:
            self.lm.eval()
        return self

    def load_lm(self, directory) -> None:
        """The LM's weights from a capline checkpoint that has one (a ClipCap model's `lm.*`)."""
        from pathlib import Path

        from safetensors.torch import load_file

        from infra.errors import UserError

        path = Path(directory) / "model.safetensors"
        if not path.is_file():
            raise UserError(f"train.lm_checkpoint {directory}: not a capline model checkpoint (no model.safetensors)")
        state = {k[3:]: v for k, v in load_file(str(path)).items() if k.startswith("lm.")}
        if not state:
            raise UserError(f"train.lm_checkpoint {directory}: has no language model (no lm.* weights); "
                            "give a ClipCap checkpoint whose LM was trained (mapper: mlp)")
        try:
            self.lm.load_state_dict(state)
        except RuntimeError as err:
            raise UserError(f"train.lm_checkpoint {directory}: its LM does not fit this one (width, depth, "
                            f"vocabulary, max_len + prefix_len must match): {str(err).splitlines()[0][:200]}") from None
        self.lm_loaded = True

    def check_trainable(self) -> None:
        from infra.errors import UserError

        frozen = not any(p.requires_grad for p in self.lm.parameters())
        if frozen and not getattr(self, "lm_loaded", False):
            raise UserError("clipcap with a frozen LM (mapper: transformer, or lm_frozen: true), and this LM is freshly "
                            "initialised (its output head is zero: the loss would stay at ln V); set train.lm_path to a "
                            "local Hugging Face GPT-2 folder, or train.lm_checkpoint to a trained ClipCap checkpoint, "
                            "or let the LM train (mapper: mlp, or model_args.lm_frozen: false)")

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) -> (B, E): the frozen image model's features (what the mapper sees), for probes."""
        return self.image_embedding(images)

    def image_embedding(self, images: torch.Tensor) -> torch.Tensor:
        if self.image_encoder is None:
            raise ValueError("ClipCap was built without an image encoder: pass embeddings instead")
        self.image_encoder.eval()
        with torch.no_grad():
            enc = self.image_encoder
            if hasattr(enc, "image_proj"):      # CLIP's encode_image: the projected, unnormalised embedding
                return enc.image_proj(enc.encoder.pooled(enc.encoder(images)))
            return enc.image_features(images)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """embeddings (B, E), labels (B, L) -> logits over the caption (B, L, V)."""
        k = self.cfg.prefix_length
        prefix = self.mapper(embeddings)                                   # (B, k, D)
        x = torch.cat([prefix, self.lm.embed(labels[:, :-1])], dim=1)      # (B, k+L-1, D)
        h = self.lm.hidden(x, causal_mask(x.shape[1], x.device))
        return self.lm.head(h[:, k - 1:])

    def loss(self, images_or_embeddings, labels, generator=None):
        z = self._z(images_or_embeddings)
        loss = caption_loss(self(z, labels), labels, per="token")     # as the reference: over all tokens
        return loss, {"caption_loss": loss.detach()}

    def _z(self, x):
        return x if x.dim() == 2 else self.image_embedding(x)

    # decoding interface: the prefix is the "memory", fed through the LM at the first step
    def start(self, images_or_embeddings):
        return self.mapper(self._z(images_or_embeddings))

    def new_cache(self):
        # a Hugging Face LM reruns the whole sequence each step: the cache holds the tokens so far (a
        # tensor, so beam search reorders it like any cache)
        return {"seq": None} if self.cfg.hf_lm else self.lm.new_cache()

    def step(self, tokens, prefix, cache, start):
        k = self.cfg.prefix_length
        if self.cfg.hf_lm and cache is not None:
            if start == 0:
                cache["seq"] = tokens[:, :0]
                x = prefix
            else:
                cache["seq"] = torch.cat([cache["seq"], tokens], dim=1)
                x = torch.cat([prefix, self.lm.embed(cache["seq"])], dim=1)
            return self.lm.head(self.lm.hidden(x))[:, -tokens.shape[1]:]
        if cache is None:  # rerun everything: prefix + tokens after BOS
            x = torch.cat([prefix, self.lm.embed(tokens[:, 1:])], dim=1)
            return self.lm.head(self.lm.hidden(x, causal_mask(x.shape[1], x.device)))
        if start == 0:     # first step: run the prefix, its last position predicts token 1
            return self.lm.head(self.lm.hidden(prefix, causal_mask(k, prefix.device), cache=cache))
        return self.lm.head(self.lm.hidden(self.lm.embed(tokens), None, cache=cache, start=k + start - 1))

    @torch.no_grad()
    def score_ar(self, images_or_embeddings, candidates):
        z = self._z(images_or_embeddings)
        return torch.stack([sequence_logprob(self(z[i:i + 1].expand(candidates.shape[0], -1), candidates), candidates)
                            for i in range(z.shape[0])])
