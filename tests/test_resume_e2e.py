"""``jitckpt.resumable`` end to end: real DDP over gloo under jitrun, a rank
failing mid-epoch, the final model and optimizer state compared bit for bit
with a failure-free plain-torchrun run of the same script and arguments.

Scripts: the demo with ``--resumable`` (batches generated from the step, or
read through a shuffling DataLoader whose order comes from the global RNG, at
``num_workers`` 0 and 2; the model has dropout), and the pytorch/examples
ddp-tutorial-series script (scripts/examples/multigpu_torchrun.py: a
DistributedSampler, a probe ``next(iter(loader))`` at every epoch start).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import ROOT, Job, assert_same_state, run_reference, run_tree

DEMO = ROOT / "scripts" / "demo_train.py"
TUTORIAL = ROOT / "scripts" / "examples" / "multigpu_torchrun.py"
DEMO_STEPS = 16
DEMO_FAULT_STEP = 7  # epoch 1, minibatch 2 of 5 with --epoch-batches 5
TUTORIAL_FAULT_STEP = 40  # epoch 1, minibatch 8 of 32

MODES = {
    "generated": [],
    "loader-w0": ["--loader-workers", "0"],
    "loader-w2": ["--loader-workers", "2"],
}


def _script_cmd(script: str, out: Path, mode: str = "generated") -> list[str]:
    if script == "demo":
        return [str(DEMO), "--steps", str(DEMO_STEPS), "--resumable", *MODES[mode], "--out", str(out)]
    return [str(TUTORIAL), "2", "1", "--out", str(out)]  # 2 epochs, the tutorial's snapshot every epoch


@pytest.fixture(scope="session")
def reference_of(tmp_path_factory):
    """Failure-free plain-torchrun final state, once per (script, mode)."""
    cache: dict[tuple[str, str], Path] = {}

    def get(script: str, mode: str = "generated") -> Path:
        if (script, mode) not in cache:
            d = tmp_path_factory.mktemp(f"ref-{script}-{mode}")
            out = d / "final.pt"
            cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                *_script_cmd(script, out, mode)], cwd=d)
            assert cp.returncode == 0, cp.stdout[-3000:]
            cache[(script, mode)] = out
        return cache[(script, mode)]

    return get


def _jitrun(tmp: Path, script: str, fault: str, mode: str = "generated") -> Job:
    out, jit = tmp / "final.pt", tmp / "jit"
    # warm start (the default) also with DataLoader workers: a forked rank's
    # own processes must die with it (launcher/warm.py resets the start method)
    cmd = [sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
           "--jit-timeout", "3", "--jit-dir", str(jit), *_script_cmd(script, out, mode)]
    # cwd: the tutorial writes its own snapshot.pt there
    cp = run_tree(cmd, env={"JITCKPT_FAULT": fault}, timeout=300, cwd=tmp)
    return Job(cp.returncode, cp.stdout, jit, out)


def _check(job: Job, reference: Path, fault_step: int) -> None:
    assert job.returncode == 0, job.output[-5000:]
    assert job.of("fault_injected"), job.events()  # the fault did fire
    rec = job.of("recovery")
    assert len(rec) == 1, job.events()
    assert rec[0]["restore_step"] == fault_step and rec[0]["redone_minibatches"] <= 1, rec
    assert f"resumed from {job.jit_dir}" in job.output  # restored by resumable(), not a fresh start
    try:
        assert_same_state(reference, job.out)
    except AssertionError as e:  # the run's own account, to tell a wrong restore from a wrong redo
        raise AssertionError(f"{e}\n--- jitrun output ---\n{job.output[-6000:]}") from None


def test_demo_shuffled_loader_killed_quick(tmp_path, reference_of):
    """The quick cell: a killed rank mid-epoch with a shuffling DataLoader."""
    job = _jitrun(tmp_path, "demo", f"rank=1,step={DEMO_FAULT_STEP},phase=backward,kind=sigkill", "loader-w0")
    _check(job, reference_of("demo", "loader-w0"), DEMO_FAULT_STEP)


def test_tutorial_killed_quick(tmp_path, reference_of):
    job = _jitrun(tmp_path, "tutorial", f"rank=1,step={TUTORIAL_FAULT_STEP},phase=forward,kind=sigkill")
    _check(job, reference_of("tutorial"), TUTORIAL_FAULT_STEP)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sigkill", "sigstop", "exception"])
@pytest.mark.parametrize("mode", list(MODES))
def test_demo_resumes_exactly(tmp_path, reference_of, mode, kind):
    # rank 0 fails in one half of the cells: the store-hosting rank is no special case
    rank = 0 if kind == "sigstop" else 1
    job = _jitrun(tmp_path, "demo", f"rank={rank},step={DEMO_FAULT_STEP},phase=forward,kind={kind}", mode)
    _check(job, reference_of("demo", mode), DEMO_FAULT_STEP)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sigstop", "exception"])
def test_tutorial_resumes_exactly(tmp_path, reference_of, kind):
    job = _jitrun(tmp_path, "tutorial", f"rank=1,step={TUTORIAL_FAULT_STEP},phase=backward,kind={kind}")
    _check(job, reference_of("tutorial"), TUTORIAL_FAULT_STEP)
