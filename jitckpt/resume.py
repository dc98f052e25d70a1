"""``resumable(...)``: one call that makes a training script exactly resumable.

The caller hands over the objects it already has; jitckpt builds the save_fn,
restores everything after a restart, and keeps the three things a save_fn
writer most often gets wrong (README, "The save_fn contract") right by taking
them at the minibatch boundary the runtime detects:

* RNG states (torch CPU, CUDA when initialised, numpy's global generator when
  numpy is imported, ``random``) are snapshotted at the start of every
  minibatch (the first DDP forward / backward / collective after an optimizer
  step, i.e. the JIT save's consistent point) and, after a restart, restored at
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
the runtime saves before the next optimizer step writes them (runtime.py).
"""

from __future__ import annotations

import copy
import os
import random
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from . import api

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


# -- RNG ---------------------------------------------------------------------


def _rng_snapshot() -> dict:
    snap: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    # Only when CUDA is already initialised: asking earlier would initialise it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        snap["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        # the bulk of this function's ~70 us per minibatch; converted only when saved (_portable)
        snap["numpy"] = np.random.get_state()
    return snap


def _portable(snap: dict) -> dict:
    """The snapshot as weights_only=True can load it: numpy's key array as a tensor."""
    if "numpy" not in snap or isinstance(snap["numpy"][1], torch.Tensor):
        return snap
    name, keys, pos, has_gauss, gauss = snap["numpy"]
    return {**snap, "numpy": (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                              float(gauss))}


def _rng_restore(snap: Mapping) -> None:
    torch.set_rng_state(snap["torch"])
    random.setstate(_tuplify(snap["random"]))
    if "cuda" in snap and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(snap["cuda"])
    if "numpy" in snap:
        import numpy as np

        name, keys, pos, has_gauss, gauss = snap["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def _tuplify(x: Any) -> Any:
    # random.setstate wants the nested tuples back (a round trip may give lists)
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# -- data position -----------------------------------------------------------


class _SkipSampler:
    """The loader's index sampler, skipping the items (batches of indices
    under auto-collation) that ``_LoaderTracker.new_iterator`` asks for while
    it creates an iterator. Only indices are
    drawn for the skipped part: no sample is loaded. ``len`` stays the
    sampler's, so ``len(loader)`` keeps meaning batches per epoch."""

    def __init__(self, base: Any, loader: Any) -> None:
        self.base = base
        self.loader = loader

    def __iter__(self) -> Iterator:
        # Read, not popped: a multi-worker iterator calls iter() on its index
        # sampler twice while it is created (__init__, then _reset).
        return self._skipping(self.loader.__dict__.get("_jitckpt_skip", 0))

    def _skipping(self, skip: int) -> Iterator:
        # A generator, so nothing is drawn before the first batch is asked for:
        # a RandomSampler draws its seed from the global RNG on its first item,
        # which in the original run came after the iterator drew _base_seed.
        it = iter(self.base)
        for _ in range(skip):
            if next(it, _END) is _END:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.base)

    def __getattr__(self, name: str) -> Any:
        if name in ("base", "loader"):  # not set yet (copy/unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)


_END = object()


class _EpochRecord:
    """One iterator of a tracked loader: the RNG and generator states at its
    creation, batches it yielded, and batches whose optimizer step is done."""

    __slots__ = ("rng", "gens", "epoch", "yielded", "consumed")

    def __init__(self, rng: torch.Tensor, gens: list[torch.Tensor], epoch: int | None, skipped: int) -> None:
        self.rng, self.gens, self.epoch = rng, gens, epoch
        self.yielded = self.consumed = skipped


class _CountingIter:
    """The loader's iterator, counting the batches it hands out."""

    def __init__(self, it: Any, rec: _EpochRecord) -> None:
        self._it, self._rec = it, rec

    def __iter__(self) -> _CountingIter:
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self._rec.yielded += 1
        return item

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        if name in ("_it", "_rec"):
            raise AttributeError(name)
        return getattr(self._it, name)


