"""``resumable(...)``: one call that makes a training script exactly resumable.

The caller hands over the objects it already has; jitckpt builds the save_fn,
restores everything after a restart, and keeps the three things a save_fn
writer most often gets wrong (README, "The save_fn contract") right by taking
them at the minibatch boundary the runtime detects:

* RNG states (torch CPU, CUDA when initialised, numpy's global generator when
  numpy is imported, ``random``) are snapshotted at the start of every
  minibatch (the first *training* DDP forward or backward after an optimizer
  step, i.e. the JIT save's consistent point; a collective in between stands
  in for it provisionally, docs/recovery.md) and, after a restart, restored at
  that same point of the first resumed minibatch. Whatever the script draws in
  between (a DataLoader iterator's ``_base_seed``, a RandomSampler's seed) is
  drawn from the same states as in the original run and cannot shift them.
* The user's own counters (``state={"epoch": 0, ...}``) are copied at the same
  boundary and restored in place into the dict.
* The data position: for a plain ``DataLoader`` jitckpt counts the batches of
  the current iterator that completed optimizer steps, and after a restart the
  iterators created before the first resumed minibatch skip that many batches
  of sampler indices without loading any sample (the index sampler is wrapped;
  workers are only handed the remaining indices). The global RNG and every
  generator the loader uses are put back to their state at that iterator's
  creation first, so the shuffled order and the workers' seeds are the same.
  A loader with ``state_dict``/``load_state_dict`` (torchdata's
  ``StatefulDataLoader``) is asked for its own state instead, at the same points.

Model parameters, optimizer, scheduler and scaler states need no snapshot:
the runtime saves before the next optimizer step writes them (runtime.py),
and puts back the buffers the minibatch's forward wrote (buffers.py). At a
provisional start the schedulers' state and the optimizers' hyper-parameters
are copied (``_hyper``): a ``scheduler.step()`` between epochs may follow it.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Any

import torch

from .. import api
from ..listeners import Event
from ..refusal import refuse
from .data import (
    _is_lookahead_adapter,
    _LoaderTracker,
    _LookaheadTracker,
    _portable,
    _rng_restore,
    _rng_snapshot,
    _StatefulLoaderTracker,
)

STATE_FILE = "jitckpt_state.pt"
_FORMAT = 1

_lock = threading.Lock()
_session: _Session | None = None


def _as_list(obj: Any) -> list:
    if obj is None:
        return []
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return [obj]


def _unwrap(model: Any) -> Any:
    # DDP / FSDP1 / Accelerate wrappers keep the real module in .module: saving
    # the bare module gives checkpoints that load with or without the wrapper.
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel) or type(model).__name__ in ("DataParallel",):
        model = model.module
    return model


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


# -- the session -------------------------------------------------------------


class _Session:
    def __init__(self, objects: dict[str, Any], state: dict, loaders: list[Any]) -> None:
        self.objects = objects
        self.state = state
        self.trackers: list[_LoaderTracker | _StatefulLoaderTracker] = []
        for dl in loaders:
            if getattr(type(getattr(dl, "base_dataloader", dl)), "_jitckpt_tracked", False):
                raise RuntimeError("jitckpt.resumable: this DataLoader is already tracked")
            if _is_lookahead_adapter(dl):
                self.trackers.append(_LookaheadTracker(dl, self))
            elif _is_stateful(dl):
                self.trackers.append(_StatefulLoaderTracker(dl))
            else:
                self.trackers.append(_LoaderTracker(dl, self))
        self.snap: dict | None = None  # taken at the start of the current minibatch
        self.pending_rng: dict | None = None  # to restore at the first resumed minibatch start
        self.restored_step: int | None = None
        self.sharded: Any = None  # sharded.ShardedState: an FSDP2 model and its optimizers

    # runtime hook: the start of a minibatch (before a deferred JIT save)
    def on_minibatch_start(self, provisional: bool = False) -> None:
        """``provisional``: at a collective after an optimizer step, where an evaluation pass
        or the epoch's bookkeeping (``scheduler.step()``) may still follow before the next
        training forward takes the start again. A save in between must describe this point,
        so the hyper-parameters that bookkeeping moves are copied too (_hyper)."""
        resumed = self.pending_rng is not None
        if resumed:
            self.restore_pending_rng()
        # A new object each time, assigned in one step: the save may run on the
        # watcher thread and must see one whole snapshot.
        snap = {"rng": _rng_snapshot(), "state": copy.deepcopy(self.state),
                "data": [t.position() for t in self.trackers]}
        if provisional:
            snap["hyper"] = _hyper(self.objects)
        self.snap = snap
        if resumed:  # iterators created from now on start a fresh epoch
            for t in self.trackers:
                if isinstance(t, _LoaderTracker):
                    t.resume = None

    def restore_pending_rng(self) -> None:
        rng, self.pending_rng = self.pending_rng, None
        if rng is not None:
            _rng_restore(rng)

    def on_step_done(self) -> None:
        for t in self.trackers:
            t.step_done()

    def save(self, ckpt_dir: str) -> None:
        snap = self.snap
        if snap is None:  # cannot happen: saves are refused before the first minibatch
            raise RuntimeError("jitckpt.resumable: JIT save before any minibatch started")
        hyper = snap.get("hyper") or {}
        objects = {name: _as_of(name, obj.state_dict(), hyper) for name, obj in self.objects.items()}
        payload = {
            "format": _FORMAT,
            "step": api.checkpoint_step(),
            "objects": objects,
            **{k: v for k, v in snap.items() if k != "hyper"},
            "rng": _portable(snap["rng"]),
        }
        if self.sharded is not None:
            payload["sharded"] = self.sharded.save(ckpt_dir)
        torch.save(payload, os.path.join(ckpt_dir, STATE_FILE))

    def load(self, path: str) -> int:
        payload = torch.load(os.path.join(path, STATE_FILE), weights_only=True)
        if payload.get("format") != _FORMAT:
            raise RuntimeError(f"jitckpt.resumable: {path} has checkpoint format {payload.get('format')!r}, "
                               f"this jitckpt reads {_FORMAT}")
        missing = set(self.objects) - set(payload["objects"])
        if missing:
            raise RuntimeError(f"jitckpt.resumable: checkpoint {path} lacks {sorted(missing)}; pass the same "
                               "objects as the run that saved it")
        for name, obj in self.objects.items():
            obj.load_state_dict(payload["objects"][name])
        if self.sharded is not None:
            self.sharded.load(path, payload.get("sharded"))
        self.state.clear()
        self.state.update(payload["state"])
        if len(payload["data"]) != len(self.trackers):
            raise RuntimeError(f"jitckpt.resumable: checkpoint {path} tracked {len(payload['data'])} data loaders, "
                               f"this run passes {len(self.trackers)}")
        for t, pos in zip(self.trackers, payload["data"], strict=True):
            if pos is None:
                continue
            if isinstance(t, _StatefulLoaderTracker):
                t.loader.load_state_dict(pos)
                t.state = pos
            elif isinstance(t, _LookaheadTracker):
                t.restore(pos)
            else:
                t.resume = pos
        self.pending_rng = payload["rng"]
        # Until the first minibatch starts, a save describes the restored state.
        self.snap = {"rng": payload["rng"], "state": copy.deepcopy(payload["state"]), "data": payload["data"]}
        self.restored_step = int(payload["step"])
        return self.restored_step


def _hyper(objects: dict[str, Any]) -> dict[str, Any]:
    """What a step's bookkeeping changes without an optimizer step: the schedulers' state and
    the optimizers' hyper-parameters (a scheduler writes ``lr`` into the param groups). Small
    and host-only: no tensor state is copied."""
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        if name.startswith("scheduler"):
            out[name] = copy.deepcopy(obj.state_dict())
        elif name.startswith("optimizer") and hasattr(obj, "param_groups"):
            out[name] = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in obj.param_groups]
    return out


def _as_of(name: str, sd: Any, hyper: dict[str, Any]) -> Any:
    """``sd`` with what ``_hyper`` copied at a provisional start put back."""
    if name not in hyper:
        return sd
    if name.startswith("scheduler"):
        return hyper[name]
    groups = [{**g, **h} for g, h in zip(sd["param_groups"], hyper[name], strict=True)]
    return {**sd, "param_groups": groups}


def _install_step_hook() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def hook(opt, args, kwargs) -> None:
        s = _session
        if s is not None:
            s.on_step_done()

    register_optimizer_step_post_hook(hook)


def _join(session: _Session, shard: str | int | None) -> Any:
    """The session's save and minibatch-start snapshot joined to the runtime."""
    api.register(session.save, shard=shard)
    rt = api._get_runtime()
    rt.listeners.add(Event.MINIBATCH_START, session.on_minibatch_start)
    return rt


