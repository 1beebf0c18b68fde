"""Cap and CapPa (Tschannen et al. 2023): a ViT encoder and a Transformer decoder of the same width,
heads and MLP size and half its depth, cross-attending to all final image tokens.

Shape key: B batch, S image side, N image tokens, D width, L caption positions, V vocabulary,
C candidate captions per image.

Training: each example independently, with probability `masked_pred_prob` (0.75 CapPa, 0 Cap), is
a parallel-prediction (Pa) example: every decoder input is [MASK] (id V) and self-attention is
full; the others are autoregressive: labels shifted right (pad 0 as BOS), causal mask. Same labels,
same loss, one batch, one pass.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .decoding import sequence_logprob
from .losses import caption_loss
from .text import TextDecoder, self_mask, shift_right
from .vit import ViT


class Captioner(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = ViT(cfg)
        self.decoder = TextDecoder(cfg, cfg.dec_layers, cross=True)

    # --- training -------------------------------------------------------------------------
    def decoder_inputs(self, labels: torch.Tensor, pa_rows: torch.Tensor) -> torch.Tensor:
        """(B, L) labels, (B,) bool -> (B, L) inputs: shifted labels, or all [MASK] on Pa rows."""
        masked = torch.full_like(labels, self.cfg.mask_id)
        return torch.where(pa_rows[:, None], masked, shift_right(labels))

    def sample_pa_rows(self, batch: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        """(batch,) bool on `device`: the rows decoded in parallel. Drawn where the generator lives
        (the loop's is a CPU generator, checkpointed with the run), then moved: CUDA refuses a CPU
        generator, and a draw on the device would leave the checkpointed state unused."""
        p = self.cfg.pa_prob
        if p <= 0:
            return torch.zeros(batch, dtype=torch.bool, device=device)
        at = generator.device if generator is not None else device
        return (torch.rand(batch, generator=generator, device=at) < p).to(device)

    def forward(self, images: torch.Tensor, labels: torch.Tensor, pa_rows: torch.Tensor | None = None) -> torch.Tensor:
        """images (B, 3, S, S), labels (B, L) -> logits (B, L, V). pa_rows None: all autoregressive."""
        if pa_rows is None:
            pa_rows = torch.zeros(labels.shape[0], dtype=torch.bool, device=labels.device)
        memory = self.encoder(images)
        mask = self_mask(pa_rows, labels.shape[1], labels.shape[0], labels.device)
        return self.decoder(self.decoder_inputs(labels, pa_rows), mask, memory)

    def loss(self, images, labels, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
        pa_rows = self.sample_pa_rows(labels.shape[0], generator, labels.device)
        loss = caption_loss(self(images, labels, pa_rows), labels)
        return loss, {"caption_loss": loss.detach(), "pa_fraction": pa_rows.float().mean()}

    # --- features for probes ----------------------------------------------------------------
    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) -> (B, D): global average of the final encoder tokens (the paper's probe)."""
        return self.encoder(images).mean(1)

    # --- decoding interface (trainers/models/decoding.py) -----------------------------------
    def start(self, images):
        return self.encoder(images)

    def new_cache(self):
        return self.decoder.new_cache()

    def step(self, tokens, memory, cache, start):
        t = tokens.shape[1]
        mask = None if cache is not None and t == 1 else self_mask(None, t, tokens.shape[0], tokens.device)
        return self.decoder(tokens, mask, memory, cache, start)

    # --- scoring ------------------------------------------------------------------------------
    @torch.no_grad()
    def score_ar(self, images: torch.Tensor, candidates: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """Summed autoregressive log-likelihood of every candidate for every image.

        images (B, 3, S, S), candidates (C, L) -> (B, C). One teacher-forced pass per (image, candidate).
        """
        memory = self.encoder(images)
        out = []
        for i in range(memory.shape[0]):
            row = []
            for c0 in range(0, candidates.shape[0], chunk):
                cand = candidates[c0:c0 + chunk]
                mem = memory[i:i + 1].expand(cand.shape[0], -1, -1)
                mask = self_mask(None, cand.shape[1], cand.shape[0], cand.device)
                logits = self.decoder(shift_right(cand), mask, mem)
                row.append(sequence_logprob(logits, cand))
            out.append(torch.cat(row))
        return torch.stack(out)

    @torch.no_grad()
    def score_parallel(self, images: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """One decoder pass per image with all-[MASK] inputs scores every candidate at once.

        The Pa pass's per-position distributions do not depend on the caption, so a candidate's
        score is the sum over its non-pad positions of log p_t(token_t). (B, 3, S, S), (C, L) -> (B, C).
        """
        memory = self.encoder(images)
        b, length = memory.shape[0], candidates.shape[1]
        inputs = torch.full((b, length), self.cfg.mask_id, dtype=torch.long, device=memory.device)
        logp = torch.log_softmax(self.decoder(inputs, None, memory).float(), dim=-1)   # (B, L, V)
        valid = (candidates != 0).float()                                                # (C, L)
        picked = logp[:, torch.arange(length, device=logp.device)[None, :], candidates]                      # (B, C, L)
        return (picked * valid[None]).sum(-1)
