"""PyTorch Lightning: ``jitckpt.resumable`` as a Trainer callback.

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3,
                        callbacks=[jitckpt.integrations.lightning.JitCallback()])
    trainer.fit(model, train_loader)

Launched with jitrun, a failed rank costs at most one minibatch: the model,
optimizers, LR schedulers, the precision plugin (GradScaler), the callbacks'
states, the train data loaders (mid-epoch) and Lightning's own loop counters
(epoch, global step, batch index, ``_batches_that_stepped``) are restored
exactly. Without jitrun the callback does nothing visible.

How it fits Lightning (tested with 2.6.6; the private names it uses are checked at start-up):

* The objects are handed to ``jitckpt.resumable`` from inside
  ``FitLoop.setup_data``, at ``_load_combined_loader_states``: the point where
  Lightning itself restores data loader state from a checkpoint, after it has
  re-created the loaders (a ``DistributedSampler`` under DDP) and before it
  creates their iterator and resets its loops. jitckpt's data position
  (batches whose optimizer step was done) and RNG replay apply to those loaders.
* The loop counters are read when the JIT snapshot is taken, at the start of a
  minibatch, and stored in the form of a checkpoint Lightning's own ``ckpt_path``
  resume understands: mid-epoch, as ``ModelCheckpoint(every_n_train_steps=1)``
  would have written it at ``on_train_batch_end`` of the previous batch (Lightning's
  "restarted on train batch end" path then redoes nothing); at the first batch of
  an epoch, as the previous epoch fully ended (the loop then starts the epoch
  normally). They are loaded with ``fit_loop.load_state_dict`` before the
  loop's ``reset``, like ``trainer.fit(ckpt_path=...)`` does.
* SIGTERM: under jitrun it asks for a JIT save; Lightning's own handler
  (a broadcast in the signal handler, then stop) is taken out again.
* The minibatch start: under DDP Lightning broadcasts a SIGTERM flag at the top
  of every batch, before fetching it. The runtime is told that this collective
  starts the minibatch (also after an evaluation forward or a collective in
  epoch-end code took that role), so a snapshot and a deferred save happen
  there, before the batch's data is fetched. Lightning's automatic optimization
  runs forward and backward inside ``optimizer.step(closure)``; the callback
  makes each optimizer (except LBFGS, which calls its closure many times) run
  the closure before the step proper, so the optimizer-step hooks that tell the
  runtime "parameters are being written" fire after the backward. The numbers
  are unchanged (the closure still runs under ``torch.enable_grad()``).

Limits: map-style (sized) train loaders; ``reload_dataloaders_every_n_epochs``
is not supported; one ``fit`` per process. A failure detected between an
optimizer step and the next batch after a collective there (a ``sync_dist``
log, an evaluation, a checkpoint callback) is restored from counters taken at
that collective: exact mid-epoch, approximate (with a warning) inside the
epoch-end processing.
"""

from __future__ import annotations

import copy
import signal
import sys
import threading
import types
import warnings
from typing import Any

import torch

from .. import api
from ..resume import resumable as _resumable

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]

_KEY = "lightning"


def _warn(msg: str) -> None:
    print(f"[jitckpt] WARNING: {msg}", file=sys.stderr, flush=True)


class _CallbackStates:
    """The other callbacks' ``state_dict``s, keyed like Lightning's checkpoints."""

    def __init__(self, trainer: Any, owner: Any) -> None:
        self.trainer, self.owner = trainer, owner

    def _callbacks(self) -> list:
        return [cb for cb in self.trainer.callbacks if cb is not self.owner]

    def state_dict(self) -> dict:
        out = {}
        for cb in self._callbacks():
            sd = cb.state_dict()
            if sd:
                out[cb.state_key] = sd
        return out

    def load_state_dict(self, states: dict) -> None:
        for cb in self._callbacks():
            if cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])


class _LiveLoops(dict):
    """``resumable``'s counters: deep-copied at each minibatch start, which is
    where Lightning's loop state is read (and put in restorable form)."""

    def __init__(self, cb: JitCallback) -> None:
        super().__init__()
        self._cb = cb

    def __deepcopy__(self, memo: dict) -> dict:
        return {_KEY: self._cb._capture()}


