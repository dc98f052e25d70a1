"""Module buffers as of the minibatch start, so a JIT save can rewind them.

Parameters and optimizer state are only written by the optimizer step, so at
a failure in forward or backward they still are the minibatch start's. Buffers
are not: a training forward writes BatchNorm's running statistics and
``num_batches_tracked`` (and any buffer a module updates in place), so a save
taken after that forward would hold them one update ahead, and the redone
minibatch would apply the update twice.

Each model gets a mirror: one preallocated tensor per buffer, filled by one
fused copy at the minibatch start. For a DDP model the copy runs in a forward
pre-hook of the wrapped module, i.e. after DDP's buffer broadcast, so every
replica holds rank 0's values and captures the same bytes. The JIT save copies
the mirror back into the live buffers before save_fn runs (the process ends
after the save, so nothing trains on the rewound buffers).

What a mirror cannot see: a buffer a forward *replaces* (``self.buf = t``)
instead of updating in place (the save then keeps that buffer's live value
and says so), and Python state a forward changes (a counter on the module).

Threads: capture runs on the main thread (forward pre-hooks); rewind runs on
whichever thread owns the JIT save (runtime.py), when the main thread is
parked or is that thread: never concurrently with a capture.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where used: the runtime is imported before torch is needed
    import torch

_mirrors: list[Mirror] = []


class Mirror:
    """The buffers of one module as of the last capture."""

    def __init__(self, module: Any, synced_by: Any = None) -> None:
        self._module = weakref.ref(module)
        # the DDP wrapper whose broadcast makes these buffers replicas (None: not DDP)
        self._ddp = weakref.ref(synced_by) if synced_by is not None else None
        self.live: list[torch.Tensor] = []
        self.names: list[str] = []
        self.copy: list[torch.Tensor] = []
        self.captured_at: int | None = None  # optimizer steps done at the capture
        self._refresh(module)

    def _refresh(self, module: Any) -> None:
        named = [(n, b) for n, b in module.named_buffers() if b is not None]
        self.names = [n for n, _ in named]
        self.live = [b for _, b in named]
        import torch

        from .torch_compat.worker import foreach_copy

        # looked up once: capture runs at every minibatch start
        self._torch, self._copy_ = torch, foreach_copy()
        with torch.no_grad():
            self.copy = [torch.empty_like(b) for b in self.live]

    @property
    def module(self) -> Any:
        return self._module()

    def replicated(self) -> bool:
        """Buffers that DDP makes equal on every replica at each training forward."""
        ddp = self._ddp() if self._ddp is not None else None
        return ddp is not None and bool(getattr(ddp, "broadcast_buffers", False)) and bool(self.live)

    def capture(self, step: int) -> None:
        if not self.live:
            self.captured_at = step
            return
        with self._torch.no_grad():
            # one fused copy into memory allocated once: nothing allocated per step
            self._copy_(self.copy, self.live)
        self.captured_at = step

    def rewind(self, step: int) -> list[str]:
        """Put the captured values back if they are of minibatch ``step``'s start. Returns the
        names of the buffers left live (all of them when the capture is older)."""
        module = self.module
        if module is None or not self.live:
            return []
        if self.captured_at != step:
            return list(self.names)
        current = dict(module.named_buffers())
        left: list[str] = []
        import torch

        with torch.no_grad():
            for name, live, saved in zip(self.names, self.live, self.copy, strict=True):
                if current.get(name) is live:
                    live.copy_(saved)
                else:
                    left.append(name)  # replaced by a forward: only its live value exists
        return left

    def values(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the captured buffers (the live ones before the first capture)."""
        return list(zip(self.names, self.copy if self.captured_at is not None else self.live, strict=True))


def add(module: Any, synced_by: Any = None) -> Mirror:
    for m in _mirrors:
        if m.module is module:
            return m
    mirror = Mirror(module, synced_by)
    _mirrors.append(mirror)
    return mirror


def mirrors() -> list[Mirror]:
    return [m for m in _mirrors if m.module is not None]


def for_model(model: Any) -> Mirror | None:
    """The mirror of ``model`` (a DDP wrapper: of its wrapped module)."""
    inner = getattr(model, "module", model) if hasattr(model, "reducer") else model
    return next((m for m in mirrors() if m.module is inner), None)


def capture_due(step: int) -> None:
    for m in mirrors():
        if m.captured_at != step:
            m.capture(step)


def rewind_all(step: int, rank: int) -> dict[str, Any]:
    """Before a JIT save of minibatch ``step``'s start: every mirror's buffers put back.
    Returns what the checkpoint's manifest records about them."""
    left: list[str] = []
    replicated_left = False
    for m in mirrors():
        names = m.rewind(step)
        left += names
        replicated_left = replicated_left or (bool(names) and m.replicated())
    if replicated_left:
        print(f"[jitckpt] rank {rank}: WARNING: this JIT checkpoint holds rank {rank}'s own module buffers "
              f"(e.g. BatchNorm statistics), not the replicas' common ones: the failure came before DDP's "
              f"buffer broadcast of minibatch {step}. Weights and optimizer state are exact; those buffers "
              "may differ from a run without the failure.", file=sys.stderr, flush=True)
    return {"buffers": "live" if left else "minibatch-start", "buffers_live": left[:20]}


def announce_unsynced(ddp: Any, rank: int) -> None:
    """Once per DDP model with broadcast_buffers=False and buffers: what a restore gives."""
    if bool(getattr(ddp, "broadcast_buffers", True)) or not any(True for _ in ddp.module.buffers()):
        return
    if rank == 0:
        print("[jitckpt] DDP model with broadcast_buffers=False: its buffers (e.g. BatchNorm statistics) "
              "differ per rank by design and are left out of the replica checks; a JIT restore gives every "
              "rank the buffers of the one replica it loads (the saving rank's), so after a restart they are "
              "not bit-identical to a run without the failure. Weights and optimizer state are.",
              file=sys.stderr, flush=True)


def _reset_for_tests() -> None:
    _mirrors.clear()
