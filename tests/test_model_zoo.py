"""The model zoo under failures: small real models (tests/zoo_train.py: a
ResNet with BatchNorm, the same with ``broadcast_buffers=False``, an LSTM
language model with dropout, a transformer with dropout and an EMA copy,
gradient accumulation with ``no_sync``, a ``torch.compile``'d model), each
trained in epochs with train / validate / ``scheduler.step()``, launched with
the bare ``jitrun --nproc-per-node 2 train.py`` and failed on rank 0 or rank 1
by SIGKILL, SIGSTOP or an exception:

* ``forward`` / ``backward``: mid-epoch (epoch 1, its second / third minibatch);
* ``first``: in the backward of the first minibatch of an epoch (epoch 1, after
  epoch 0's validation and ``scheduler.step()``);
* ``last``: in the forward of the last minibatch of an epoch (epoch 1);
* ``validate``: inside epoch 1's validation, after its first forward;
* ``between``: between epochs 1 and 2 (after ``scheduler.step()``).

The first four are the runtime's JITCKPT_FAULT phases, the last two the
script's own ZOO_FAULT. Every run must end with every rank's final state (model
with its buffers, optimizer, scheduler, EMA) bit-identical to a failure-free
plain-torchrun run of the same script, every process's exit code as expected,
and at most one minibatch whose optimizer step ran twice (tests/zoo_checks.py).
One case has BatchNorm running statistics no replica holds (docs/recovery.md,
"Buffers that are not replicas"): under ``broadcast_buffers=False`` the failed
rank's own. There the failed rank's statistics are not compared, the run must
say so, and everything else stays bit for bit. (A forward fault fires inside the
training forward, after DDP's buffer broadcast: rank 0 failing there is exact.)
``first`` uses the backward phase and ``last`` the forward one: a forward fault
at step 4 could also fire in epoch 0's validation (4 steps done there too).

The whole matrix (models x points x kinds x failing rank, 216 cells, about an hour
on 2 cores) runs with ``make test-zoo``; ``make test`` runs a cover of it (every
model at two points, every point with two models, kinds and ranks rotating: 12 cells, slow),
and a few cells outside the marker cover each kind of point for ``make test-fast``.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from zoo_checks import (
    EXACT,
    Fault,
    Statistics,
    check_recovered,
    check_reference_log,
    run_jitrun,
    shared_references,
)

SCRIPT = Path(__file__).with_name("zoo_train.py")
MODELS = ("resnet", "resnet-nobb", "lstm", "transformer", "accum", "compiled")
STEPS_PER_EPOCH, EPOCHS = 4, 3  # zoo_train.py's, with 2 ranks
TOTAL = STEPS_PER_EPOCH * EPOCHS
FAULT_EPOCH = 1
POINTS = ("forward", "backward", "first", "last", "validate", "between")
KINDS = ("sigkill", "sigstop", "exception")


BASE = FAULT_EPOCH * STEPS_PER_EPOCH
PHASE_STEP = {"forward": ("forward", BASE + 1), "backward": ("backward", BASE + 2),
              "first": ("backward", BASE), "last": ("forward", BASE + STEPS_PER_EPOCH - 1)}


def fault_at(point: str, kind: str, rank: int) -> Fault:
    if point in PHASE_STEP:
        return Fault.runtime(rank, kind, *PHASE_STEP[point])
    # the survivor's save describes the state after the epoch's last optimizer step
    return Fault(rank, kind, "ZOO_FAULT", f"rank={rank},where={point},epoch={FAULT_EPOCH},kind={kind}",
                 BASE + STEPS_PER_EPOCH, f"[zoo] rank {rank}: injected {kind} where={point} epoch={FAULT_EPOCH}")


def _args(model: str, out: Path) -> list[str]:
    return [str(SCRIPT), "--model", model, "--epochs", str(EPOCHS), "--out", str(out), "--step-log", f"{out}-steps"]


@pytest.fixture(scope="session")
def zoo_reference(tmp_path_factory):
    """A failure-free plain-torchrun run per model, shared by the whole test run."""
    get = shared_references(tmp_path_factory, "zoo-reference")

    def of(model: str) -> Path:
        ref = get(model, lambda out: _args(model, out))
        check_reference_log(ref, TOTAL)
        return ref

    return of


def statistics_of(model: str, point: str, rank: int) -> Statistics:
    """What the restore can give back of the BatchNorm running statistics
    (docs/recovery.md, "Buffers that are not replicas")."""
    if model == "resnet-nobb":  # each rank's own: the failed rank's died with it
        return Statistics(frozenset({rank}), "[jitckpt] DDP model with broadcast_buffers=False")
    # a forward fault fires inside the training forward, after DDP's buffer broadcast: every survivor
    # captured rank 0's statistics, so even rank 0 failing there restores them exactly
    return EXACT


def run_cell(tmp: Path, ref_of, model: str, point: str, kind: str, rank: int) -> None:
    fault = fault_at(point, kind, rank)
    job = run_jitrun(tmp, _args(model, tmp / "final"), fault)
    check_recovered(job, ref_of(model), tmp / "final-steps", fault, TOTAL, statistics_of(model, point, rank))


# outside the slow marker: every kind of point, both ranks, all three kinds, BN models foremost
QUICK = [
    ("resnet", "first", "sigkill", 1),  # the epoch boundary: counters and scheduler of one minibatch start
    ("resnet", "backward", "sigstop", 0),  # BatchNorm statistics updated by the interrupted forward
    ("accum", "validate", "sigkill", 1),
    ("transformer", "between", "exception", 0),
    ("compiled", "forward", "sigkill", 1),
]


@pytest.mark.parametrize("model,point,kind,rank", QUICK)
def test_zoo_quick(tmp_path, zoo_reference, model, point, kind, rank):
    run_cell(tmp_path, zoo_reference, model, point, kind, rank)


def _cover() -> list[tuple[str, str, str, int]]:
    """Twelve cells, what ``make test`` runs beside QUICK: every model at two points and every
    point with two models, the two with different fault kinds and different failing ranks, and
    each (kind, rank) pair twice (the whole product, 216 cells: ``make test-zoo``)."""
    pairs = list(itertools.product(KINDS, (0, 1)))
    return [(MODELS[i % 6], POINTS[(i + 3 * (i // 6)) % 6], *pairs[(2 * i + i // 6 + 1) % 6]) for i in range(12)]


FULL = os.environ.get("JITCKPT_ZOO_FULL") == "1"  # make test-zoo: the whole product, 216 cells
MATRIX = [c for c in (itertools.product(MODELS, POINTS, KINDS, (0, 1)) if FULL else _cover()) if c not in QUICK]


@pytest.mark.slow
@pytest.mark.parametrize("model,point,kind,rank", MATRIX)
def test_zoo_matrix(tmp_path, zoo_reference, model, point, kind, rank):
    run_cell(tmp_path, zoo_reference, model, point, kind, rank)
