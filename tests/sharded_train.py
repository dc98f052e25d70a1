"""A tiny MLP sharded with FSDP2 (``fully_shard``) on CPU/gloo, made resumable
with ``jitckpt.resumable`` (tests/test_resume_sharded.py).

``--mesh RxS``: HSDP over a 2-D mesh (R replicas x S shards, R*S ranks);
``--mesh 1xS``: pure FSDP (1-D mesh, no replicas). Each rank trains on its
own batches, generated from (step, rank); the model has dropout (global RNG).
At the end every rank gathers the full model and optimizer state
(``get_state_dict(full_state_dict=True)``) and saves it to
``<out>.rank<R>.pt``, to compare bit for bit with a failure-free run.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import jitckpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--optim", choices=["adamw", "sgd"], default="adamw")
    ap.add_argument("--selfcheck", default="", help="directory: check resume.sharded's save/load here, at the end")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reps, shards = (int(v) for v in args.mesh.split("x"))
    assert reps * shards == world, f"--mesh {args.mesh} needs {reps * shards} ranks, have {world}"
    if reps > 1:
        mesh = init_device_mesh("cpu", (reps, shards), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (shards,), mesh_dim_names=("shard",))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.optim == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)

    state = jitckpt.resumable(model=model, optimizer=opt, scheduler=sched, state={"step": 0})
    for step in range(state["step"], args.steps):
        state["step"] = step  # current before the minibatch's first forward
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0:
            print(f"[rank 0] step {step} loss {loss.item():.5f}", flush=True)

    if args.selfcheck:
        selfcheck(model, opt, args, rank, world)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = f"{args.out}.rank{rank}.pt"
    torch.save({"model": msd, "optim": osd, "sched": sched.state_dict()}, out + ".tmp")
    os.replace(out + ".tmp", out)
    dist.barrier()
    dist.destroy_process_group()


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _clone(x):
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x.clone() if isinstance(x, torch.Tensor) else x


def _same(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            _same(x, y, f"{what}.{k}")
        elif isinstance(x, torch.Tensor):
            assert type(x) is type(y) and x.shape == y.shape and torch.equal(_bits(x), _bits(y)), f"{what}.{k} differs"
        else:
            assert x == y, f"{what}.{k}: {x!r} != {y!r}"


def selfcheck(model, opt, args, rank: int, world: int) -> None:
    """At a quiet point: what the JIT save takes equals get_state_dict's sharded state dict; a load
    after two more steps puts back exactly that state and runs no optimizer step hook."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from jitckpt.resume import sharded as resume_sharded

    sh = resume_sharded.ShardedState(model, [opt], rank, world)
    tensors, meta = sh.collect()
    ref_m = get_model_state_dict(model)
    ref_o = get_optimizer_state_dict(model, opt)
    _same(ref_m, tensors["model"], "model")
    ref_t = {f: {k: v for k, v in st.items() if isinstance(v, torch.Tensor)} for f, st in ref_o["state"].items()}
    _same(ref_t, tensors["optim"]["0"], "optim.state")
    assert ref_o["param_groups"] == meta["optimizers"][0]["param_groups"], "param_groups differ"

    d = os.path.join(args.selfcheck, f"rank{rank}")
    os.makedirs(d)
    meta = sh.save(d)
    # cloned: a full state dict may share tensors with the live state (Adam's step is updated in place)
    before, _ = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    before_o = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    before, before_o = _clone(before), _clone(before_o)
    for step in range(2):  # move the state away
        loss = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    steps = []
    h = register_optimizer_step_post_hook(lambda *a: steps.append(1))
    sh.load(d, meta)
    h.remove()
    assert not steps, "loading ran an optimizer step"
    after, _ = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    after_o = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    _same(before, after, "model after load")
    _same(before_o["state"], after_o["state"], "optim after load")
    print(f"[rank {rank}] selfcheck ok: {len(tensors['model'])} model tensors, shard {sh.shard}, "
          f"replicas {sh.replicas}", flush=True)


if __name__ == "__main__":
    main()
