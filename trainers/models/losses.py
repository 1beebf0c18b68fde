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


def gather_with_grad(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(B, E) on each worker -> ((G, E) everywhere, this worker's first row in it), gradients flowing
    back to each worker's rows. Every worker must hold the same B."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x, 0
    return _GatherWithGrad.apply(x), dist.get_rank() * x.shape[0]


# Both losses are local (open_clip's `--local-loss`): a worker scores its own B images against all G
# texts and its own B texts against all G images, a (B, G) matrix where the full loss on every worker
# is (G, G). The mean of the workers' local losses is the full-batch loss, and with the gather's
# backward summing every worker's contribution and data-parallel averaging, so is the gradient
# (tests/trainers/test_distributed_loss.py).


def clip_loss(zimg: torch.Tensor, ztxt: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """Mean of image->text and text->image CE, this worker's rows against the gathered batch.
    z* (B, E) normalised -> scalar."""
    (zi, first), (zt, _) = gather_with_grad(zimg), gather_with_grad(ztxt)
    scale = logit_scale.exp().clamp(max=100.0)
    target = first + torch.arange(zimg.shape[0], device=zimg.device)
    return 0.5 * (F.cross_entropy(scale * zimg @ zt.T, target) + F.cross_entropy(scale * ztxt @ zi.T, target))


def siglip_loss(zimg: torch.Tensor, ztxt: torch.Tensor, t_prime: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """-mean_i sum_j log sigmoid(label_ij * (t * zi . zj + b)) over this worker's images i and every
    text j, label +1 on the (global) diagonal, -1 elsewhere."""
    zt, first = gather_with_grad(ztxt)
    logits = t_prime.exp() * zimg @ zt.T + bias                                  # (B, G)
    labels = -torch.ones_like(logits)
    labels[torch.arange(zimg.shape[0]), first + torch.arange(zimg.shape[0])] = 1
    return -F.logsigmoid(labels * logits).sum(1).mean()
