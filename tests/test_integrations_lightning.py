"""jitckpt's PyTorch Lightning callback with the real library: a rank killed
mid-epoch under jitrun (2 ranks, DDP over gloo on CPU), the final model,
optimizer and LR scheduler state bit-identical to a failure-free
plain-torchrun run (scripts/examples/lightning_train.py)."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, Job, assert_same_state, run_reference, run_tree

pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install 'lightning>=2.4')")

SCRIPT = ROOT / "scripts" / "examples" / "lightning_train.py"
# 16 minibatches per rank and epoch, 2 epochs: 20 is epoch 1, batch 4 (Lightning's mid-epoch
# restart); 16 is the first batch of epoch 1 (the previous epoch's end processing already done)
MID_EPOCH, EPOCH_START = 20, 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning-reference")
    ref = tmp / "reference.pt"
    cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(SCRIPT), "--out", str(ref)], cwd=tmp, timeout=300)
    assert cp.returncode == 0, cp.stdout[-3000:]
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("step", [MID_EPOCH, EPOCH_START])
def test_lightning_killed_rank_resumes_exactly(tmp_path, reference, step):
    out, jit = tmp_path / "final.pt", tmp_path / "jit"
    cp = run_tree([sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--max-restarts",
                   "3", "--jit-timeout", "3", "--jit-dir", str(jit), str(SCRIPT), "--out", str(out)],
                  env={"JITCKPT_FAULT": f"rank=1,step={step},phase=forward,kind=sigkill"}, timeout=300,
                  cwd=tmp_path)
    job = Job(cp.returncode, cp.stdout, jit, out)
    assert job.returncode == 0, job.output[-5000:]
    rec = job.of("recovery")
    assert len(rec) == 1 and rec[0]["restore_step"] == step and rec[0]["redone_minibatches"] <= 1, rec
    assert f"resumed from {jit}" in job.output
    assert "WARNING" not in job.output, job.output[-5000:]  # e.g. a sampler at the wrong epoch
    assert_same_state(reference, out)