def _generators(loader: Any) -> list[torch.Generator]:
    """Every torch.Generator the loader's order depends on, each once, in a
    fixed order: its own and those of its samplers, followed through
    ``sampler`` / ``batch_sampler`` a few levels deep (Accelerate's
    BatchSamplerShard wraps a BatchSampler that holds the RandomSampler)."""
    found: list[torch.Generator] = []

    def walk(owner: Any, depth: int) -> None:
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
        if depth < 3:
            for attr in ("sampler", "batch_sampler"):
                child = getattr(owner, attr, None)
                if child is not None and child is not owner:
                    walk(child, depth + 1)

    walk(loader, 0)
    return found


class _LoaderTracker:
    """Data position of one plain DataLoader (see the module docstring)."""

    def __init__(self, loader: Any, session: _Session) -> None:
        self.loader = loader
        self.session = session
        self.current: _EpochRecord | None = None
        self.resume: dict | None = None  # position to restore, until the first resumed minibatch
        cls = type(loader)
        tracker = self

        def __iter__(self):  # noqa: N807 - becomes the loader's __iter__
            return tracker.new_iterator(lambda: cls.__iter__(self))

        def _index_sampler(self):
            return _SkipSampler(cls._index_sampler.fget(self), self)

        # A per-instance subclass: Python looks __iter__ up on the type, and
        # DataLoader forbids reassigning sampler/batch_sampler after __init__.
        loader.__class__ = type(cls.__name__, (cls,), {
            "__iter__": __iter__, "_index_sampler": property(_index_sampler),
            "__module__": cls.__module__, "_jitckpt_tracked": True})

    def new_iterator(self, make: Any) -> _CountingIter:
        skip = 0
        if self.resume is not None:
            # Every iterator created before the first resumed minibatch (also a
            # probe like `next(iter(loader))`) starts where the saved one was,
            # from the same RNG and generator states, so it draws the same seeds.
            pos = self.resume
            torch.set_rng_state(pos["rng"])
            for g, s in zip(_generators(self.loader), pos["gens"], strict=True):
                g.set_state(s)
            skip = pos["consumed"]
            epoch = getattr(getattr(self.loader, "sampler", None), "epoch", None)
            if pos["epoch"] is not None and epoch is not None and epoch != pos["epoch"]:
                print(f"[jitckpt] WARNING: resuming a DataLoader whose sampler is at epoch {epoch}, but the "
                      f"checkpoint was taken in epoch {pos['epoch']}: restore your epoch counter (resumable's "
                      "state=) and call set_epoch before iterating; the data position may be wrong",
                      file=sys.stderr, flush=True)
        rec = _EpochRecord(torch.get_rng_state(), [g.get_state() for g in _generators(self.loader)],
                           getattr(getattr(self.loader, "sampler", None), "epoch", None), skip)
        self.loader.__dict__["_jitckpt_skip"] = skip
        try:
            it = make()
        finally:
            self.loader.__dict__.pop("_jitckpt_skip", None)
        self.current = rec
        return _CountingIter(it, rec)

    def step_done(self) -> None:
        if self.current is not None:
            self.current.consumed = self.current.yielded

    def position(self) -> dict | None:
        rec = self.current
        if rec is None:
            return self.resume  # nothing iterated since the restart: still the saved position
        return {"rng": rec.rng, "gens": rec.gens, "epoch": rec.epoch, "consumed": rec.consumed}


def _is_lookahead_adapter(loader: Any) -> bool:
    # Hugging Face Accelerate's DataLoaderShard: wraps a DataLoader
    # (base_dataloader), reads one batch ahead to flag the last one, keeps its
    # own epoch counter (iteration) and claims the wrapped loader's __class__.
    return all(hasattr(loader, a) for a in ("base_dataloader", "end_of_dataloader", "iteration"))


