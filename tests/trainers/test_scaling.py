"""Unit: the scale knobs on a tiny model of each kind: activation checkpointing gives the plain
gradients exactly, bf16/fp16 train within rounding of fp32 (fp16 with a scaler whose state is
checkpointed), torch.compile the eager loss; the config's ranges."""
import pytest
import torch

from infra.errors import UserError
from trainers.models import build_model
from trainers.scaling import Precision, checkpoint_activations, resolve
from trainers.tasks import LossModule
from trainers.train_config import TrainConfig

from test_models import labels, randomise_heads, tiny


def _model(family, seed=0):
    torch.manual_seed(seed)
    m = build_model(tiny(family))
    randomise_heads(m)
    return m.train()


def _grads(model, images, y):
    model.zero_grad(set_to_none=True)
    loss, _ = model.loss(images, y, generator=torch.Generator().manual_seed(3))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow   # three models trained twice: seconds, kept out of the fast set
@pytest.mark.parametrize("family", ["cappa", "siglip", "coca"])
def test_activation_checkpointing_gives_the_plain_gradients(family):
    images, y = torch.randn(4, 3, 16, 16), labels(4)
    plain = _model(family)
    loss0, g0 = _grads(plain, images, y)
    wrapped = _model(family)
    assert checkpoint_activations(wrapped) == sum(type(m).__name__ == "Block" for m in wrapped.modules()) > 0
    assert checkpoint_activations(wrapped) == 0          # never wrapped twice
    loss1, g1 = _grads(wrapped, images, y)
    assert torch.equal(loss0, loss1) and g0.keys() == g1.keys()
    assert all(torch.allclose(g0[k], g1[k], atol=1e-7) for k in g0)
    wrapped.eval()
    with torch.no_grad():       # decoding (a key/value cache) runs the blocks as they are
        assert torch.equal(wrapped.loss(images, y, generator=torch.Generator().manual_seed(3))[0],
                           plain.eval().loss(images, y, generator=torch.Generator().manual_seed(3))[0])


def _train(precision, steps=6):
    model = _model("cappa")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    p = Precision(precision, torch.device("cpu"))
    images, y = torch.randn(8, 3, 16, 16), labels(8)
    losses = []
    for _ in range(steps):
        with p.autocast():
            loss, _ = model.loss(images, y, generator=torch.Generator().manual_seed(3))
        p.backward(loss)
        p.unscale(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        p.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, p


@pytest.mark.slow   # 6 + 6 training steps each
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precisions_train_within_rounding_of_fp32(precision):
    full, _ = _train("fp32")
    half, p = _train(precision)
    assert half[-1] < half[0]                                            # it trains
    assert all(abs(a - b) / a < 0.05 for a, b in zip(full, half))
    if precision == "fp16":
        state = p.state_dict()
        assert state["scale"] > 0
        again = Precision("fp16", torch.device("cpu"))
        again.load_state_dict(state)
        assert again.state_dict() == state
    else:
        assert p.scaler is None and p.state_dict() == {}


def test_auto_precision_is_bf16_on_gpus_and_fp32_on_cpus():
    assert resolve("auto", torch.device("cuda")) == "bf16" and resolve("auto", torch.device("cpu")) == "fp32"
    assert resolve("fp16", torch.device("cpu")) == "fp16"


@pytest.mark.slow   # inductor compiles C++ for the CPU: tens of seconds
def test_a_compiled_model_gives_the_eager_loss_and_gradients():
    images, y = torch.randn(4, 3, 16, 16), labels(4)
    eager = _model("clip")
    loss0, g0 = _grads(eager, images, y)
    model = _model("clip")
    compiled = torch.compile(LossModule(model))
    model.zero_grad(set_to_none=True)
    loss1, _ = compiled(images, y, generator=torch.Generator().manual_seed(3))
    loss1.backward()
    assert loss1.item() == pytest.approx(loss0.item(), rel=1e-4)
    assert all(torch.allclose(g0[n], p.grad, atol=1e-4) for n, p in model.named_parameters() if n in g0)


def test_max_failures_takes_minus_one_for_any_number():
    from pipeline.config import load_config

    TrainConfig(max_failures=-1).validate("train")
    assert load_config(None, ["train.max_failures=-1"]).train.max_failures == -1    # through the config's own checks
    with pytest.raises(UserError, match="'train.num_workers'"):
        load_config(None, ["train.num_workers=-1"])
    with pytest.raises(UserError, match="'train.max_failures': must be >= 0, or -1"):
        TrainConfig(max_failures=-2).validate("train")
    with pytest.raises(UserError, match="train.shuffle_buffer"):
        TrainConfig(shuffle_buffer=0).validate("train")


def test_how_a_job_runs_includes_checkpointing_and_compile_but_not_precision():
    assert {"activation_checkpointing", "compile"} <= set(TrainConfig.HOW)
    assert "precision" not in TrainConfig.HOW and "shuffle_buffer" not in TrainConfig.HOW


def test_a_hard_killed_workers_scratch_folder_is_removed_at_the_next_start(tmp_path):
    import os
    import subprocess
    import sys

    from trainers.loop import SCRATCH, prune_scratch

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"{SCRATCH}{dead.pid}-abc").mkdir()
    (tmp_path / f"{SCRATCH}{dead.pid}-abc" / "spm.model").write_bytes(b"x" * 100)
    (tmp_path / f"{SCRATCH}{os.getpid()}-def").mkdir()          # a live worker's: kept
    (tmp_path / "capline-train-notapid").mkdir()                   # not one of ours by its name: kept
    assert prune_scratch(tmp_path) == [tmp_path / f"{SCRATCH}{dead.pid}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{SCRATCH}{os.getpid()}-def", "capline-train-notapid"])
