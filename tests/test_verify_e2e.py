"""Replicas that prove themselves, end to end (jitckpt/verify/verifier.py): real DDP over gloo under
jitrun, three data-parallel ranks (two where said), compared bit for bit with a failure-free
plain-torchrun run.

* a bit flipped in the state of one rank right after an optimizer step is caught at the next
  check, every rank rolls back to the last verified state (at most N minibatches redone) and the
  odd rank is named; with N = 1 it is repaired in place from the majority, nothing redone;
* a restore that hands one rank another (valid, older) replica under the chosen step's label is
  refused before any training step;
* replicas that legitimately differ are reported once and checking turns off.
"""

from __future__ import annotations

import sys

import pytest
from conftest import TRAIN, assert_same_state, jitrun, run_reference

STEPS = 60
FLIP_STEP = 43


def _job_ok(job) -> None:
    assert job.returncode == 0, job.output[-6000:]


@pytest.mark.parametrize("target", ["param", "optim"])
def test_bitflip_is_rolled_back_to_the_last_verified_state(tmp_path, reference, target):
    job = jitrun(tmp_path, nproc=3, steps=STEPS, extra=["--jit-verify-every", "10"],
                 fault=f"rank=2,step={FLIP_STEP},kind=bitflip,target={target}")
    _job_ok(job)
    assert_same_state(reference(3, STEPS), job.out)
    mismatch = job.of("state_mismatch")
    assert len(mismatch) == 1 and mismatch[0]["at_step"] == 50, mismatch  # the first check after the flip
    assert mismatch[0]["suspects"] == [2] and mismatch[0]["verified_step"] == 40, mismatch
    assert [e["rank"] for e in job.of("sdc_suspect")] == [2]
    # an optimizer-state flip has changed rank 2's parameter by the next step: it comes first in the order
    assert job.of("sdc_suspect")[0]["tensor"] == "m0.module.pos", job.of("sdc_suspect")
    (rec,) = job.of("recovery")
    assert rec["restore_step"] == 40 and rec["redone_minibatches"] == 10, rec
    assert {e["step"] for e in job.of("checkpoint_saved")} == {40}
    reasons = {(e["rank"], e["reason"]) for e in job.of("failure_detected")}
    assert {(0, "state_mismatch"), (1, "state_mismatch"), (2, "sdc_suspect")} <= reasons, reasons


def test_bitflip_with_two_replicas_rolls_back_and_names_no_one(tmp_path, reference):
    job = jitrun(tmp_path, nproc=2, steps=STEPS, extra=["--jit-verify-every", "10"],
                 fault=f"rank=1,step={FLIP_STEP},kind=bitflip")
    _job_ok(job)
    assert_same_state(reference(2, STEPS), job.out)
    (mismatch,) = job.of("state_mismatch")
    assert mismatch["at_step"] == 50 and mismatch["suspects"] == [], mismatch
    assert job.of("sdc_suspect") == []
    (rec,) = job.of("recovery")
    assert rec["restore_step"] == 40 and rec["redone_minibatches"] == 10, rec


def test_bitflip_checked_every_step_is_repaired_in_place(tmp_path, reference):
    steps = 50
    job = jitrun(tmp_path, nproc=3, steps=steps, extra=["--jit-verify-every", "1"],
                 fault=f"rank=2,step={FLIP_STEP},kind=bitflip")
    _job_ok(job)
    assert_same_state(reference(3, steps), job.out)
    repaired = job.of("state_repaired")
    assert len(repaired) == 3, repaired  # every rank says it once
    assert all(e["step"] == FLIP_STEP + 1 and e["suspects"] == [2] for e in repaired), repaired
    assert all(len(e["tensors"]) == 1 for e in repaired), repaired  # only the flipped tensor travelled
    assert [e["rank"] for e in job.of("sdc_suspect")] == [2]
    assert not job.of("restart") and not job.of("recovery") and not job.of("checkpoint_saved")


def test_a_swapped_replica_is_refused_before_any_step(tmp_path):
    """Rank 1's restore loads the replica of an older step while claiming the chosen one: the
    step check cannot see it, the state check refuses it, and the job is not restarted."""
    fault = ("rank=1,step=4,phase=backward,kind=sigkill;rank=1,step=10,phase=backward,kind=sigkill,attempt=1;"
             "rank=1,phase=restore,kind=swap,attempt=2")
    job = jitrun(tmp_path, nproc=3, steps=16, fault=fault)
    assert job.returncode != 0, job.output[-4000:]
    assert "REFUSING TO TRAIN" in job.output and "restored different states" in job.output, job.output[-4000:]
    mismatch = job.of("state_mismatch")
    assert mismatch and "first differing tensor" in mismatch[0]["error"], mismatch
    groups = mismatch[0]["mismatch"][0]["groups"]
    assert sorted(map(sorted, groups.values())) == [[0, 2], [1]], groups
    assert job.of("job_abort"), job.events()
    # the first failure's recovery; the second one's would be written when the third start trained
    assert len(job.of("recovery")) == 1
    assert not job.of("state_divergence")  # every rank claimed the same step
    exits = {e["rank"]: e["exitcode"] for e in job.of("worker_exit")
             if e["t"] >= job.of("restart")[-1]["t"]}
    assert exits == {0: 77, 1: 77, 2: 77}, exits


def test_replicas_that_legitimately_differ_turn_checking_off(tmp_path):
    steps = 30
    ref = tmp_path / "ref.pt"
    cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        str(TRAIN), "--steps", str(steps), "--out", str(ref), "--rank-drift"])
    assert cp.returncode == 0, cp.stdout[-3000:]
    job = jitrun(tmp_path, nproc=3, steps=steps, extra=["--jit-verify-every", "5"], train_args=["--rank-drift"])
    _job_ok(job)
    assert_same_state(ref, job.out)
    off = job.of("verify_off")
    assert len(off) == 1 and off[0]["step"] == 5, off
    assert job.output.count("replica state checks turned off for this job") == 3  # one line per rank
    assert not job.of("state_mismatch") and not job.of("restart")
