"""Failures at the end of a job (issue: every failure at every point recovers
with at most one minibatch lost). Real DDP over gloo under jitrun, compared bit
for bit with a failure-free plain-torchrun run."""

from __future__ import annotations

import pytest
from conftest import assert_same_state, jitrun

STEPS = 16
LAST = STEPS - 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sigstop", "sigkill", "exit"])
def test_failure_in_last_optimizer_step_keeps_the_finished_result(tmp_path, reference, kind):
    """Rank 1 fails in the optimizer step of the last minibatch while rank 0
    finishes the job: the job ends with rank 0's (complete) result; it neither
    hangs (no collective is left to time out a stopped rank) nor restarts from
    scratch."""
    job = jitrun(tmp_path, steps=STEPS, fault=f"rank=1,step={LAST},phase=optimizer,kind={kind}")
    assert job.returncode == 0, job.output[-4000:]
    assert_same_state(reference(2, STEPS), job.out)
    assert job.of("finished_despite_failure"), job.events()
    assert not job.of("restart"), "nothing to redo: the finished replica's result stands"


@pytest.mark.slow
def test_barrier_after_the_loop_is_saved_with_a_true_label(tmp_path, reference):
    """A collective after the training loop: the save taken there describes
    the state after the last step; the demo labels it with checkpoint_step(),
    so the restart resumes after the loop instead of redoing the last
    minibatch on updated weights."""
    job = jitrun(tmp_path, steps=STEPS, fault=f"rank=1,step={LAST},phase=optimizer,kind=sigkill",
                 train_args=["--final-barrier"])
    assert job.returncode == 0, job.output[-4000:]
    assert_same_state(reference(2, STEPS), job.out)
    saved = job.of("checkpoint_saved")
    # rank 0 reached the barrier, its peer died: saved there, labelled after the loop
    assert {e["step"] for e in saved} == {STEPS}, job.events()
    assert "step label unverified" not in job.output
    assert f"at step {STEPS}" in job.output  # both ranks resumed after the loop