def _canonical(sd: dict, accumulate: int, num_batches: float, exact: bool) -> dict:
    """Lightning's loop state read at a minibatch start, in the form of a
    checkpoint its ``ckpt_path`` resume continues from at that same point."""
    sd.get("state_dict", {}).pop("combined_loader", None)  # loaders: resumable's own position
    bp = sd["epoch_loop.batch_progress"]
    for part in ("current", "total"):
        d = bp[part]
        if d["processed"] == d["completed"]:  # a batch fetched (and started), not trained: not yet
            d["ready"] = d["started"] = d["completed"]
    cur = bp["current"]
    if cur["processed"] != cur["completed"]:
        # read inside on_train_batch_end (a collective there): already that form
        return {"kind": "batch_end", "exact": exact, "loops": sd}
    done = cur["completed"]
    if done == 0:
        # first batch of an epoch: as the previous epoch fully ended
        for part in ("current", "total"):
            d = sd["epoch_progress"][part]
            d["ready"] = d["started"] = d["completed"] = d["processed"]
        return {"kind": "epoch_start", "exact": exact, "loops": sd}
    if done >= num_batches:  # inside the epoch-end processing (a collective there)
        exact = False
    # mid-epoch: as ModelCheckpoint writes it at on_train_batch_end of the previous batch
    for part in ("current", "total"):
        bp[part]["completed"] -= 1
    bp["is_last_batch"] = False
    if done % accumulate == 0:  # that batch stepped: Lightning's resume counts it again
        sd["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
    return {"kind": "batch_end", "exact": exact, "loops": sd}


def _closure_first(opt: torch.optim.Optimizer) -> None:
    """Run a closure given to ``opt.step`` before the step proper (see the
    module docstring); the closure's result is what step returns, as before."""
    if isinstance(opt, torch.optim.LBFGS) or getattr(opt.step, "_jitckpt_closure_first", False):
        return
    inner = opt.step  # bound method, or the wrapper an LR scheduler put there

    def step(self, closure=None, *args, **kwargs):
        if closure is None:
            return inner(*args, **kwargs)
        with torch.enable_grad():
            result = closure()
        return inner(lambda: result, *args, **kwargs)

    step._jitckpt_closure_first = True
    if getattr(inner, "_wrapped_by_lr_sched", False):
        step._wrapped_by_lr_sched = True  # a later LR scheduler must not wrap it again
    opt.step = types.MethodType(step, opt)


def _minibatch_boundary() -> None:
    """Tell the runtime that the next collective / forward starts a minibatch."""
    api._get_runtime().expect_minibatch_start()


def _give_sigterm_back(trainer: Any) -> None:
    """Under jitrun SIGTERM means "save now" (the runtime's watcher thread acts
    on it). Lightning's own SIGTERM handler, installed just before training,
    would run a broadcast in the main thread, possibly while that thread
    writes the JIT checkpoint, and then stop the loop: put back the handler
    it replaced (Lightning restores it at teardown anyway)."""
    if not api._get_runtime().cfg.managed:
        return
    connector = getattr(trainer, "_signal_connector", None)
    original = getattr(connector, "_original_handlers", {}).get(signal.SIGTERM)
    if original is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, original)


