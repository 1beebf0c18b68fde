"""The knobs a large run turns, applied to one model and one step: numeric precision (autocast and,
for fp16, loss scaling), activation checkpointing of every transformer block, torch.compile, and
FSDP2 (`fully_shard`: parameters, gradients and optimiser state sharded over the workers, for the
sizes whose copy per GPU does not fit; DDP keeps a whole copy on each).
Each leaves the recipe what it is: fp32, checkpointing and compile give the plain loss (checkpointing
exactly, compile to float tolerance); bf16 and fp16 round as autocast does.
"""
from __future__ import annotations

import contextlib
import functools

import torch

def resolve(precision: str, device: torch.device) -> str:
    """auto: bf16 on CUDA (what every B/16+ recipe trains in), fp32 elsewhere."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


class Precision:
    """autocast for the forward and loss, and for fp16 a gradient scaler (fp16's range underflows
    small gradients; bf16's does not, so it needs none)."""

    def __init__(self, precision: str, device: torch.device):
        self.name, self.device = resolve(precision, device), device
        self.scaler = torch.amp.GradScaler(device.type) if self.name == "fp16" else None

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if self.name == "bf16" else torch.float16)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, opt) -> None:
        """Before clipping: gradients at their true size."""
        if self.scaler:
            self.scaler.unscale_(opt)

    def step(self, opt) -> None:
        """The optimiser step; fp16 skips a step whose gradients overflowed and lowers the scale."""
        if self.scaler:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)


def checkpoint_activations(model: torch.nn.Module) -> int:
    """Every transformer block recomputes its activations in the backward pass instead of keeping
    them (memory of one block's activations, ~1/3 more compute). Outside training (decoding with a
    key/value cache) a block runs as it is. -> the number of blocks wrapped."""
    from torch.utils.checkpoint import checkpoint

    from .models.layers import Block

    n = 0
    for m in model.modules():
        if isinstance(m, Block) and not getattr(m, "_checkpointed", False):
            plain = m.forward

            @functools.wraps(plain)
            def forward(*args, _plain=plain, _m=m, **kwargs):
                if _m.training and torch.is_grad_enabled() and kwargs.get("cache") is None:
                    return checkpoint(_plain, *args, use_reentrant=False, **kwargs)
                return _plain(*args, **kwargs)

            m.forward, m._checkpointed = forward, True
            n += 1
    return n


def shard(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2 over the default process group: each transformer block a unit (gathered for its own
    forward and backward, then freed), the rest of the model the root's unit."""
    from torch.distributed.fsdp import fully_shard

    from .models.layers import Block

    module.to(device)
    # FSDP2 shards no 0-d parameter (CLIP*'s logit scale, SigLIP's temperature and bias): those stay
    # whole on every worker, their gradients averaged by `average_replicated`
    scalars = [p for p in module.parameters() if p.ndim == 0]
    for m in module.modules():
        if isinstance(m, Block):
            fully_shard(m)
    fully_shard(module, ignored_params=set(scalars))
    module._replicated = scalars
    return module


def average_replicated(module: torch.nn.Module) -> None:
    """After the backward pass: the parameters `shard` left whole get every worker's mean gradient,
    as the sharded ones do from FSDP's reduce-scatter."""
    import torch.distributed as dist

    for p in getattr(module, "_replicated", ()):
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def full_states(model: torch.nn.Module, opt, fsdp: bool) -> tuple[dict, dict | None]:
    """(weights as safetensors takes them, optimiser state) of the whole model, for a checkpoint.
    Under FSDP every worker must call it (the shards are gathered) and rank 0 gets them (the others
    empty dicts); the optimiser state is then keyed by parameter name. opt None: weights only."""
    from .models.checkpoint import state_for_saving

    if not fsdp:
        return state_for_saving(model), opt.state_dict() if opt is not None else None
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = {k: v.contiguous() for k, v in get_model_state_dict(model, options=full).items()}
    return weights, get_optimizer_state_dict(model, opt, options=full) if opt is not None else None


def load_optimizer(model: torch.nn.Module, opt, state: dict, fsdp: bool) -> None:
    """A checkpoint's optimiser state (`full_states`' form) into the optimiser: under FSDP each worker
    keeps its shard of the whole state that every worker read."""
    if not fsdp:
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))
