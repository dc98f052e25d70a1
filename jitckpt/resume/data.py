"""The RNG states and the data position ``resumable`` snapshots (resume.py's module docstring
says what and when): RNG snapshots in a form ``weights_only=True`` loads, and the trackers that
count a data loader's batches and make a restarted one skip them without loading a sample."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..refusal import refuse

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

    __slots__ = ("rng", "gens", "epoch", "yielded", "consumed", "on_end", "end")

    def __init__(self, rng: torch.Tensor, gens: dict, epoch: int | None, skipped: int) -> None:
        self.rng, self.gens, self.epoch = rng, gens, epoch
        self.yielded = self.consumed = skipped
        self.on_end: Any = None  # called once when the iterator is exhausted
        self.end: dict | None = None  # RNG and generator states when it was


class _CountingIter:
    """The loader's iterator, counting the batches it hands out."""

    def __init__(self, it: Any, rec: _EpochRecord) -> None:
        self._it, self._rec = it, rec

    def __iter__(self) -> _CountingIter:
        return self

    def __next__(self) -> Any:
        try:
            item = next(self._it)
        except StopIteration:
            if self._rec.on_end is not None:
                end, self._rec.on_end = self._rec.on_end, None
                end()
            raise
        self._rec.yielded += 1
        return item

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        if name in ("_it", "_rec"):
            raise AttributeError(name)
        return getattr(self._it, name)


def _generator_owners(loader: Any) -> dict[str, Any]:
    """Path -> each object the loader's order may draw from a ``generator`` attribute of (set
    or still None), each once, in a fixed order: the loader and its samplers, followed through
    ``sampler`` / ``batch_sampler`` a few levels deep (Accelerate's BatchSamplerShard wraps a
    BatchSampler that holds the RandomSampler). Paths, not positions: a sampler may create its
    generator lazily on its first ``__iter__`` (Accelerate's SeedableRandomSampler, Trainer's
    default), so how many generators exist differs between an epoch's start and a restart."""
    found: dict[str, Any] = {}

    def walk(owner: Any, path: str, depth: int) -> None:
        if any(owner is f for f in found.values()):
            return
        if hasattr(owner, "generator"):
            found[path] = owner
        if depth < 3:
            for attr in ("sampler", "batch_sampler"):
                child = getattr(owner, attr, None)
                if child is not None and child is not owner:
                    walk(child, f"{path}.{attr}" if path else attr, depth + 1)

    walk(loader, "", 0)
    return found


_SAME = "="  # in place of a device: this owner shares the generator of the path that follows


def _gen_states(loader: Any) -> dict[str, tuple[str, Any] | None]:
    """Path -> (device, state) of each generator, None where the owner has none yet, or
    (_SAME, path) where it shares one recorded before (``DataLoader(generator=g)`` hands g to
    its sampler)."""
    out: dict[str, tuple[str, Any] | None] = {}
    seen: dict[str, torch.Generator] = {}
    for path, owner in _generator_owners(loader).items():
        g = owner.generator
        if isinstance(g, torch.Generator):
            first = next((p for p, f in seen.items() if f is g), None)
            out[path] = (_SAME, first) if first is not None else (str(g.device), g.get_state())
            seen.setdefault(path, g)
        elif g is None:
            out[path] = None
    return out


class GeneratorsDiffer(RuntimeError):
    """The restarted loader's samplers are not those the checkpoint recorded."""


def _set_gen_states(loader: Any, saved: Any) -> None:
    """Put the loader's generators back to ``saved`` (``_gen_states``' form): one the original
    run had not created yet is removed again (its sampler creates and seeds it as it did), one
    it had that this process has not created yet is created here with the saved state."""
    owners = _generator_owners(loader)
    if isinstance(saved, list):  # a checkpoint of an older jitckpt: by position
        live = [g for g in (o.generator for o in owners.values()) if isinstance(g, torch.Generator)]
        if len(live) != len(saved):
            raise GeneratorsDiffer(f"the checkpoint recorded {len(saved)} sampler generators, this loader has "
                                   f"{len(live)}")
        for g, st in zip(live, saved, strict=True):
            g.set_state(st)
        return
    extra = [p for p, o in owners.items() if p not in saved and isinstance(o.generator, torch.Generator)]
    missing = [p for p in saved if p not in owners]
    if extra or missing:
        raise GeneratorsDiffer(f"the loader's samplers differ from the checkpoint's (generators at "
                               f"{sorted(saved)}, here at {sorted(owners)})")
    for path, st in saved.items():
        owner = owners[path]
        if st is None:
            owner.generator = None
            continue
        device, state = st
        if device == _SAME:
            owner.generator = owners[state].generator
            continue
        if not isinstance(owner.generator, torch.Generator):
            owner.generator = torch.Generator(device=device)
        owner.generator.set_state(state)


