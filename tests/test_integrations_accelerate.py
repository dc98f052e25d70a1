"""jitckpt's Hugging Face Accelerate adapter with the real library: a rank
killed mid-epoch under jitrun, the final state bit-identical to a
failure-free plain-torchrun run (scripts/examples/accelerate_train.py)."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, Job, assert_same_state, run_reference, run_tree

pytest.importorskip("accelerate")

SCRIPT = ROOT / "scripts" / "examples" / "accelerate_train.py"
FAULT_STEP = 20  # 16 minibatches per rank and epoch: epoch 1, minibatch 4


@pytest.mark.parametrize("kind", ["sigkill", pytest.param("exception", marks=pytest.mark.slow)])
def test_accelerate_killed_rank_resumes_exactly(tmp_path, kind):
    ref = tmp_path / "reference.pt"
    cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(SCRIPT), "--out", str(ref)], cwd=tmp_path)
    assert cp.returncode == 0, cp.stdout[-3000:]
    out, jit = tmp_path / "final.pt", tmp_path / "jit"
    cp = run_tree([sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--max-restarts",
                   "3", "--jit-timeout", "3", "--jit-dir", str(jit), str(SCRIPT), "--out", str(out)],
                  env={"JITCKPT_FAULT": f"rank=1,step={FAULT_STEP},phase=forward,kind={kind}"}, timeout=300,
                  cwd=tmp_path)
    job = Job(cp.returncode, cp.stdout, jit, out)
    assert job.returncode == 0, job.output[-5000:]
    rec = job.of("recovery")
    assert len(rec) == 1 and rec[0]["restore_step"] == FAULT_STEP and rec[0]["redone_minibatches"] <= 1, rec
    assert f"resumed from {jit}" in job.output
    assert_same_state(ref, out)
