"""Whether ``resumable`` is being called from inside a training loop it cannot restore.

Hugging Face's ``Trainer.train`` computes the epoch, the batches to skip and its step counters
before any callback runs, and keeps them (and ``log_history``) in a ``TrainerState`` that has
no ``state_dict``: a ``resumable`` called from a callback restores the model and the data
position but not these, so the resumed run trains the wrong number of steps and logs the
wrong epoch. No transformers import: only a Trainer already imported can be running."""

from __future__ import annotations

import sys

TRAINER_HINT = ("use Trainer(..., callbacks=[jitckpt.integrations.transformers.JitCallback()]) instead, which "
                "restores the Trainer's own state")


def inside_trainer_train() -> bool:
    """A ``transformers.Trainer`` training loop is on this thread's stack."""
    mod = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(mod, "Trainer", None) if mod is not None else None
    if trainer_cls is None:
        return False
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_inner_training_loop" and isinstance(f.f_locals.get("self"), trainer_cls):
            return True
        f = f.f_back
    return False
