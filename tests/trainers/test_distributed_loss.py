"""The contrastive losses split over two gloo processes equal the single-process full-batch loss,
gradients included: each rank scores its own rows against the gathered embeddings (a local loss,
B x G, never the G x G matrix), the ranks' losses and gradients are averaged as data-parallel
training does."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from trainers.models.losses import clip_loss, siglip_loss

B, F_IN, E = 8, 6, 4


def _towers(seed=0):
    g = torch.Generator().manual_seed(seed)
    wi = torch.randn(F_IN, E, generator=g).requires_grad_()
    wt = torch.randn(F_IN, E, generator=g).requires_grad_()
    xi = torch.randn(B, F_IN, generator=g)
    xt = torch.randn(B, F_IN, generator=g)
    return wi, wt, xi, xt


def _loss(kind, wi, wt, xi, xt):
    zi, zt = F.normalize(xi @ wi, dim=-1), F.normalize(xt @ wt, dim=-1)
    if kind == "clip":
        return clip_loss(zi, zt, torch.tensor(2.0))
    return siglip_loss(zi, zt, torch.tensor(1.5), torch.tensor(-3.0))


def _worker(rank, world, port, kind, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    wi, wt, xi, xt = _towers()
    half = B // world
    rows = slice(rank * half, (rank + 1) * half)
    loss = _loss(kind, wi, wt, xi[rows], xt[rows])
    loss.backward()
    grads = [wi.grad.clone(), wt.grad.clone(), loss.detach().clone()]
    for g in grads:
        dist.all_reduce(g)
        g /= world
    if rank == 0:
        torch.save({"loss": grads[2], "gi": grads[0], "gt": grads[1]}, out)
    dist.barrier()  # neither rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.slow   # a few seconds of training or many images: not in the fast set
def test_two_process_loss_and_grads_equal_single_process(kind, tmp_path):
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_worker, args=(2, _free_port(), kind, out), nprocs=2, join=True)
    got = torch.load(out, weights_only=True)
    wi, wt, xi, xt = _towers()
    loss = _loss(kind, wi, wt, xi, xt)
    loss.backward()
    assert got["loss"].item() == pytest.approx(loss.item(), rel=1e-5)
    assert torch.allclose(got["gi"], wi.grad, atol=1e-5)
    assert torch.allclose(got["gt"], wt.grad, atol=1e-5)
    assert wi.grad.abs().sum() > 0
