"""The models and optimizers of this process, in the order they were made.

The runtime learns them without the user's help: every DDP model (hooks.py
wraps ``DistributedDataParallel.__init__``), every ``torch.optim.Optimizer``
(its ``__init__`` is wrapped at install time) and what ``jitckpt.resumable``
is handed (an FSDP2 model has no DDP wrapper). Weak references only: tracking
never keeps a model alive. The state fingerprint (verify/fingerprint.py) walks them
in this order, the same on every replica.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

_models: list[weakref.ref] = []
_optimizers: list[weakref.ref] = []


def _add(refs: list[weakref.ref], obj: Any) -> None:
    if any(r() is obj for r in refs):
        return
    refs.append(weakref.ref(obj))


def add_model(model: Any) -> None:
    _add(_models, model)


def add_optimizer(opt: Any) -> None:
    _add(_optimizers, opt)


def models() -> list[Any]:
    return [m for m in (r() for r in _models) if m is not None]


def optimizers() -> list[Any]:
    """The live optimizers, less the ones a ZeroRedundancyOptimizer runs on its own
    partition (``.optim``): that state is this rank's alone."""
    opts = [o for o in (r() for r in _optimizers) if o is not None]
    inner = {id(o.optim) for o in opts if is_sharded(o) and getattr(o, "optim", None) is not None}
    return [o for o in opts if id(o) not in inner]


def is_sharded(opt: Any) -> bool:
    """A ZeroRedundancyOptimizer: every rank holds the optimizer state of its own partition
    of the parameters only, so that state is no replica of anything (its parameters and
    hyperparameters are)."""
    return any(c.__name__ == "ZeroRedundancyOptimizer" for c in type(opt).__mro__)


def track_optimizers() -> None:
    """Wrap ``Optimizer.__init__`` (subclasses call it through ``super()``) once."""
    from torch.optim import Optimizer

    from .torch_compat import patch

    def make(orig):
        @functools.wraps(orig)
        def init(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            add_optimizer(self)

        return init

    patch(Optimizer, "__init__", make)


def _reset_for_tests() -> None:
    _models.clear()
    _optimizers.clear()
