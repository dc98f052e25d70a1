"""The files of a JIT checkpoint that is also a Trainer checkpoint (transformers.py says when
and why). Runs in the JIT save, possibly on the runtime's watcher thread while the main thread
waits in a collective: file writes of host state only, no collective, no Trainer method that
may start one (``_save_checkpoint`` sums FLOs over the ranks first)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

SHARED_FILE = "jitckpt_trainer.json"
RANK_FILE = "jitckpt_trainer_rank{}.pt"


def _write_model(trainer: Any, ckpt_dir: str) -> None:
    """The weights as ``pytorch_model.bin``, which Trainer's resume loads: not
    ``save_pretrained``, which writes on the main rank only and may wait at a barrier, nor
    safetensors, which refuses the tied weights (torch.save keeps them one storage)."""
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    torch.save(model.state_dict(), os.path.join(ckpt_dir, "pytorch_model.bin"))


def _trainer_rng(snap: dict) -> dict:
    """resume.data's RNG snapshot in the form Trainer's ``_save_rng_state`` writes."""
    out: dict[str, Any] = {"python": snap["random"], "cpu": snap["torch"]}
    if "numpy" in snap:
        name, keys, pos, has_gauss, gauss = snap["numpy"]
        out["numpy"] = (name, keys.numpy().astype("uint32"), pos, has_gauss, gauss)
    if "cuda" in snap:
        out["cuda"] = snap["cuda"]
    return out


def write_checkpoint(trainer: Any, ckpt_dir: str, state: Any, snap: dict) -> None:
    """Model, optimizer, scheduler, scaler, TrainerState and this rank's RNG as Trainer
    names them; jitckpt's extras beside them."""
    rank = trainer.args.process_index
    _write_model(trainer, ckpt_dir)
    torch.save(trainer.optimizer.state_dict(), os.path.join(ckpt_dir, "optimizer.pt"))
    if trainer.lr_scheduler is not None:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(ckpt_dir, "scheduler.pt"))
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None:
        torch.save(scaler.state_dict(), os.path.join(ckpt_dir, "scaler.pt"))
    name = "rng_state.pth" if trainer.args.world_size <= 1 else f"rng_state_{rank}.pth"
    torch.save(_trainer_rng(snap["rng"]), os.path.join(ckpt_dir, name))
    state.save_to_json(os.path.join(ckpt_dir, "trainer_state.json"))
    with open(os.path.join(ckpt_dir, SHARED_FILE), "w", encoding="utf-8") as f:
        json.dump({"callbacks": snap["callbacks"], "redo": snap["redo"]}, f)
    torch.save({"rng": snap["rng"], "tr_loss": snap["tr_loss"].cpu(), "scalars": snap["scalars"]},
               os.path.join(ckpt_dir, RANK_FILE.format(rank)))
