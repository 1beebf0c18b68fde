"""Unit: the paper's Adafactor variant (big_vision's scale_by_adafactor) against a hand-written step."""
import numpy as np
import pytest
import torch

from trainers.adafactor import Adafactor, factored_dims


def reference(p, grads, lrs, base_lr, wd, momentum=0.9, decay_rate=0.8, cap=0.999, eps=1e-30, min_dim=32):
    """big_vision's update written out in numpy for one 2-D or 1-D parameter."""
    p = p.astype(np.float64).copy()
    m = np.zeros_like(p)
    factored = p.ndim == 2 and min(p.shape) >= min_dim
    r = np.zeros(p.shape[0]) if factored else None
    c = np.zeros(p.shape[1]) if factored else None
    v = np.zeros_like(p)
    for t, (g, lr) in enumerate(zip(grads, lrs)):
        beta2 = min(cap, 1 - (t + 1) ** -decay_rate)
        sq = g * g + eps
        if factored:   # rows are axis 0 (the smaller), columns axis 1
            r = beta2 * r + (1 - beta2) * sq.mean(axis=1)
            c = beta2 * c + (1 - beta2) * sq.mean(axis=0)
            vhat = np.outer(r / r.mean(), c)
        else:
            v = beta2 * v + (1 - beta2) * sq
            vhat = v
        u = g / np.sqrt(vhat)
        m = momentum * m + (1 - momentum) * u
        p = p - lr * m - wd * (lr / base_lr) * p
    return p


def test_adafactor_matches_the_hand_written_big_vision_step():
    rng = np.random.default_rng(0)
    for shape in ((40, 64), (7,)):
        p0 = rng.normal(size=shape)
        grads = [rng.normal(size=shape) for _ in range(4)]
        lrs = [1e-3 * f for f in (0.25, 0.5, 1.0, 0.9)]     # a warmup then a decay, set by the schedule
        param = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
        opt = Adafactor([{"params": [param], "weight_decay": 1e-4}], lr=1e-3)
        for g, lr in zip(grads, lrs):
            for group in opt.param_groups:
                group.setdefault("initial_lr", 1e-3)
                group["lr"] = lr
            param.grad = torch.tensor(g)
            opt.step()
        want = reference(p0, grads, lrs, 1e-3, 1e-4)
        np.testing.assert_allclose(param.detach().numpy(), want, rtol=1e-6, atol=1e-12)
        assert not np.allclose(want, p0)


def test_factoring_picks_the_two_largest_axes_of_large_enough_tensors():
    assert factored_dims((64, 40), 32) == (1, 0)
    assert factored_dims((3, 64, 40), 32) == (2, 1)
    assert factored_dims((16, 64), 32) is None and factored_dims((64,), 32) is None


def test_build_optimizer_gives_the_variant_with_momentum():
    from trainers.optim import build_optimizer
    from trainers.train_config import OptimConfig

    opt = build_optimizer(torch.nn.Linear(40, 40), OptimConfig(name="adafactor", weight_decay=1e-4))
    assert isinstance(opt, Adafactor) and opt.defaults["momentum"] == 0.9 and opt.defaults["beta2_cap"] == 0.999


def test_experiment_trains_with_the_papers_recipe_unless_told_otherwise():
    from trainers.evaluation.experiment import experiment_optim

    mine = {"name": "adamw", "lr": 3e-4, "weight_decay": 0.05, "warmup_steps": 100, "schedule": "cosine"}
    paper = experiment_optim("cappa", 300, "paper", mine)
    assert (paper["name"], paper["lr"], paper["weight_decay"], paper["schedule"]) == ("adafactor", 1e-3, 1e-4, "cosine")
    assert paper["warmup_steps"] == 5                      # the paper's 10k of 650k steps, at 300 steps
    clipcap = experiment_optim("clipcap", 300, "paper", mine)
    assert (clipcap["name"], clipcap["lr"], clipcap["schedule"]) == ("adamw", 2e-5, "linear")
    assert experiment_optim("clip", 300, "config", mine) == mine


def test_a_weight_decay_far_from_every_published_recipe_is_refused():
    from infra.configtools import build
    from infra.errors import UserError
    from trainers.train_config import OptimConfig

    with pytest.raises(UserError, match=r"train.optim.weight_decay.*1000x.*not multiplied by the learning rate.*"
                                        r"train.optim.check_recipe=false"):
        build(OptimConfig, {"name": "adafactor", "weight_decay": 0.1}, "train.optim")
    build(OptimConfig, {"name": "adafactor", "weight_decay": 1e-4}, "train.optim")
    build(OptimConfig, {"name": "adamw", "weight_decay": 0.1, "lr": 1e-3}, "train.optim")      # 1e-4 per step
    with pytest.raises(UserError, match="train.optim.weight_decay"):
        build(OptimConfig, {"name": "adamw", "weight_decay": 50.0, "lr": 1e-3}, "train.optim")
    build(OptimConfig, {"name": "adafactor", "weight_decay": 0.1, "check_recipe": False}, "train.optim")
