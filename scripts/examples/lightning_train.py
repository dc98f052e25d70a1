"""A tiny PyTorch Lightning training script made exactly resumable under
jitrun with jitckpt's Lightning callback (two added lines, marked).

An MLP with dropout on a synthetic regression set, a shuffling DataLoader
(Lightning re-creates it with a DistributedSampler under DDP), AdamW with a
per-step LR schedule, two epochs, DDP over gloo on CPU. Lightning picks up
the ranks from the torchrun / jitrun environment.

    jitrun --standalone --nproc-per-node 2 scripts/examples/lightning_train.py --out final.pt
"""

from __future__ import annotations

import argparse
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from jitckpt.integrations.lightning import JitCallback  # jitckpt


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default=None, help="rank 0 writes the final model+optimizer state here")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 10, generator=g)
    y = x.sum(1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model = Regressor()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                        callbacks=[JitCallback()],  # jitckpt: the one line
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, loader)
    if trainer.is_global_zero and args.out:
        torch.save({"model": model.state_dict(), "optim": trainer.optimizers[0].state_dict(),
                    "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                    "global_step": trainer.global_step, "epoch": trainer.current_epoch}, args.out)


if __name__ == "__main__":
    main()
