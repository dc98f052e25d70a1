"""jitckpt's Accelerate adapter says what it cannot save (one process, no jitrun): a scheduler
built after ``accelerator.prepare`` and never given to it (what Trainer does), and objects
prepared or registered after ``resumable``; nothing to say when it sees everything."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402

from jitckpt.integrations import accelerate as ja  # noqa: E402


def _prepared() -> tuple[Accelerator, torch.optim.Optimizer]:
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    _model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc, opt


def test_everything_seen():
    acc, opt = _prepared()
    known = ja._lists(acc)
    assert ja._unseen(acc, known, []) is None
    acc.prepare(torch.optim.lr_scheduler.StepLR(opt, 2))  # prepared, and seen as such
    assert ja._unseen(acc, ja._lists(acc), []) is None
    assert ja._unseen(acc, known, [])  # but not if it came after the call


def test_scheduler_after_prepare_is_named():
    acc, opt = _prepared()
    known = ja._lists(acc)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # as Trainer's create_scheduler does
    why = ja._unseen(acc, known, [])
    assert why is not None and "optimizer 0 has an LR scheduler" in why and "\n" not in why
    assert ja._unseen(acc, known, [sched]) is None  # resumable(accelerator, scheduler=sched)


def test_registered_after_the_call_is_named():
    acc, _opt = _prepared()
    known = ja._lists(acc)

    class Counter:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, sd: dict) -> None:
            pass

    acc.register_for_checkpointing(Counter())
    why = ja._unseen(acc, known, [])
    assert why is not None and "1 custom(s)" in why
