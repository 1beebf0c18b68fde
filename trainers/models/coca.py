"""CoCa (Yu et al. 2022): contrastive + captioning with one image encoder and a split text decoder.

Shape key: B batch, S image side, N image tokens, Q caption queries, D image width, T text width
(D unless the size's open_clip config narrows it: L/14 has D 1024, T 768), L text positions,
V vocabulary, E embedding.

images -> ViT tokens (B, N, D) -> contrastive pooler (1 query) -> (B, E) image embedding
                                -> caption pooler (Q queries of width T) -> (B, Q, T), all Q seen by the decoder
labels (B, L) -> inputs [BOS, l1 .. l(L-1)] + [CLS] -> unimodal half (causal, no cross-attention, width T)
   the CLS position (which attends to every real token) -> (B, E) text embedding
   positions 0..L-1 -> multimodal half (causal + cross-attention) -> logits (B, L, V)

Pitfalls of open_clip's version avoided on purpose: the vocabulary projection is initialised (zero,
like Cap's), [CLS] is its own id (V) instead of colliding with padding, the contrastive and caption
poolers are separate so the decoder sees all Q caption tokens, and padding is masked as keys.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import PAD_ID, ModelConfig
from .decoding import sequence_logprob
from .layers import MAPHead, causal_mask, init_linear, layer_norm
from .losses import caption_loss, clip_loss
from .text import TextDecoder, shift_right
from .vit import ViT


class CoCa(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # the text tower as open_clip's CoCa configs have it (ModelConfig.coca_text): B/16 12 + 12
        # layers as wide as the encoder, L/14 12 + 12 layers 768 wide beside a 1024-wide ViT
        # (decoder_depth overrides both halves)
        d = cfg.dim
        tw, th, tm, half = cfg.coca_text()
        text = dataclasses.replace(cfg, width=tw, heads=th, mlp=tm)
        self.encoder = ViT(cfg, pool="gap")
        self.con_pool = MAPHead(d, cfg.num_heads, cfg.mlp_dim, queries=1, bias=cfg.bias)
        self.cap_pool = MAPHead(tw, th, tm, queries=cfg.caption_queries, bias=cfg.bias, kv_dim=d)
        self.cap_ln = layer_norm(tw, cfg.bias)
        self.image_proj = nn.Linear(d, cfg.out_dim, bias=False)
        init_linear(self.image_proj, "lecun")     # flax's default Dense init, as big_vision's heads
        # unimodal: embeddings (V+1 rows: id V is [CLS]) and causal blocks, positions for L + 1
        self.unimodal = TextDecoder(text, half, cross=False, max_len=cfg.max_len + 1, head=False)
        self.text_proj = nn.Linear(tw, cfg.out_dim, bias=False)
        init_linear(self.text_proj, "lecun")
        # no positions of its own: they are already in the unimodal output
        self.multimodal = TextDecoder(text, half, cross=True, embed=False, positions=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def _image(self, images):
        tokens = self.encoder(images)                                  # (B, N, D)
        zimg = F.normalize(self.image_proj(self.con_pool(tokens)[:, 0]), dim=-1)
        memory = self.cap_ln(self.cap_pool(tokens))                    # (B, Q, D)
        return zimg, memory

    def _unimodal(self, labels: torch.Tensor):
        """-> hidden states of positions 0..L-1 (B, L, D) and the text embedding (B, E)."""
        b, length = labels.shape
        inputs = torch.cat([shift_right(labels), torch.full_like(labels[:, :1], self.cfg.mask_id)], dim=1)
        # Input position t holds label t-1 (t=0: BOS). Position t is real if label t is not pad, or
        # t == 0; [CLS] (position L) attends to every real position, pads to nothing but themselves.
        real = torch.cat([torch.ones_like(labels[:, :1], dtype=torch.bool), labels[:, :-1] != PAD_ID,
                          torch.ones_like(labels[:, :1], dtype=torch.bool)], dim=1)      # (B, L+1)
        mask = causal_mask(length + 1, labels.device)[None] & real[:, None, :]
        mask = (mask | torch.eye(length + 1, dtype=torch.bool, device=labels.device)[None])[:, None]
        h = self.unimodal.hidden(self.unimodal.embed(inputs), mask)
        ztxt = F.normalize(self.text_proj(h[:, -1]), dim=-1)
        return h[:, :-1], ztxt

    def forward(self, images, labels):
        """-> caption logits (B, L, V), image embedding (B, E), text embedding (B, E)."""
        zimg, memory = self._image(images)
        h, ztxt = self._unimodal(labels)
        mask = causal_mask(labels.shape[1], labels.device)
        logits = self.multimodal.head(self.multimodal.hidden(h, mask, memory))
        return logits, zimg, ztxt

    def loss(self, images, labels, generator=None):
        logits, zimg, ztxt = self(images, labels)
        con = clip_loss(zimg, ztxt, self.logit_scale)
        cap = caption_loss(logits, labels)
        loss = self.cfg.contrastive_weight * con + self.cfg.caption_weight * cap
        return loss, {"contrastive_loss": con.detach(), "caption_loss": cap.detach()}

    def image_features(self, images):
        return self.encoder(images).mean(1)

    # decoding interface: the unimodal half runs causally without [CLS], then the multimodal half
    def start(self, images):
        return self._image(images)[1]

    def new_cache(self):
        return {"uni": self.unimodal.new_cache(), "multi": self.multimodal.new_cache()}

    def step(self, tokens, memory, cache, start):
        t = tokens.shape[1]
        mask = None if cache is not None and t == 1 else causal_mask(t, tokens.device)
        h = self.unimodal.hidden(self.unimodal.embed(tokens), mask, cache=None if cache is None else cache["uni"],
                                 start=start)
        h = self.multimodal.hidden(h, mask, memory, cache=None if cache is None else cache["multi"], start=start)
        return self.multimodal.head(h)

    def embed_image(self, images):
        """(B, 3, S, S) -> (B, E), unit length."""
        return self._image(images)[0]

    def embed_text(self, tokens):
        """(C, L) -> (C, E), unit length."""
        return self._unimodal(tokens)[1]

    @torch.no_grad()
    def score(self, images, candidates):
        """Cosine of image and text embeddings, (B, 3, S, S), (C, L) -> (B, C)."""
        return self.embed_image(images) @ self.embed_text(candidates).T

    @torch.no_grad()
    def score_ar(self, images, candidates):
        memory = self.start(images)
        out = []
        for i in range(memory.shape[0]):
            mem = memory[i:i + 1].expand(candidates.shape[0], -1, -1)
            h, _ = self._unimodal(candidates)
            logits = self.multimodal.head(self.multimodal.hidden(h, causal_mask(candidates.shape[1], candidates.device), mem))
            out.append(sequence_logprob(logits, candidates))
        return torch.stack(out)
