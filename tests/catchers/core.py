"""The training the catcher scripts share (tests/test_catchers.py): DDP over
gloo, a model with a buffer (a causal mask, as minGPT's attention has), so DDP
broadcasts its buffers from rank 0 at the start of every forward (a C++
collective no torch.distributed function wraps, the path pytorch/examples'
minGPT-ddp fails in when a peer stops between minibatches), a shuffling
DistributedSampler over epochs, SGD with momentum and a step LR schedule,
made resumable with the README's one call."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import jitckpt

SAMPLES, BATCH = 256, 16  # 8 minibatches per rank and epoch with 2 ranks


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 12, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) > 0).float()
    return TensorDataset(x, y)


class MaskedMix(nn.Module):
    """A linear map restricted by a lower-triangular mask buffer (minGPT's
    ``bias`` buffer in its attention): a buffer DDP broadcasts every forward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("mask", torch.tril(torch.ones(n, n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.lin.weight * self.mask, self.lin.bias)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), MaskedMix(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))


def train(out: str, epochs: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = data()
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler)
    net = model()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=6, gamma=0.7)
    state = jitckpt.resumable(model=ddp, optimizer=opt, scheduler=sched, dataloader=loader, state={"epoch": 0})
    for epoch in range(state["epoch"], epochs):
        state["epoch"] = epoch
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.binary_cross_entropy_with_logits(ddp(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    if rank == 0:
        torch.save({"model": net.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()},
                   out + ".tmp")
        os.replace(out + ".tmp", out)
    dist.destroy_process_group()
