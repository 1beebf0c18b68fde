"""The Adafactor variant the paper trains with: big_vision's `scale_by_adafactor` (Zhai et al.,
"Scaling Vision Transformers", 2022), not torch.optim.Adafactor (relative step sizes, no momentum).

Per parameter p with gradient g, at step t (0-based):
  beta2_t = min(beta2_cap, 1 - (t + 1) ** -decay_rate)
  factored (p has two axes of >= min_dim_size_to_factor; the two largest are rows R and columns C):
    r <- beta2_t r + (1 - beta2_t) mean_C(g^2 + eps)      c <- beta2_t c + (1 - beta2_t) mean_R(g^2 + eps)
    u = g / sqrt(r / mean(r)) / sqrt(c)                   (outer product of the two factors)
  otherwise:  v <- beta2_t v + (1 - beta2_t)(g^2 + eps),  u = g / sqrt(v)
  m <- momentum m + (1 - momentum) u                       (an EMA, not debiased)
  p <- p - lr_t m - weight_decay (lr_t / lr) p             (decay follows the schedule, not the lr)
lr_t is the group's current lr (the schedule has set it); `initial_lr` is the base lr. big_vision
keeps m in bfloat16; here it is float32.
"""
from __future__ import annotations

import torch


def factored_dims(shape: tuple[int, ...], min_dim_size_to_factor: int) -> tuple[int, int] | None:
    """(row axis, column axis): the two largest axes, if the smaller of them is big enough."""
    if len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda i: shape[i])
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return order[-2], order[-1]


class Adafactor(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, decay_rate: float = 0.8,
                 beta2_cap: float = 0.999, min_dim_size_to_factor: int = 32, eps: float = 1e-30,
                 weight_decay: float = 0.0):
        defaults = dict(lr=lr, momentum=momentum, decay_rate=decay_rate, beta2_cap=beta2_cap,
                        min_dim_size_to_factor=min_dim_size_to_factor, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            base_lr = group.get("initial_lr", group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                state = self.state[p]
                dims = factored_dims(tuple(p.shape), group["min_dim_size_to_factor"])
                if not state:
                    state["step"] = 0
                    state["momentum"] = torch.zeros_like(g)
                    if dims:
                        state["row"] = torch.zeros_like(g.mean(dim=dims[1], keepdim=True))
                        state["col"] = torch.zeros_like(g.mean(dim=dims[0], keepdim=True))
                    else:
                        state["v"] = torch.zeros_like(g)
                t = state["step"]
                beta2 = min(group["beta2_cap"], 1.0 - (t + 1.0) ** (-group["decay_rate"]))
                sq = g * g + group["eps"]
                if dims:
                    row, col = state["row"], state["col"]
                    row.mul_(beta2).add_(sq.mean(dim=dims[1], keepdim=True), alpha=1 - beta2)
                    col.mul_(beta2).add_(sq.mean(dim=dims[0], keepdim=True), alpha=1 - beta2)
                    row_mean = row.mean(dim=dims[0], keepdim=True)
                    u = g * (row / row_mean).rsqrt() * col.rsqrt()
                else:
                    v = state["v"]
                    v.mul_(beta2).add_(sq, alpha=1 - beta2)
                    u = g * v.rsqrt()
                m = state["momentum"]
                m.mul_(group["momentum"]).add_(u, alpha=1 - group["momentum"])
                if group["weight_decay"]:
                    p.mul_(1 - group["weight_decay"] * group["lr"] / base_lr)
                p.add_(m.to(p.dtype), alpha=-group["lr"])
                state["step"] = t + 1
        return loss