def resumable(*, model: Any = None, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
              dataloader: Any = None, state: dict | None = None, shard: str | int | None = None,
              **stateful: Any) -> dict:
    """Make this script exactly resumable under jitrun, without a save_fn.

    Pass the objects the script already has: ``model`` (DDP-wrapped or not),
    ``optimizer`` and ``scheduler`` (one or a list), ``scaler`` (GradScaler),
    ``dataloader`` (one or a list: plain ``DataLoader`` or torchdata's
    ``StatefulDataLoader``), any other object with ``state_dict`` /
    ``load_state_dict`` as a keyword, and ``state``: a dict of your own
    counters (e.g. ``{"epoch": 0}``; values an int/float/str/tensor).

    Registers the JIT save (one ``torch.save`` per replica; loaded back with
    ``weights_only=True``). If a checkpoint exists (after a restart) restores
    every object now, puts the saved values back into ``state`` in place, and
    arranges for RNG states and the loader's position to be restored at the
    first resumed minibatch. Returns ``state`` (a new dict if none was given).

    Keep ``state`` current *before* each minibatch's first forward (e.g. set
    ``state["epoch"] = epoch`` at the top of the epoch loop) and start your
    loops from it. Call once per process, instead of ``register``.
    """
    global _session
    _refuse_inside_trainer()
    state = {} if state is None else state
    if not isinstance(state, dict):
        raise TypeError(f"jitckpt.resumable: state must be a dict of counters, got {type(state).__name__}")
    from . import sharded as resume_sharded

    sharded_model = model if model is not None and resume_sharded.is_sharded(model) else None
    objects = _collect(model=None if sharded_model is not None else model,
                       optimizer=None if sharded_model is not None else optimizer,
                       scheduler=scheduler, scaler=scaler, stateful=stateful)
    loaders = _as_list(dataloader)
    if not objects and not loaders and not state and sharded_model is None:
        raise TypeError("jitckpt.resumable: nothing to checkpoint (pass model=, optimizer=, ...)")

    with _lock:
        if _session is not None:
            raise RuntimeError("jitckpt.resumable was already called in this process")
        session = _Session(objects, state, loaders)
        if sharded_model is not None:
            session.sharded = resume_sharded.setup(sharded_model, _as_list(optimizer), shard, api._get_runtime())
            shard = session.sharded.shard
        rt = _join(session, shard)
        _install_step_hook()
        _track(model, optimizer)
        _session = session
        if session.sharded is not None:
            resume_sharded.after_register(session.sharded, rt, sharded_model)

    path = api.get_checkpoint_path()
    if path is not None:
        step = session.load(path)
        print(f"[jitckpt] rank {rt.cfg.rank}: resumed from {path} at step {step}", flush=True)
    if session.sharded is not None:
        resume_sharded.after_restore(session.sharded, rt, path)
    return state


