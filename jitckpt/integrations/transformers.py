"""Hugging Face ``transformers.Trainer``: exact JIT recovery with one line.

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[JitCallback()])
    trainer.train()

Launched with jitrun, a failed rank costs at most one minibatch. Outside jitrun the callback
does nothing.

How (tested with transformers 5.24; the private names it uses are checked at start):

* The JIT checkpoint *is* a Trainer checkpoint: at the JIT consistent point each live rank
  writes the model, ``optimizer.pt``, ``scheduler.pt`` (``trainer.lr_scheduler`` as it is
  then: Trainer creates it inside ``train``), the scaler, ``trainer_state.json`` and its
  ``rng_state_{rank}.pth``, plus ``jitckpt_trainer.json`` and ``jitckpt_trainer_rank{R}.pt``
  for what a Trainer checkpoint leaves out. After a restart ``trainer.train`` is handed that
  directory as ``resume_from_checkpoint``: Trainer's own resume path computes the epoch and
  the batches to skip and restores model, optimizer, scheduler and state.
* Trainer's counters are read at each minibatch start (the runtime's hook), where the JIT
  save describes the state: the ``TrainerState`` (``log_history`` up to then), the stateful
  callbacks, and each rank's own values: the loss summed since the last log and the FLOs
  not yet summed over ranks (both enter the next log), and the RNG states Trainer's resume
  must find: at an epoch's first minibatch those at ``on_epoch_begin`` (Trainer loads them
  before creating the epoch's iterator), elsewhere those at the minibatch start (Trainer
  loads them after fetching the first batch).
* A rank that died saved nothing of its own; its values are kept in a node-local file
  rewritten at every minibatch start (``_rank_state``). Without it (another node) the
  replica's values are used, with a warning: the RNG is then exact only where the ranks'
  streams are equal (``set_seed`` on every rank, Trainer's default), the next logged loss is
  not.
* Trainer's periodic saves and evaluations are set aside from the hang bound's learning: a
  slow rank-0 save does not make a later hang take minutes to be found.
* The user's own ``resume_from_checkpoint`` is honoured: the newer of it and the JIT
  checkpoint (by ``global_step``) is loaded, one of them, once.

Limits: one ``train()`` per process; DeepSpeed, FSDP and SageMaker MP are not supported
(their checkpoints are collective). ``restore_callback_states_from_checkpoint`` needs not be
set: the callbacks' states are restored in place from the JIT checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState, TrainerState

from .. import api
from ..listeners import Event
from ..resume.data import _portable, _rng_restore, _rng_snapshot
from . import _rank_state
from ._transformers_files import RANK_FILE, SHARED_FILE, write_checkpoint


def _say(msg: str) -> None:
    print(f"[jitckpt] {msg}", file=sys.stderr, flush=True)


def _find_trainer() -> Any:
    """The Trainer whose ``__init__`` is calling ``on_init_end`` (a callback is never handed
    the Trainer itself)."""
    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        f = f.f_back
    return None


def _exportable(trainer: Any) -> list:
    return [cb for cb in trainer.callback_handler.callbacks + [trainer.control] if isinstance(cb, ExportableState)]


def _state_step(ckpt: str | None) -> int | None:
    try:
        with open(os.path.join(ckpt, "trainer_state.json"), encoding="utf-8") as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class JitCallback(TrainerCallback):
    """Makes ``Trainer.train`` exactly resumable under jitrun (see the module docstring)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.snap: dict | None = None  # taken at the last minibatch start; read by the save
        self.epoch_rng: dict | None = None  # at on_epoch_begin
        self.epoch_step = 0  # global_step at on_epoch_begin
        self.jit_path: str | None = None  # the JIT checkpoint train() resumes from
        self.mine: dict | None = None  # this rank's values for it
        self.restored_step: int | None = None
        self._writer: _rank_state.Writer | None = None
        self._end: dict | None = None  # inside _maybe_log_save_evaluate: its arguments and the flags

    # -- Trainer hooks ----------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs) -> None:
        rt = api._get_runtime()
        if not rt.cfg.managed or self.trainer is not None:
            return
        trainer = _find_trainer()
        if trainer is None:
            raise RuntimeError("jitckpt JitCallback: pass it to the Trainer: Trainer(..., callbacks=[JitCallback()])")
        for name in ("_load_rng_state", "_inner_training_loop", "current_flos", "callback_handler"):
            if not hasattr(trainer, name):
                raise RuntimeError(f"jitckpt JitCallback: this transformers' Trainer has no {name!r}; "
                                   "tested with transformers 5.24")
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            raise RuntimeError("jitckpt JitCallback: DeepSpeed and FSDP Trainer runs are not supported "
                               "(their checkpoints are collective); run without JitCallback")
        self.trainer = trainer
        orig_train, orig_rng = trainer.train, trainer._load_rng_state
        cb = self

        def train(self, resume_from_checkpoint=None, *a, **kw):
            return orig_train(cb._start(resume_from_checkpoint), *a, **kw)

        def load_rng_state(self, checkpoint):
            if checkpoint is not None and checkpoint == cb.jit_path and cb.mine is not None:
                _rng_restore(cb.mine["rng"])
            else:
                orig_rng(checkpoint)

        trainer.train = types.MethodType(train, trainer)
        trainer._load_rng_state = types.MethodType(load_rng_state, trainer)
        self._wrap_step_end(trainer)

    def _wrap_step_end(self, trainer: Any) -> None:
        """Know when the runtime's provisional start (the first collective after an optimizer
        step) falls inside Trainer's step-end log/evaluate/save, and with what arguments: a
        JIT checkpoint taken there is restored from that call's start and the call redone."""
        orig = trainer._maybe_log_save_evaluate
        cb = self

        def step_end(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                     learning_rate=None):
            cb._end = {"grad_norm": grad_norm, "epoch": epoch, "learning_rate": learning_rate,
                       "control": dict(self.control.state()["args"])}
            # a periodic save (rank 0's files take longest) or an evaluation: not what a minibatch
            # or a wait takes, so not learned into the hang bound (jitckpt/hang/waits.py)
            waits = api._get_runtime().waits
            heavy = waits is not None and (self.control.should_save or self.control.should_evaluate)
            try:
                with waits.aside() if heavy else contextlib.nullcontext():
                    return orig(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                                learning_rate=learning_rate)
            finally:
                cb._end = None

        trainer._maybe_log_save_evaluate = types.MethodType(step_end, trainer)

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if self.trainer is None or self.mine is None or self.jit_path is None:
            return
        tr, sc = self.trainer, self.mine["scalars"]
        if not isinstance(getattr(tr, "_tr_loss", None), torch.Tensor):
            raise RuntimeError("jitckpt JitCallback: this transformers' Trainer keeps no _tr_loss; tested with 5.24")
        # what _inner_training_loop just reset for a resumed train() call: as the original run had it
        tr._tr_loss.copy_(self.mine["tr_loss"].to(tr._tr_loss.device))
        tr._total_loss_scalar = sc["total_loss_scalar"]
        tr._globalstep_last_logged = sc["globalstep_last_logged"]
        tr.current_flos = sc["current_flos"]
        tr._initial_global_step = sc["initial_global_step"]
        tr._initial_num_input_tokens_seen = sc["initial_tokens"]
        state.stateful_callbacks = sc["stateful"]  # each rank's own (only rank 0's are saved)
        with open(os.path.join(self.jit_path, SHARED_FILE), encoding="utf-8") as f:
            shared = json.load(f)
        if not args.restore_callback_states_from_checkpoint:
            self._restore_callbacks(shared["callbacks"])
        self.restored_step = state.global_step
        redo = shared.get("redo")
        if redo is not None:
            # taken inside the step-end log/evaluate/save: redo it as the original run did it
            for k, v in redo["control"].items():
                setattr(control, k, v)
            tr._maybe_log_save_evaluate(tr._tr_loss, redo["grad_norm"], tr.model_wrapped, None, redo["epoch"],
                                        None, time.time(), learning_rate=redo["learning_rate"])

    def on_epoch_begin(self, args, state, control, **kwargs) -> None:
        if self.trainer is not None:
            # Trainer's resume loads the RNG right after this hook when it resumes at an epoch's start
            self.epoch_rng = _rng_snapshot()
            self.epoch_step = state.global_step

    # -- start: register, choose the checkpoint ------------------------------------------

    def _start(self, user: Any) -> Any:
        rt = api._get_runtime()
        if self._writer is not None:
            raise RuntimeError("jitckpt JitCallback: train() is called once per process under jitrun")
        self._writer = _rank_state.Writer(_rank_state.path_for(rt.cfg.root, rt.cfg.rank))
        api.register(self._save)
        api.keeps_rank_state()
        rt.listeners.add(Event.MINIBATCH_START, lambda provisional=False: self._snapshot(rt.steps_done, provisional))
        return self._choose(api.get_checkpoint_path(), user)

    def _choose(self, jit: str | None, user: Any) -> Any:
        from transformers.trainer_utils import get_last_checkpoint

        tr, rt = self.trainer, api._get_runtime()
        path = get_last_checkpoint(tr.args.output_dir) if user is True and os.path.isdir(tr.args.output_dir) \
            else (user or None)
        if jit is None:
            step = _state_step(path) if isinstance(path, str) else None
            if step is not None:  # the script's own checkpoint: the JIT saves' step labels count from there
                rt.steps_done = step
            return user
        jit_step, own = _state_step(jit), _state_step(path) if isinstance(path, str) else None
        if own is not None and jit_step is not None and own > jit_step:
            _say(f"rank {rt.cfg.rank}: resuming from {path} (step {own}), newer than the JIT checkpoint "
                 f"(step {jit_step})")
            rt.steps_done = own
            return path
        if path:
            _say(f"rank {rt.cfg.rank}: resuming from the JIT checkpoint {jit} (step {jit_step}), not from "
                 f"{path} (step {own})")
        self.jit_path, self.mine = jit, self._mine(jit, jit_step)
        print(f"[jitckpt] rank {rt.cfg.rank}: resumed from {jit} at step {jit_step}", flush=True)
        return jit

    def _mine(self, jit: str, step: int | None) -> dict:
        """This rank's own values for the JIT checkpoint: its file there, else the one it kept
        at that minibatch start (it died without saving), else the replica's (with a warning)."""
        rt = api._get_runtime()
        rank = rt.cfg.rank
        own = os.path.join(jit, RANK_FILE.format(rank))
        if os.path.isfile(own):
            return torch.load(own, weights_only=True)
        kept = _rank_state.read(_rank_state.path_for(rt.cfg.root, rank), job=rt.cfg.job_id or "", step=rt.steps_done)
        if kept is not None:
            return {"rng": kept["rng"], "tr_loss": torch.tensor(kept["scalars"].pop("tr_loss")),
                    "scalars": kept["scalars"]}
        other = sorted(Path(jit).glob(RANK_FILE.format("*")))
        if not other:
            raise RuntimeError(f"jitckpt JitCallback: {jit} has no {RANK_FILE.format('R')}: not a JitCallback "
                               "checkpoint")
        _say(f"rank {rank}: WARNING: this rank's RNG states and loss sum at step {step} were not kept (it died "
             f"on another node, or before its first minibatch); using {other[0].name}: exact only if the "
             "ranks' RNG streams are equal, and the next logged loss differs")
        return torch.load(other[0], weights_only=True)

    # -- at each minibatch start, and the save --------------------------------------------

    def _snapshot(self, steps_done: int, provisional: bool) -> None:
        tr = self.trainer
        st = tr.state
        at_epoch_start = st.global_step == self.epoch_step and self.epoch_rng is not None
        rng = _portable(self.epoch_rng if at_epoch_start else _rng_snapshot())
        tr_loss = tr._tr_loss.detach().clone()
        scalars = {"total_loss_scalar": tr._total_loss_scalar, "globalstep_last_logged": tr._globalstep_last_logged,
                   "current_flos": tr.current_flos, "initial_global_step": tr._initial_global_step,
                   "initial_tokens": tr._initial_num_input_tokens_seen,
                   "stateful": copy.deepcopy(st.stateful_callbacks)}
        end = self._end if provisional else None
        redo = None if end is None else {
            "control": end["control"], "epoch": end["epoch"], "learning_rate": end["learning_rate"],
            "grad_norm": float(end["grad_norm"]) if end["grad_norm"] is not None else None}
        # A new dict, assigned in one step: the save may run on the watcher thread
        self.snap = {"state": copy.copy(st), "log_len": len(st.log_history), "redo": redo,
                     "stateful": scalars["stateful"],
                     "callbacks": [(type(cb).__name__, cb.state()) for cb in _exportable(tr)],
                     "rng": rng, "tr_loss": tr_loss, "scalars": scalars}
        cfg = api._get_runtime().cfg
        self._writer.write(job=cfg.job_id or "", step=steps_done, rng=rng,
                           scalars={**scalars, "tr_loss": float(tr_loss)})

    def _save(self, ckpt_dir: str) -> None:
        snap = self.snap
        if snap is None:  # the runtime refuses saves before the first minibatch
            raise RuntimeError("jitckpt JitCallback: JIT save before any minibatch started")
        api.checkpoint_step()  # the runtime's step is the label; Trainer's global_step is in the state
        state: TrainerState = copy.copy(snap["state"])
        state.log_history = state.log_history[:snap["log_len"]]
        state.stateful_callbacks = snap["stateful"]
        write_checkpoint(self.trainer, ckpt_dir, state, snap)

    def _restore_callbacks(self, saved: list) -> None:
        live = _exportable(self.trainer)
        if [n for n, _ in saved] != [type(cb).__name__ for cb in live]:
            _say("WARNING: JitCallback: the Trainer's stateful callbacks differ from the checkpoint's "
                 f"({[n for n, _ in saved]}); their states are not restored")
            return
        for cb, (_, st) in zip(live, saved, strict=True):
            for k, v in st.get("attributes", {}).items():
                setattr(cb, k, v)


__all__ = ["JitCallback"]
