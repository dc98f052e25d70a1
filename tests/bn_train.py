"""A small BatchNorm CNN under DDP with jitckpt.resumable and the common epoch loop (train,
validate with an all-reduced metric, scheduler.step()), for tests/test_buffers.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/bn_train.py --out final.pt [--epochs 3]

``--kill WHERE:EPOCH:RANK`` SIGKILLs that rank at that point of the first attempt (``validate``:
inside the validation pass, ``between``: after ``scheduler.step()``); ``--skew-buffer`` makes rank
1 add 1 to a BatchNorm statistic right after a restore (a wrong restore the checks must refuse).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import jitckpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--kill", default="")
    ap.add_argument("--skew-buffer", action="store_true")
    ap.add_argument("--no-broadcast-buffers", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 4))
    model = nn.parallel.DistributedDataParallel(net, broadcast_buffers=not args.no_broadcast_buffers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    val = DataLoader(data, batch_size=16)
    state = jitckpt.resumable(model=model, optimizer=opt, scheduler=sched, dataloader=loader, state={"epoch": 0})
    first = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if args.skew_buffer and not first and rank == 1:
        with torch.no_grad():
            net[1].running_mean.add_(1.0)
    where, epoch_at, rank_at = (args.kill.split(":") + ["", "-1", "-1"])[:3] if args.kill else ("", "-1", "-1")

    def maybe_kill(point: str, epoch: int) -> None:
        if first and point == where and epoch == int(epoch_at) and rank == int(rank_at):
            os.kill(os.getpid(), signal.SIGKILL)

    for epoch in range(state["epoch"], args.epochs):
        state["epoch"] = epoch
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            total = torch.zeros(1)
            for i, (x, y) in enumerate(val):
                total += nn.functional.cross_entropy(model(x), y)
                if i == 1:
                    maybe_kill("validate", epoch)
            dist.all_reduce(total)
        sched.step()
        maybe_kill("between", epoch)
    if rank == 0:
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
                   args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