def _refuse_inside_trainer() -> None:
    from ..integrations._hosts import TRAINER_HINT, inside_trainer_train

    if api._get_runtime().cfg.managed and inside_trainer_train():
        refuse("jitckpt.resumable cannot restore a transformers Trainer's step counters, epoch and log "
               f"history (Trainer computes them before any callback runs); {TRAINER_HINT}")


def _track(model: Any, optimizer: Any) -> None:
    """The state the replicas compare (verify/verifier.py): an FSDP2 model has no DDP wrapper to be seen by."""
    from .. import buffers, tracked

    rt = api._get_runtime()
    for m in _as_list(model):
        tracked.add_model(m)
        if not hasattr(m, "reducer") and callable(getattr(m, "register_forward_pre_hook", None)):
            # not DDP (hooks.py captures those after the broadcast): its own buffers at each start
            mirror = buffers.add(m)
            m.register_forward_pre_hook(lambda mod, inp, mirror=mirror: _capture(rt, mirror, mod))
    for o in _as_list(optimizer):
        tracked.add_optimizer(o)


def _capture(rt: Any, mirror: Any, mod: Any) -> None:
    if mod.training and torch.is_grad_enabled() and mirror.captured_at != rt.steps_done:
        mirror.capture(rt.steps_done)


def _collect(*, model: Any, optimizer: Any, scheduler: Any, scaler: Any, stateful: dict[str, Any]) -> dict[str, Any]:
    """Name -> object whose state_dict the save writes (a sharded model and its optimizers are
    resume.sharded's: per-shard DCP files, so the caller passes None for them)."""
    objects: dict[str, Any] = {}

    def add(name: str, obj: Any) -> None:
        if not _is_stateful(obj):
            raise TypeError(f"jitckpt.resumable: {name} ({type(obj).__name__}) has no state_dict/load_state_dict")
        objects[name] = obj

    if model is not None:
        add("model", _unwrap(model))
    for kind, objs in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        lst = _as_list(objs)
        for i, o in enumerate(lst):
            add(kind if len(lst) == 1 else f"{kind}.{i}", o)
    for name, obj in stateful.items():
        if name in objects:
            raise TypeError(f"jitckpt.resumable: {name!r} given twice")
        add(name, obj)
    return objects


def _reset_for_tests() -> None:
    global _session
    _session = None


__all__ = ["resumable", "STATE_FILE"]
