"""Hugging Face Accelerate: ``jitckpt.resumable`` for what an Accelerator prepared.

    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    state = jitckpt.integrations.accelerate.resumable(accelerator, state={"epoch": 0})

Everything ``accelerator.prepare`` returned (models, optimizers, schedulers,
data loaders), the GradScaler and objects given to
``accelerator.register_for_checkpointing`` are saved at the JIT consistent
point and restored after a restart, the loaders mid-epoch (their one-batch
look-ahead and epoch counter accounted for). Launch with jitrun as usual.

What the accelerator never saw cannot be saved: a scheduler created after ``prepare`` and
not given to it (pass it here: ``resumable(accelerator, scheduler=sched)``), or objects
prepared or registered after this call. Under jitrun the job is refused at its first
minibatch, in one line, rather than resumed with them silently reset.
"""

from __future__ import annotations

from typing import Any

from .. import api
from ..listeners import Event
from ..refusal import refuse
from ..resume import resumable as _resumable
from ._hosts import TRAINER_HINT, inside_trainer_train

_KINDS = (("model", "_models"), ("optimizer", "_optimizers"), ("scheduler", "_schedulers"),
          ("custom", "_custom_objects"))


def _lists(accelerator: Any) -> dict[str, list]:
    return {kind: list(getattr(accelerator, attr, [])) for kind, attr in _KINDS}


def _bare(opt: Any) -> Any:
    # AcceleratedOptimizer wraps the torch optimizer a scheduler was built on
    return getattr(opt, "optimizer", opt)


def _unseen(accelerator: Any, known: dict[str, list], given: list) -> str | None:
    """What the accelerator holds now that the save leaves out, in one sentence, or None."""
    now = _lists(accelerator)
    late = [f"{len(now[k]) - len(known[k])} {k}(s)" for k in now if len(now[k]) > len(known[k])]
    if late:
        return (f"{', '.join(late)} prepared or registered with the accelerator after "
                "jitckpt.integrations.accelerate.resumable would not be saved; call resumable after the last "
                "accelerator.prepare / register_for_checkpointing")
    driven = set()
    for s in now["scheduler"] + now["custom"] + given:
        for o in getattr(s, "optimizers", None) or [getattr(s, "optimizer", None)]:
            if o is not None:
                driven.add(id(_bare(o)))
    for i, opt in enumerate(now["optimizer"]):
        groups = getattr(_bare(opt), "param_groups", [])
        # an LR scheduler's constructor sets initial_lr in every group of its optimizer
        if any("initial_lr" in g for g in groups) and id(_bare(opt)) not in driven:
            return (f"optimizer {i} has an LR scheduler the accelerator never saw (created after "
                    "accelerator.prepare and not given to it), which would restart from its first step; pass it: "
                    "jitckpt.integrations.accelerate.resumable(accelerator, scheduler=sched)")
    return None


def resumable(accelerator: Any, *, state: dict | None = None, shard: str | int | None = None,
              **stateful: Any) -> dict:
    """Call after ``accelerator.prepare(...)`` and before the training loop;
    see ``jitckpt.resumable`` for ``state``, ``shard`` and extra objects."""
    rt = api._get_runtime()
    if rt.cfg.managed and inside_trainer_train():
        refuse("jitckpt.integrations.accelerate.resumable cannot restore a transformers Trainer's step counters, "
               f"epoch, log history and LR scheduler (Trainer creates it after accelerator.prepare); {TRAINER_HINT}")
    known = _lists(accelerator)
    objects: dict[str, Any] = {}
    for kind, objs in known.items():
        for i, obj in enumerate(objs):
            objects[f"accelerate_{kind}_{i}"] = obj
    if getattr(accelerator, "scaler", None) is not None:
        objects["accelerate_scaler"] = accelerator.scaler
    clash = set(objects) & set(stateful)
    if clash:
        raise TypeError(f"jitckpt accelerate.resumable: names reserved for the accelerator's objects: {clash}")
    out = _resumable(dataloader=list(accelerator._dataloaders), state=state, shard=shard, **objects, **stateful)
    if rt.cfg.managed:
        _check_at_first_minibatch(rt, accelerator, known, list(stateful.values()))
    return out


def _check_at_first_minibatch(rt: Any, accelerator: Any, known: dict[str, list], given: list) -> None:
    """Once, where the loop has created everything it will (a scheduler may be made after this
    call): refuse the job if the save would leave something out."""
    def first(provisional: bool = False) -> None:
        rt.listeners.remove(Event.MINIBATCH_START, first)
        why = _unseen(accelerator, known, given)
        if why is not None:
            refuse(f"jitckpt accelerate.resumable: {why}")

    rt.listeners.add(Event.MINIBATCH_START, first, first=True)  # before resume's snapshot
