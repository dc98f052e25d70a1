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


@pytest.mark.slow
def test_lightning_preempted_by_a_group_sigterm_resumes_exactly(tmp_path, reference):
    """SIGTERM to every process of the job (scancel, a pod deletion) in the backward of a
    mid-epoch minibatch, under the bare launch: both ranks save, jitrun exits 75 with its one
    line; the same command again resumes there, bit-identical."""
    out, jit = tmp_path / "final.pt", tmp_path / "jit"
    cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--jit-dir", str(jit), str(SCRIPT),
           "--out", str(out)]
    cp = run_tree(cmd, env={"JITCKPT_FAULT": f"rank=0,step={MID_EPOCH},phase=backward,kind=pgterm"}, timeout=300,
                  cwd=tmp_path)
    job = Job(cp.returncode, cp.stdout, jit, out)
    assert job.returncode == 75, job.output[-5000:]
    # the other rank may finish that minibatch before its watcher runs: it saves the next one's start
    step = job.of("preempted")[0]["step"]
    assert step in (MID_EPOCH, MID_EPOCH + 1) and job.of("preempted")[0]["progress"] <= step, job.of("preempted")
    said = [ln for ln in job.output.splitlines() if ln.startswith("jitrun: preempted")]
    assert said == [f"jitrun: preempted (SIGTERM) at step {step}; saved; relaunch the same command to resume"], \
        job.output[-5000:]
    assert "Traceback" not in job.output and "KeyboardInterrupt" not in job.output, job.output[-5000:]
    assert {e["rank"]: e["exitcode"] for e in job.of("worker_exit")} == {0: 75, 1: 75}
    assert step in {e["step"] for e in job.of("checkpoint_saved")} <= {step - 1, step}
    cp = run_tree(cmd, timeout=300, cwd=tmp_path)
    assert cp.returncode == 0, cp.stdout[-5000:]
    assert f"resumed from {jit}" in cp.stdout
    assert_same_state(reference, out)
