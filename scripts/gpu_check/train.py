"""The DDP job of scripts/gpu_check.sh: an MLP trained by 2 ranks, on one GPU or on the CPU.

On a GPU both ranks use device 0, and one GPU allows no NCCL communicator
holding two ranks (NCCL refuses a duplicate GPU). So DDP's gradients go
through gloo, which reduces CUDA tensors, and each rank also has an NCCL
process group of its own (``new_subgroups(group_size=1)``): every step sums
the loss in it, a real NCCL collective through the shim that changes nothing
(a sum over one rank). With ``--device cpu`` (the stand-in run) there is no
NCCL group.

Deterministic on one device: the batches are a pure function of (seed, step,
rank), deterministic algorithms are on, and ``jitckpt.resumable`` restores
model, optimizer, RNG and step, so a recovered run ends bit-identical to one
without a failure. Rank 0 writes the final state (``--out``) and, with
``--times``, each step's end time (after a device sync).

    torchrun --nproc-per-node 2 train.py --device cuda --steps 40 --out final.pt
"""

from __future__ import annotations

import argparse
import json
import os
import time

# cuBLAS is deterministic only with a fixed workspace, set before CUDA starts
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import jitckpt  # noqa: E402


def mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def batch(seed: int, step: int, rank: int, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + rank)
    x = torch.randn(size, width, generator=g)
    return x, x[:, :8].sum(1, keepdim=True).sin()


def _atomic_save(obj: object, path: str) -> None:
    tmp = path + ".tmp"
    if isinstance(obj, list):
        with open(tmp, "w") as f:
            json.dump(obj, f)
    else:
        torch.save(obj, tmp)
    os.replace(tmp, path)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="rank 0 writes the final model and optimizer state here")
    ap.add_argument("--times", default=None, help="rank 0 writes each step's end time (JSON list) here")
    return ap.parse_args()


def main() -> None:
    args = _args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(dev)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    model = mlp(args.width, args.depth).to(dev)
    own = dist.new_subgroups(group_size=1, backend="nccl")[0] if args.device == "cuda" else None
    ddp = DDP(model, device_ids=[dev.index] if args.device == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    state = jitckpt.resumable(model=ddp, optimizer=opt, state={"step": 0})
    times: list[float] = []
    for step in range(state["step"], args.steps):
        x, y = (t.to(dev) for t in batch(args.seed, step, rank, args.batch, args.width))
        loss = nn.functional.mse_loss(ddp(x), y)
        if own is not None:
            dist.all_reduce(loss.detach().clone(), group=own)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        state["step"] = step + 1
        if args.times:
            loss.item()  # the step's device work done
            times.append(time.perf_counter())
    if rank == 0 and args.out:
        _atomic_save({"model": model.state_dict(), "optim": opt.state_dict()}, args.out)
    if rank == 0 and args.times:
        _atomic_save(times, args.times)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
