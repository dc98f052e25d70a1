"""End-to-end recovery on real torch DDP over gloo, under jitrun.

Every run is compared bit for bit with a failure-free plain-torchrun run.
"""

from __future__ import annotations

import sys

import pytest
from conftest import assert_same_state, jitrun

STEPS = 16
FAULT_STEP = 6
KINDS = ["sigkill", "sigstop", "exception", "hang", "exit"]
PHASES = ["forward", "backward", "allreduce", "optimizer"]


def _check_recovered(job, reference, nproc: int, failing: int, kind: str, phase: str) -> None:
    assert job.returncode == 0, job.output[-5000:]
    assert_same_state(reference(nproc, STEPS), job.out)
    rec = job.of("recovery")
    assert len(rec) == 1, job.events()
    assert rec[0]["redone_minibatches"] <= 1, rec
    # During the optimizer step the replicas run on to the start of the next
    # minibatch. A rank failing while its all-reduce is in flight may or may not
    # have delivered its share: the peers then save minibatch i or i+1.
    expected = {"optimizer": {FAULT_STEP + 1}, "allreduce": {FAULT_STEP, FAULT_STEP + 1}}.get(phase, {FAULT_STEP})
    assert rec[0]["restore_step"] in expected, rec
    saved = job.of("checkpoint_saved")
    assert saved and all(e["rank"] != failing for e in saved), saved
    assert {e["step"] for e in saved} <= expected
    if kind in ("sigstop", "hang"):
        killed = job.of("ranks_killed")
        assert killed and failing in killed[0]["ranks"], job.events()
        # killed as soon as a shard-complete checkpoint exists, not after a grace period
        assert killed[0]["t"] - min(e["t"] for e in saved) < 2.0


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nproc", [3])  # 2 ranks: tests/test_fault_matrix.py, on a script of its own
def test_fault_matrix(tmp_path, reference, nproc, kind, phase):
    failing = 1 if nproc == 2 else 0  # covers the store-hosting-node's rank 0 failing too
    job = jitrun(tmp_path, nproc=nproc, steps=STEPS,
                 fault=f"rank={failing},step={FAULT_STEP},phase={phase},kind={kind}")
    _check_recovered(job, reference, nproc, failing, kind, phase)


def test_killed_rank_quick(tmp_path, reference):
    """The one matrix cell kept out of the slow marker, for `make test-fast`."""
    job = jitrun(tmp_path, nproc=2, steps=STEPS, fault=f"rank=1,step={FAULT_STEP},phase=backward,kind=sigkill")
    _check_recovered(job, reference, 2, 1, "sigkill", "backward")


def test_two_consecutive_failures(tmp_path, reference):
    fault = "rank=1,step=4,phase=backward,kind=sigkill;rank=0,step=10,phase=allreduce,kind=sigstop,attempt=1"
    job = jitrun(tmp_path, nproc=2, steps=STEPS, fault=fault)
    assert job.returncode == 0, job.output[-5000:]
    assert_same_state(reference(2, STEPS), job.out)
    rec = job.of("recovery")
    # the second fault hits during the all-reduce: the peer saves minibatch 10 or 11
    assert [r["restore_step"] for r in rec] in ([4, 10], [4, 11]), rec
    assert all(r["redone_minibatches"] <= 1 for r in rec)


def test_failure_during_save_uses_other_replica(tmp_path, reference):
    """Rank 2 dies; rank 0 dies inside its JIT save (after save_fn, before the
    manifest); the restart must use rank 1's replica."""
    fault = "rank=2,step=5,phase=backward,kind=sigkill;rank=0,phase=save,kind=exit"
    job = jitrun(tmp_path, nproc=3, steps=STEPS, fault=fault)
    assert job.returncode == 0, job.output[-5000:]
    assert_same_state(reference(3, STEPS), job.out)
    saved = job.of("checkpoint_saved")
    assert [e["rank"] for e in saved] == [1], saved
    shard = job.jit_dir / "ckpt" / "step-5" / "shard-0"
    assert not (shard / "rank-0").exists()
    assert not list(shard.glob(".tmp-rank-0-*"))  # its save died with it; its agent removed its staging dir
    assert "resumed from " + str(shard / "rank-1") in job.output


def test_exception_inside_save_fn_reports_and_other_replica_used(tmp_path, reference):
    fault = "rank=2,step=5,phase=forward,kind=sigkill;rank=1,phase=save,kind=exception"
    job = jitrun(tmp_path, nproc=3, steps=STEPS, fault=fault)
    assert job.returncode == 0, job.output[-5000:]
    assert_same_state(reference(3, STEPS), job.out)
    failed = job.of("checkpoint_failed")
    assert [e["rank"] for e in failed] == [1] and "InjectedFault" in failed[0]["error"]
    assert [e["rank"] for e in job.of("checkpoint_saved")] == [0]


def test_no_restarts_left_fails_like_torchrun(tmp_path):
    job = jitrun(tmp_path, nproc=2, steps=STEPS, max_restarts=0,
                 fault=f"rank=1,step={FAULT_STEP},phase=backward,kind=sigkill")
    assert job.returncode != 0
    # the survivor still left a checkpoint for a later resubmission of the job
    assert job.of("checkpoint_saved")


def test_corrupted_replica_is_never_loaded(tmp_path, reference):
    """Between the JIT save and the restart (inside the scheduler hook), flip a
    byte in rank 0's checkpoint: the restarted ranks must verify checksums,
    skip it and load rank 1's replica."""
    hook = tmp_path / "corrupt.py"
    hook.write_text(
        "import json, sys, pathlib\n"
        "info = json.load(sys.stdin)\n"
        f"root = pathlib.Path({str(tmp_path / 'jit')!r})\n"
        "p = root / 'ckpt' / f\"step-{info['restore_step']}\" / 'shard-0' / 'rank-0' / 'state.pt'\n"
        "b = bytearray(p.read_bytes()); b[len(b) // 2] ^= 0xFF; p.write_bytes(bytes(b))\n"
        "print(json.dumps({'action': 'restart'}))\n")
    hook.chmod(0o700)
    exe = tmp_path / "hook"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {hook}\n")
    exe.chmod(0o700)
    job = jitrun(tmp_path, nproc=3, steps=STEPS, extra=["--jit-scheduler", f"exec:{exe}"],
                 fault=f"rank=2,step={FAULT_STEP},phase=backward,kind=sigkill")
    assert job.returncode == 0, job.output[-5000:]
    assert sorted(e["rank"] for e in job.of("checkpoint_saved")) == [0, 1]
    assert "checksum mismatch in state.pt" in job.output
    shard = job.jit_dir / "ckpt" / f"step-{FAULT_STEP}" / "shard-0"
    assert f"resumed from {shard / 'rank-1'}" in job.output
    assert f"resumed from {shard / 'rank-0'}" not in job.output
    assert_same_state(reference(3, STEPS), job.out)


@pytest.mark.slow
def test_torchs_store_sharing_opt_out_is_ignored_and_said(tmp_path, reference):
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch's opt-out: worker rank 0 serves the
    workers' store) left jitrun's agent waiting on a store nobody served, and the job
    ended on a store timeout; jitrun now drops it, says so, and recovers as usual."""
    job = jitrun(tmp_path, nproc=2, steps=STEPS, fault=f"rank=1,step={FAULT_STEP},phase=backward,kind=sigkill",
                 env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert "jitrun: ignoring TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in job.output, job.output[-3000:]
    _check_recovered(job, reference, 2, 1, "sigkill", "backward")