class _LookaheadTracker(_LoaderTracker):
    """A loader adapter that reads one batch ahead of what it hands out: the
    wrapped DataLoader is tracked, and one batch fewer counts as consumed
    until the adapter has seen the end of the epoch."""

    def __init__(self, adapter: Any, session: _Session) -> None:
        super().__init__(adapter.base_dataloader, session)
        self.adapter = adapter

    def step_done(self) -> None:
        if self.current is not None:
            ahead = 0 if self.adapter.end_of_dataloader else 1
            self.current.consumed = max(0, self.current.yielded - ahead)

    def position(self) -> dict | None:
        pos = super().position()
        if pos is not None and self.current is not None:
            pos = {**pos, "iteration": self.adapter.iteration}
        return pos

    def restore(self, pos: dict) -> None:
        self.resume = pos
        self.adapter.iteration = pos.get("iteration", self.adapter.iteration)


class _StatefulLoaderTracker:
    """A loader that keeps its own state (torchdata's StatefulDataLoader).

    Its state_dict counts batches *fetched*; at the JIT save the current
    minibatch's batch has been fetched but not trained on. So the state is
    taken where nothing is in flight: after each optimizer step and at each
    new iterator (a new epoch begins there)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.state: Any = None
        cls = type(loader)
        tracker = self

        def __iter__(self):  # noqa: N807
            it = cls.__iter__(self)
            tracker.state = self.state_dict()
            return it

        loader.__class__ = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                                        "_jitckpt_tracked": True})

    def step_done(self) -> None:
        self.state = self.loader.state_dict()

    def position(self) -> Any:
        return self.state


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
        self.sharded: Any = None  # resume_sharded.ShardedState: an FSDP2 model and its optimizers

    # runtime hook: the start of a minibatch (before a deferred JIT save)
    def on_minibatch_start(self) -> None:
        resumed = self.pending_rng is not None
        if resumed:
            rng, self.pending_rng = self.pending_rng, None
            _rng_restore(rng)
        # A new object each time, assigned in one step: the save may run on the
        # watcher thread and must see one whole snapshot.
        self.snap = {"rng": _rng_snapshot(), "state": copy.deepcopy(self.state),
                     "data": [t.position() for t in self.trackers]}
        if resumed:  # iterators created from now on start a fresh epoch
            for t in self.trackers:
                if isinstance(t, _LoaderTracker):
                    t.resume = None

    def on_step_done(self) -> None:
        for t in self.trackers:
            t.step_done()

    def save(self, ckpt_dir: str) -> None:
        snap = self.snap
        if snap is None:  # cannot happen: saves are refused before the first minibatch
            raise RuntimeError("jitckpt.resumable: JIT save before any minibatch started")
        payload = {
            "format": _FORMAT,
            "step": api.checkpoint_step(),
            "objects": {name: obj.state_dict() for name, obj in self.objects.items()},
            **snap,
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


def _install_step_hook() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def hook(opt, args, kwargs) -> None:
        s = _session
        if s is not None:
            s.on_step_done()

    register_optimizer_step_post_hook(hook)


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
    state = {} if state is None else state
    if not isinstance(state, dict):
        raise TypeError(f"jitckpt.resumable: state must be a dict of counters, got {type(state).__name__}")
    from . import resume_sharded

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
        api.register(session.save, shard=shard)
        rt = api._get_runtime()
        rt.on_minibatch_start = session.on_minibatch_start
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


def _track(model: Any, optimizer: Any) -> None:
    """The state the replicas compare (verifier.py): an FSDP2 model has no DDP wrapper to be seen by."""
    from . import tracked

    for m in _as_list(model):
        tracked.add_model(m)
    for o in _as_list(optimizer):
        tracked.add_optimizer(o)


def _collect(*, model: Any, optimizer: Any, scheduler: Any, scaler: Any, stateful: dict[str, Any]) -> dict[str, Any]:
    """Name -> object whose state_dict the save writes (a sharded model and its optimizers are
    resume_sharded's: per-shard DCP files, so the caller passes None for them)."""
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
