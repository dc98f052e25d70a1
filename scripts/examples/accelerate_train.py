"""A tiny Hugging Face Accelerate training script made exactly resumable under
jitrun with jitckpt's Accelerate adapter (two added lines, marked).

An MLP with dropout on a synthetic regression set, a shuffling DataLoader
(sharded and re-shuffled per epoch by Accelerate), AdamW, two epochs.

    jitrun --standalone --nproc-per-node 2 scripts/examples/accelerate_train.py --out final.pt
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import jitckpt.integrations.accelerate as jitckpt_accelerate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default=None, help="the main process writes the final model+optimizer state here")
    args = ap.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 10, generator=g)
    y = x.sum(1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = jitckpt_accelerate.resumable(accelerator, state={"epoch": 0})  # jitckpt: the one call

    for epoch in range(state["epoch"], args.epochs):
        state["epoch"] = epoch  # jitckpt: the counter it restores
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
    if accelerator.is_main_process and args.out:
        torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optim": opt.state_dict()}, args.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
