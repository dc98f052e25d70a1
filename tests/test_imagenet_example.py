"""pytorch/examples' imagenet/main.py (tests/imagenet_main.py: a faithful
reduced copy, its header says what was changed) with ``jitckpt.resumable``
added in four lines: ResNet-18 under DDP over gloo, 2 ranks, --dummy data at
64x64, StepLR stepping every epoch after validate(). Launched with the bare
``jitrun --nproc-per-node 2 main.py ...``, it must resume bit-identical to a
failure-free plain-torchrun run (every rank's model with its BatchNorm
statistics, optimizer and scheduler), with every process's exit code as
expected and at most one minibatch whose optimizer step ran twice, after:

* SIGKILL and SIGSTOP of rank 0 and of rank 1 in backward (mid-epoch: the
  peer saves after its forward updated the BatchNorm statistics);
* a kill in the first minibatch of the second epoch (after epoch 0's
  validate() and scheduler.step()).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from zoo_checks import Fault, check_recovered, check_reference_log, run_jitrun, shared_references

SCRIPT = Path(__file__).with_name("imagenet_main.py")
STEPS_PER_EPOCH, EPOCHS = 4, 2  # 32 fake training images, batch 4 per rank, 2 ranks
TOTAL = STEPS_PER_EPOCH * EPOCHS


def _args(out: Path) -> list[str]:
    return [str(SCRIPT), "--dummy", "--dist-url", "env://", "--dist-backend", "gloo", "--seed", "0",
            "-a", "resnet18", "-b", "4", "-j", "0", "--epochs", str(EPOCHS), "--lr", "0.01",
            "--image-size", "64", "--dummy-train-size", str(2 * 4 * STEPS_PER_EPOCH), "--dummy-val-size", "16",
            "--lr-step", "1", "-p", "100", "--out", str(out), "--step-log", f"{out}-steps"]


@pytest.fixture(scope="session")
def imagenet_reference(tmp_path_factory) -> Path:
    ref = shared_references(tmp_path_factory, "imagenet-reference")("imagenet", _args)
    check_reference_log(ref, TOTAL)
    return ref


def run_case(tmp: Path, ref: Path, fault: Fault) -> None:
    job = run_jitrun(tmp, _args(tmp / "final"), fault, timeout=400)
    check_recovered(job, ref, tmp / "final-steps", fault, TOTAL)
    # passed: ~0.5 GB of states and checkpoints (ResNet-18 with momentum) less in the session's temp dir
    shutil.rmtree(tmp / "jit")
    for p in [*tmp.glob("final.rank*.pt"), *tmp.glob("*.pth.tar")]:
        p.unlink()


def test_killed_in_first_minibatch_of_second_epoch(tmp_path, imagenet_reference):
    """After epoch 0's validate() and scheduler.step(): the checkpoint must hold
    epoch 1 with the scheduler of epoch 1 (not epoch 0's counters with it)."""
    run_case(tmp_path, imagenet_reference, Fault.runtime(1, "sigkill", "backward", STEPS_PER_EPOCH))


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", ["sigkill", "sigstop"])
def test_failed_in_backward(tmp_path, imagenet_reference, kind, rank):
    run_case(tmp_path, imagenet_reference, Fault.runtime(rank, kind, "backward", STEPS_PER_EPOCH + 1))