class JitCallback(Callback):
    """Makes ``trainer.fit`` exactly resumable under jitrun (see the module
    docstring). Extra objects with ``state_dict``/``load_state_dict`` to save
    and restore can be passed by keyword (``ema=ema_model``)."""

    def __init__(self, **stateful: Any) -> None:
        self._extra = stateful
        self._trainer: Any = None
        self._started = False
        self._at_broadcast = False
        self.restored_step: int | None = None

    @property
    def state_key(self) -> str:
        return "JitCallback"

    # -- hooks ----------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self._trainer is not None:
            return
        self._trainer = trainer
        fit_loop = trainer.fit_loop
        for name in ("_load_combined_loader_states", "epoch_loop", "_combined_loader"):
            if not hasattr(fit_loop, name):
                raise RuntimeError(f"jitckpt JitCallback: this Lightning version's fit loop has no {name!r}; "
                                   "tested with Lightning 2.6")
        orig = fit_loop._load_combined_loader_states

        def load_combined_loader_states() -> None:
            if not self._started:
                self._started = True
                self._start(trainer)
            orig()

        fit_loop._load_combined_loader_states = load_combined_loader_states
        if api.get_checkpoint_path() is not None:
            # as after trainer.fit(ckpt_path=...): no sanity check, it would run before the restore
            trainer.num_sanity_val_steps = 0

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        # an evaluation forward through DDP looked like a minibatch start
        if self._started and not trainer.sanity_checking:
            _minibatch_boundary()

    # -- internals --------------------------------------------------------------

    def _start(self, trainer: Any) -> None:
        from lightning.fabric.utilities.data import sized_len

        fit_loop = trainer.fit_loop
        if trainer.reload_dataloaders_every_n_epochs:
            _warn("JitCallback: reload_dataloaders_every_n_epochs is not supported; the reloaded loaders' "
                  "position is not tracked")
        loaders = list(fit_loop._combined_loader.flattened)
        if any(sized_len(dl) is None for dl in loaders):
            _warn("JitCallback: a train loader without a length (IterableDataset): its mid-epoch position is "
                  "only restored if it is stateful (torchdata's StatefulDataLoader)")
        for opt in trainer.optimizers:
            _closure_first(opt)
        _give_sigterm_back(trainer)
        objects: dict[str, Any] = {"lightning_callbacks": _CallbackStates(trainer, self),
                                   "lightning_precision": trainer.precision_plugin}
        if trainer.datamodule is not None:
            objects["lightning_datamodule"] = trainer.datamodule
        clash = set(objects) & set(self._extra)
        if clash:
            raise TypeError(f"jitckpt JitCallback: names reserved for Lightning's objects: {clash}")
        state = _LiveLoops(self)
        _resumable(model=trainer.lightning_module, optimizer=list(trainer.optimizers),
                   scheduler=[c.scheduler for c in trainer.lr_scheduler_configs], dataloader=loaders,
                   state=state, **objects, **self._extra)
        if _KEY in state:
            self._restore(trainer, state[_KEY], loaders)
        el = fit_loop.epoch_loop
        broadcast = getattr(el, "_broadcast_sigterm_tensor", None)
        if broadcast is not None:
            def at_batch_start() -> None:
                _minibatch_boundary()
                self._at_broadcast = True
                try:
                    broadcast()
                finally:
                    self._at_broadcast = False

            el._broadcast_sigterm_tensor = at_batch_start

    def _capture(self) -> dict:
        tr = self._trainer
        from ..runtime import Phase

        # exact at the per-batch broadcast, or at a forward right after a step (no broadcast: one process)
        exact = self._at_broadcast or api._get_runtime().phase is not Phase.FWD
        sd = copy.deepcopy(tr.fit_loop.state_dict())
        return _canonical(sd, max(1, int(tr.accumulate_grad_batches)), tr.num_training_batches, exact)

    def _restore(self, trainer: Any, saved: dict, loaders: list) -> None:
        from lightning.fabric.utilities.data import _set_sampler_epoch
        from lightning.pytorch.loops import _Loop

        if not saved.get("exact", True):
            _warn("JitCallback: the JIT checkpoint was taken at a collective inside Lightning's epoch-end "
                  "processing; the loop counters are restored approximately")
        fit_loop = trainer.fit_loop
        fit_loop.load_state_dict(saved["loops"])
        if saved["kind"] == "epoch_start":
            # the previous epoch ended: start the next one as if never interrupted (the base setter:
            # FitLoop's own keeps "restarting" on with max_steps)
            _Loop.restarting.fset(fit_loop, False)
        # jitckpt restores the loaders' position: Lightning's "your dataloader is not resumable" does not apply
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        epoch = fit_loop.epoch_progress.current.processed
        for dl in loaders:  # before setup_data creates the iterator (Lightning sets it later)
            _set_sampler_epoch(dl, epoch)
        self.restored_step = api._get_runtime().steps_done


__all__ = ["JitCallback"]
