"""An independent DDP training script for the fault matrix (not the demo):
an MLP classifier on a synthetic dataset read through a DataLoader with a
shuffling DistributedSampler, several epochs, SGD with momentum, a StepLR
schedule, dropout, a metric all-reduce at the start of every minibatch, and a
barrier after the loop. Exact mid-epoch resume with jitckpt's one line:

* the step label comes from ``jitckpt.checkpoint_step()`` (global minibatch
  index; epoch and position in the epoch follow from it);
* the DataLoader draws from its own generator, re-seeded per epoch, so its
  order does not depend on the global RNG;
* the global RNG (dropout) is snapshotted at the top of every minibatch and
  restored at the top of the first resumed one, after the loader iterator
  exists (creating an iterator may draw from the global RNG).
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import jitckpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(args.samples, 20, generator=g)
    y = (x[:, :5].sum(1) > 0).long() + (x[:, 5:10].sum(1) > 1).long()
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader_gen = torch.Generator()
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, generator=loader_gen)
    per_epoch = len(loader)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 3))
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    rng = {"state": torch.get_rng_state()}

    def save_fn(d: str) -> None:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                    "step": jitckpt.checkpoint_step(), "rng": rng["state"]}, os.path.join(d, "state.pt"))

    jitckpt.register(save_fn)
    start, resume_rng = 0, None
    path = jitckpt.get_checkpoint_path()
    if path:
        st = torch.load(os.path.join(path, "state.pt"), weights_only=True)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
        sched.load_state_dict(st["sched"])
        start, resume_rng = st["step"], st["rng"]
        print(f"[rank {rank}] resumed at step {start}", flush=True)

    for epoch in range(start // per_epoch, args.epochs):
        sampler.set_epoch(epoch)
        loader_gen.manual_seed(100 + epoch)
        skip = start - epoch * per_epoch if epoch == start // per_epoch else 0
        # batches of this epoch trained before the failure are fetched and dropped (cheap here)
        it = itertools.islice(iter(loader), skip, None)
        for i, (xb, yb) in enumerate(it, start=skip):
            if resume_rng is not None:
                torch.set_rng_state(resume_rng)
                resume_rng = None
            rng["state"] = torch.get_rng_state()
            seen = torch.tensor([float(len(yb))])
            dist.all_reduce(seen)  # a metric collective at the start of the minibatch
            loss = nn.functional.cross_entropy(ddp(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i == per_epoch - 1:
                print(f"[rank 0] epoch {epoch} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, args.out + ".tmp")
        os.replace(args.out + ".tmp", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