class _LoaderTracker:
    """Data position of one plain DataLoader (see the module docstring)."""

    def __init__(self, loader: Any, session: Any) -> None:
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
            try:
                _set_gen_states(self.loader, pos["gens"])
            except GeneratorsDiffer as e:
                refuse(f"jitckpt.resumable: cannot resume this DataLoader's position exactly: {e}; pass the "
                       "same loader as the run that saved it")
            skip = pos["consumed"]
            epoch = getattr(getattr(self.loader, "sampler", None), "epoch", None)
            if pos["epoch"] is not None and epoch is not None and epoch != pos["epoch"]:
                print(f"[jitckpt] WARNING: resuming a DataLoader whose sampler is at epoch {epoch}, but the "
                      f"checkpoint was taken in epoch {pos['epoch']}: restore your epoch counter (resumable's "
                      "state=) and call set_epoch before iterating; the data position may be wrong",
                      file=sys.stderr, flush=True)
        rec = _EpochRecord(torch.get_rng_state(), _gen_states(self.loader),
                           getattr(getattr(self.loader, "sampler", None), "epoch", None), skip)
        self.loader.__dict__["_jitckpt_skip"] = skip
        try:
            it = make()
        finally:
            self.loader.__dict__.pop("_jitckpt_skip", None)
        rec.on_end = self._resumed_epoch_ended if self.resume is not None else lambda: self._epoch_ended(rec)
        self.current = rec
        return _CountingIter(it, rec)

    def _epoch_ended(self, rec: _EpochRecord) -> None:
        # once per epoch: where a save taken before the next minibatch (validation, the
        # bookkeeping between epochs) must put the RNG back when a restart reaches this point
        rec.end = {"rng": _portable(_rng_snapshot()), "gens": _gen_states(self.loader)}

    def _resumed_epoch_ended(self) -> None:
        """The restored iterator ran out before any minibatch started: the checkpoint was taken
        after the epoch's last step (in validation, or the bookkeeping between epochs). The next
        epoch's iterator starts afresh, and the RNG and the loader's generators go back to their
        states when the original run's iterator ran out: the restart runs the same code from here."""
        pos, self.resume = self.resume, None
        end = pos.get("end") if pos is not None else None
        if end is None:  # a minibatch started meanwhile, or an iterator that never ran out
            return
        _rng_restore(end["rng"])
        try:
            _set_gen_states(self.loader, end["gens"])
        except GeneratorsDiffer as e:
            refuse(f"jitckpt.resumable: cannot resume this DataLoader exactly: {e}")
        if self.session is not None:
            self.session.pending_rng = None  # of a later point of the original run

    def step_done(self) -> None:
        if self.current is not None:
            self.current.consumed = self.current.yielded

    def position(self) -> dict | None:
        rec = self.current
        if rec is None:
            return self.resume  # nothing iterated since the restart: still the saved position
        pos = {"rng": rec.rng, "gens": rec.gens, "epoch": rec.epoch, "consumed": rec.consumed}
        if rec.end is not None:
            pos["end"] = rec.end
        return pos


def _is_lookahead_adapter(loader: Any) -> bool:
    # Hugging Face Accelerate's DataLoaderShard: wraps a DataLoader
    # (base_dataloader), reads one batch ahead to flag the last one, keeps its
    # own epoch counter (iteration) and claims the wrapped loader's __class__.
    return all(hasattr(loader, a) for a in ("base_dataloader", "end_of_dataloader", "iteration"))


class _LookaheadTracker(_LoaderTracker):
    """A loader adapter that reads one batch ahead of what it hands out: the
    wrapped DataLoader is tracked, and one batch fewer counts as consumed
    until the adapter has seen the end of the epoch."""

    def __init__(self, adapter: Any, session: Any) -> None:
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
