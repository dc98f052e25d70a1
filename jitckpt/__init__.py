"""jitckpt: just-in-time checkpointing for PyTorch distributed training.

Public API: ``resumable(model=..., optimizer=..., ...)`` (one call, no save_fn),
or for full control ``register(save_fn, *, shard=None)``, ``get_checkpoint_path()``
and, inside save_fn, ``checkpoint_step()``. ``with expect_delay(seconds=...)``
marks a rank that is slow on purpose (hang detection, README "Hangs").
Launch with ``jitrun`` (a drop-in for ``torchrun``).
"""

from .api import checkpoint_step, expect_delay, get_checkpoint_path, register
from .wire.config import EXIT_NOT_SAVED, EXIT_SAVED

__all__ = ["resumable", "register", "get_checkpoint_path", "checkpoint_step", "expect_delay", "EXIT_SAVED",
           "EXIT_NOT_SAVED"]


def __getattr__(name: str):
    # resume imports torch at module level; jitrun imports this package too and
    # must not pay torch's import time, so ``resumable`` is loaded on first use.
    if name == "resumable":
        from .resume import resumable

        return resumable
    raise AttributeError(f"module 'jitckpt' has no attribute {name!r}")
