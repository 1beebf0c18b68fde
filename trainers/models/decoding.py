"""Greedy and beam decoding with a key/value cache, for any model with the step interface:

    model.start(images) -> memory                      (B, M, D) whatever the decoder attends to
    model.step(tokens, memory, cache, start) -> logits (B, T, V) for the T new tokens
    model.new_cache() -> cache                         per-layer dicts the step fills

Without a cache (`use_cache=False`) every step reruns the whole prefix; tests check both agree.
"""
from __future__ import annotations

import torch

from .config import EOS_ID, PAD_ID


def _reorder(cache, index: torch.Tensor):
    if isinstance(cache, dict):
        return {k: _reorder(v, index) for k, v in cache.items()}
    if isinstance(cache, list):
        return [_reorder(v, index) for v in cache]
    return cache.index_select(0, index)


@torch.no_grad()
def _ends(tok: torch.Tensor, stop: list[int] | None) -> torch.Tensor:
    """Whether each token ends its caption: EOS, or one of `stop` (kept in the caption)."""
    ended = tok == EOS_ID
    if stop:
        ended = ended | torch.isin(tok, torch.tensor(stop, device=tok.device))
    return ended


def greedy(model, images: torch.Tensor, max_len: int, use_cache: bool = True,
           stop: list[int] | None = None) -> torch.Tensor:
    """Argmax decoding -> (B, max_len) token ids, PAD after EOS (or after a `stop` token)."""
    memory = model.start(images)
    b = memory.shape[0]
    seqs = torch.full((b, 1), PAD_ID, dtype=torch.long, device=memory.device)  # BOS
    done = torch.zeros(b, dtype=torch.bool, device=memory.device)
    cache = model.new_cache() if use_cache else None
    for t in range(max_len):
        logits = (model.step(seqs[:, -1:], memory, cache, t) if use_cache else model.step(seqs, memory, None, 0))[:, -1]
        tok = torch.where(done, torch.full_like(done, PAD_ID, dtype=torch.long), logits.argmax(-1))
        seqs = torch.cat([seqs, tok[:, None]], dim=1)
        done = done | _ends(tok, stop)
        if done.device.type != "meta" and done.all():   # meta: no values to stop on (the device test)
            break
    out = seqs[:, 1:]
    return torch.cat([out, out.new_full((b, max_len - out.shape[1]), PAD_ID)], dim=1)


@torch.no_grad()
def beam_search(model, images: torch.Tensor, max_len: int, beam: int = 4, use_cache: bool = True,
                length_penalty: float = 0.0, stop: list[int] | None = None) -> torch.Tensor:
    """Beam search; returns the best finished hypothesis per image, (B, max_len)."""
    memory = model.start(images)                                  # (B, M, D)
    b = memory.shape[0]
    memory = memory.repeat_interleave(beam, dim=0)                # (B*K, M, D)
    seqs = torch.full((b * beam, 1), PAD_ID, dtype=torch.long, device=memory.device)  # BOS
    scores = torch.zeros(b, beam, device=memory.device)
    scores[:, 1:] = float("-inf")                                 # all beams start identical
    finished = torch.zeros(b * beam, dtype=torch.bool, device=memory.device)
    cache = model.new_cache() if use_cache else None
    for t in range(max_len):
        if use_cache:
            logits = model.step(seqs[:, -1:], memory, cache, t)[:, -1]
        else:
            logits = model.step(seqs, memory, None, 0)[:, -1]
        logp = torch.log_softmax(logits.float(), dim=-1)          # (B*K, V)
        v = logp.shape[-1]
        # finished beams only extend with PAD at no cost
        logp = torch.where(finished[:, None], torch.full_like(logp, float("-inf")), logp)
        logp[finished, PAD_ID] = 0.0
        cand = (scores.view(-1, 1) + logp).view(b, beam * v)
        top, idx = cand.topk(beam, dim=-1)                        # (B, K)
        src = (idx // v) + torch.arange(b, device=idx.device)[:, None] * beam
        tok = idx % v
        src, tok = src.view(-1), tok.view(-1)
        seqs = torch.cat([seqs.index_select(0, src), tok[:, None]], dim=1)
        finished = finished.index_select(0, src) | _ends(tok, stop)
        scores = top
        if use_cache:
            cache = _reorder(cache, src)
        if finished.device.type != "meta" and finished.all():
            break
    out = seqs[:, 1:]
    if length_penalty:
        lengths = ((out != PAD_ID).sum(1).float().clamp(min=1) ** length_penalty).view(b, beam)
        scores = scores / lengths
    best = scores.argmax(dim=1) + torch.arange(b, device=scores.device) * beam
    out = out.index_select(0, best)
    if out.shape[1] < max_len:
        out = torch.cat([out, out.new_full((b, max_len - out.shape[1]), PAD_ID)], dim=1)
    return out


def sequence_logprob(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed log-likelihood of each label sequence over its non-pad tokens (EOS included).

    logits (B, L, V), labels (B, L) -> (B,)
    """
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (logp * (labels != PAD_ID)).sum(1)
