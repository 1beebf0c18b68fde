"""The one small training loop: what the LiT decoder, the LiT text tower, the MAP probe and the
bootstrap CLIP scorer train with (the pretraining loop, with Ray Train, DDP and checkpoints, is
trainers/loop.py).

`loss_of(step)` returns the step's loss (it draws its own batch); the loop sets the learning rate
from `schedule` first, steps the optimiser, clips gradients if asked, and reports each step's loss
to `on_step`. The order of these is fixed, so a seeded caller gets the same model every time.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Literal

import torch


def fit(params: Iterable, steps: int, loss_of: Callable[[int], torch.Tensor], lr: float,
        optimizer: Literal["adamw", "adam"] = "adamw", weight_decay: float = 0.0,
        schedule: Callable[[int], float] | None = None, clip_norm: float | None = None,
        on_step: Callable[[int, float], None] | None = None) -> tuple[float, float]:
    """-> (the last step's loss, seconds)."""
    params = list(params)
    opt = (torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay) if optimizer == "adamw"
           else torch.optim.Adam(params, lr=lr))
    t0, loss = time.perf_counter(), float("nan")
    for step in range(steps):
        if schedule is not None:
            for g in opt.param_groups:
                g["lr"] = lr * schedule(step)
        out = loss_of(step)
        opt.zero_grad(set_to_none=True)
        out.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        opt.step()
        loss = float(out.detach())
        if on_step is not None:
            on_step(step, loss)
    return loss, time.perf_counter() - t0
