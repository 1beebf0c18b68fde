"""Optimiser and schedule: AdamW, or the paper's Adafactor variant (trainers/adafactor.py, big_vision's),
linear warmup then cosine to 0, decoupled weight decay on every kernel, as big_vision's default
`wd_mults` ('.*/kernel$'): the weights of every Linear and Conv, the patch embedding's included; not
biases, norms, position or token embeddings, probes. With Adafactor, weight_decay is big_vision's `wd`: multiplied
by the schedule, not by the learning rate (the paper: lr 1e-3, wd 1e-4)."""
from __future__ import annotations

import math

import torch

from .train_config import OptimConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    kernels = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if id(p) in kernels else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "adafactor":
        from .adafactor import Adafactor

        return Adafactor(groups, lr=cfg.lr, momentum=cfg.beta1, beta2_cap=cfg.beta2, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)


def lr_factor(step: int, warmup: int, total: int, shape: str = "cosine") -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 1.0 - progress if shape == "linear" else 0.5 * (1 + math.cos(math.pi * progress))


def build_schedule(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.schedule))
