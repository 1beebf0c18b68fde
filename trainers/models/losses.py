"""Losses: token cross-entropy, softmax CLIP, sigmoid SigLIP, and gathering across workers.

Shape key: B batch (per worker), G global batch, L positions, V vocabulary, E embedding.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import PAD_ID


def caption_loss(logits: torch.Tensor, labels: torch.Tensor, per: str = "example") -> torch.Tensor:
    """Softmax CE over non-pad tokens (EOS counts), averaged per example, then over the batch (big_vision's
    captioners); per="token": over all the batch's tokens at once (ClipCap's reference).

    logits (B, L, V), labels (B, L) -> scalar.
    """
    ce = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")  # (B, L)
    valid = (labels != PAD_ID).float()
    if per == "token":
        return (ce * valid).sum() / valid.sum().clamp(min=1)
    per_example = (ce * valid).sum(1) / valid.sum(1).clamp(min=1)
    return per_example.mean()


class _GatherWithGrad(torch.autograd.Function):
    """all_gather forward; backward sums every worker's gradient and hands each its own rows."""

    @staticmethod
    def forward(ctx, x):
        world = dist.get_world_size()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.world, ctx.rows = dist.get_rank(), world, x.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """(B, E) on each worker -> (G, E) everywhere, gradients flowing back to each worker's rows.
    Every worker must hold the same B."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    return _GatherWithGrad.apply(x)


def clip_loss(zimg: torch.Tensor, ztxt: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """Mean of image->text and text->image CE over the (gathered) batch. z* (B, E) normalised.

    Every worker computes the loss over the whole gathered batch; with the gather's backward summing
    contributions and data-parallel averaging of gradients, the result is the full-batch gradient.
    """
    zi, zt = gather_with_grad(zimg), gather_with_grad(ztxt)
    logits = logit_scale.exp().clamp(max=100.0) * zi @ zt.T   # (G, G)
    target = torch.arange(zi.shape[0], device=zi.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


def siglip_loss(zimg: torch.Tensor, ztxt: torch.Tensor, t_prime: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """-mean_i sum_j log sigmoid(label_ij * (t * zi . zj + b)), label +1 on the diagonal, -1 elsewhere."""
    zi, zt = gather_with_grad(zimg), gather_with_grad(ztxt)
    logits = t_prime.exp() * zi @ zt.T + bias
    labels = 2 * torch.eye(zi.shape[0], device=zi.device) - 1
    return -F.logsigmoid(labels * logits).sum(1).mean()
