"""jitckpt: just-in-time checkpointing for PyTorch distributed training.

Public API: ``register(save_fn, *, shard=None)`` and ``get_checkpoint_path()``.
Launch with ``jitrun`` (a drop-in for ``torchrun``).
"""

from .api import get_checkpoint_path, register
from .config import EXIT_NOT_SAVED, EXIT_SAVED

__all__ = ["register", "get_checkpoint_path", "EXIT_SAVED", "EXIT_NOT_SAVED"]
