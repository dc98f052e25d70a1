"""A Hugging Face Trainer job for the recovery tests: a 2-layer GPT-2 built from a config,
random token data, 2 epochs; each rank writes its final state (model, optimizer, scheduler,
TrainerState without timings, RNG) to OUT/final-RANK.pt for a bit-for-bit comparison.

    jitrun --nproc-per-node 2 tests/hf_train.py --out OUT --mode jit
    torchrun --standalone --nproc-per-node 2 tests/hf_train.py --out OUT --mode none   # the reference

--die-in-save RANK:STEP:KIND:ATTEMPT[,...]: that rank sends itself KIND (sigkill | sigstop)
inside Trainer's own periodic save of STEP, after the model and optimizer files and before its
RNG file, in that attempt of the job (TORCHELASTIC_RESTART_COUNT): a failure during Trainer's save.
--slow-save RANK:SECONDS: that rank's periodic saves each take SECONDS longer (a slow disk).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

_TIMING = ("runtime", "per_second")


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _die_in_save(trainer: Trainer, specs: str) -> None:
    attempt, me = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ["RANK"])
    mine = {int(step): kind for rank, step, kind, at in (s.split(":") for s in specs.split(","))
            if int(rank) == me and int(at) == attempt}
    if not mine:
        return
    orig = trainer._save_rng_state

    def save_rng_state(output_dir: str) -> None:
        kind = mine.get(trainer.state.global_step)
        if kind is not None:
            os.kill(os.getpid(), {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}[kind])
        orig(output_dir)

    trainer._save_rng_state = save_rng_state


def _slow_save(trainer: Trainer, spec: str) -> None:
    """RANK:SECONDS: Trainer's periodic checkpoint takes that rank SECONDS longer (a slow disk)."""
    rank, seconds = spec.split(":")
    if int(rank) != int(os.environ["RANK"]):
        return
    orig = trainer._save_checkpoint

    def save_checkpoint(*a, **kw):
        import time

        time.sleep(float(seconds))
        return orig(*a, **kw)

    trainer._save_checkpoint = save_checkpoint


class _Resumable(TrainerCallback):
    """jitckpt.resumable (or its Accelerate adapter) called from a callback, as a user would
    try it before JitCallback existed."""

    def __init__(self, mode: str) -> None:
        self.mode, self.trainer = mode, None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                       train_dataloader=None, **kw) -> None:
        import jitckpt

        if self.mode == "accelerate":
            import jitckpt.integrations.accelerate as ja

            ja.resumable(self.trainer.accelerator, state={})
        else:
            jitckpt.resumable(model=self.trainer.model_wrapped, optimizer=optimizer, scheduler=lr_scheduler,
                              dataloader=train_dataloader, state={})


class _Sleep(TrainerCallback):
    def __init__(self, s: float) -> None:
        self.s = s

    def on_step_end(self, args, state, control, **kw) -> None:
        import time

        time.sleep(self.s)


def _final(trainer: Trainer) -> dict:
    st = dataclasses.asdict(trainer.state)
    st["log_history"] = [{k: v for k, v in e.items() if not any(t in k for t in _TIMING)}
                         for e in st["log_history"]]
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"model": trainer.accelerator.unwrap_model(trainer.model).state_dict(),
            "optim": trainer.optimizer.state_dict(), "sched": trainer.lr_scheduler.state_dict(),
            "trainer_state": json.dumps(st, sort_keys=True),
            "rng": {"torch": torch.get_rng_state(), "random": repr(random.getstate()),
                    "numpy": [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=["jit", "none", "resumable", "accelerate"], default="jit")
    ap.add_argument("--max-steps", type=int, default=80)
    ap.add_argument("--save-steps", type=int, default=20)
    ap.add_argument("--resume", action="store_true", help="resume_from_checkpoint=True when a checkpoint exists")
    ap.add_argument("--die-in-save", default="")
    ap.add_argument("--slow-save", default="", help="RANK:SECONDS: that rank's periodic saves take longer")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps (benches: time to warm up)")
    a = ap.parse_args()

    set_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=128)
    model = GPT2LMHeadModel(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ds = TokenData(n=40 * 4 * world, length=16, vocab=128)  # 40 steps per epoch at batch 4 per rank
    args = TrainingArguments(output_dir=os.path.join(a.out, "trainer"), per_device_train_batch_size=4,
                             max_steps=a.max_steps, learning_rate=3e-3, warmup_steps=10, logging_steps=5,
                             save_steps=a.save_steps, seed=0, report_to=[], use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0, ddp_backend="gloo")
    callbacks: list = []
    if a.mode == "jit":
        from jitckpt.integrations.transformers import JitCallback

        callbacks.append(JitCallback())  # the one line
    elif a.mode in ("resumable", "accelerate"):
        callbacks.append(_Resumable(a.mode))
    if a.step_sleep:
        callbacks.append(_Sleep(a.step_sleep))
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)
    if a.mode in ("resumable", "accelerate"):
        callbacks[0].trainer = trainer
    if a.die_in_save:
        _die_in_save(trainer, a.die_in_save)
    if a.slow_save:
        _slow_save(trainer, a.slow_save)
    has_ckpt = os.path.isdir(args.output_dir) and any(d.startswith("checkpoint-") for d in os.listdir(args.output_dir))
    trainer.train(resume_from_checkpoint=True if a.resume and has_ckpt else None)
    torch.save(_final(trainer), os.path.join(a.out, f"final-{args.process_index}.pt"))


if __name__ == "__main__":
    main()
