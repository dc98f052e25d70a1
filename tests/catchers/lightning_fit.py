"""A Lightning script ended by Lightning's own launch: ``trainer.fit`` runs
the training inside ``_call_and_handle_interrupt``, which catches every
exception, runs the callbacks' ``on_exception`` and the strategy's teardown,
then re-raises. DDP over gloo; the model (core.py) has a buffer, so DDP
broadcasts it at the start of every forward.

    jitrun --nproc-per-node 2 lightning_fit.py --out final.pt
"""

from __future__ import annotations

import argparse
import warnings

import lightning as L
import torch
from core import model
from torch.utils.data import DataLoader, TensorDataset

from jitckpt.integrations.lightning import JitCallback


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=6, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 12, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) > 0).float()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    module = Classifier()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                        callbacks=[JitCallback()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    if trainer.is_global_zero:
        torch.save({"model": module.state_dict(), "optim": trainer.optimizers[0].state_dict(),
                    "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                    "global_step": trainer.global_step, "epoch": trainer.current_epoch}, args.out)


if __name__ == "__main__":
    main()
