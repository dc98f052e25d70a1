"""An Accelerate script in the shape of Accelerate's own examples
(``training_function`` called from ``main``): Accelerate sets up the process
group itself and wraps the model in DDP (``accelerator.prepare``), whose
forward broadcasts the model's buffer (core.py); gradients go through
``accelerator.backward``.

    jitrun --nproc-per-node 2 accelerate_main.py --out final.pt
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from core import model as make_model
from torch.utils.data import DataLoader, TensorDataset

import jitckpt.integrations.accelerate as jitckpt_accelerate


def training_function(args: argparse.Namespace) -> None:
    accelerator = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 12, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) > 0).float()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = jitckpt_accelerate.resumable(accelerator, state={"epoch": 0})

    for epoch in range(state["epoch"], args.epochs):
        state["epoch"] = epoch
        model.train()
        for xb, yb in loader:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
    if accelerator.is_main_process:
        torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optim": opt.state_dict()}, args.out)
    accelerator.end_training()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", required=True)
    training_function(ap.parse_args())


if __name__ == "__main__":
    main()
