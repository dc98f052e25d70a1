"""Hugging Face Accelerate: ``jitckpt.resumable`` for what an Accelerator prepared.

    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    state = jitckpt.integrations.accelerate.resumable(accelerator, state={"epoch": 0})

Everything ``accelerator.prepare`` returned (models, optimizers, schedulers,
data loaders), the GradScaler and objects given to
``accelerator.register_for_checkpointing`` are saved at the JIT consistent
point and restored after a restart, the loaders mid-epoch (their one-batch
look-ahead and epoch counter accounted for). Launch with jitrun as usual.
"""

from __future__ import annotations

from typing import Any

from ..resume import resumable as _resumable


def resumable(accelerator: Any, *, state: dict | None = None, shard: str | int | None = None,
              **stateful: Any) -> dict:
    """Call after ``accelerator.prepare(...)`` and before the training loop;
    see ``jitckpt.resumable`` for ``state``, ``shard`` and extra objects."""
    objects: dict[str, Any] = {}
    for kind, objs in (("model", accelerator._models), ("optimizer", accelerator._optimizers),
                       ("scheduler", accelerator._schedulers),
                       ("custom", getattr(accelerator, "_custom_objects", []))):
        for i, obj in enumerate(objs):
            objects[f"accelerate_{kind}_{i}"] = obj
    if getattr(accelerator, "scaler", None) is not None:
        objects["accelerate_scaler"] = accelerator.scaler
    clash = set(objects) & set(stateful)
    if clash:
        raise TypeError(f"jitckpt accelerate.resumable: names reserved for the accelerator's objects: {clash}")
    return _resumable(dataloader=list(accelerator._dataloaders), state=state, shard=shard, **objects, **stateful)
