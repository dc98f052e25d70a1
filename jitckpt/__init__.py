"""jitckpt: just-in-time checkpointing for PyTorch distributed training.

Public API: ``register(save_fn, *, shard=None)``, ``get_checkpoint_path()`` and,
inside save_fn, ``checkpoint_step()``.
Launch with ``jitrun`` (a drop-in for ``torchrun``).
"""

from .api import checkpoint_step, get_checkpoint_path, register
from .config import EXIT_NOT_SAVED, EXIT_SAVED

__all__ = ["register", "get_checkpoint_path", "checkpoint_step", "EXIT_SAVED", "EXIT_NOT_SAVED"]
