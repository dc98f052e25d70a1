"""Module buffers at the minibatch start (jitckpt/buffers.py): captured after DDP's buffer
broadcast, rewound in the JIT save, compared by the replica checks.

Unit tests of the mirror and the fingerprint, then a BatchNorm CNN under the bare
``jitrun --nproc-per-node 2`` form with the common epoch loop (tests/bn_train.py), compared bit
for bit with a failure-free plain-torchrun run: failures in backward and forward (BatchNorm
statistics were one update ahead before), inside validation and between epochs (the counters
and the scheduler were of different points), a wrong buffer after a restore (refused), and
``broadcast_buffers=False`` (said at start).
"""

from __future__ import annotations

import fcntl
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import Job, _run_wide_dir, assert_same_state, run_reference, run_tree

from jitckpt import buffers
from jitckpt.verify.fingerprint import compute, state_items

BN_TRAIN = Path(__file__).with_name("bn_train.py")
EPOCHS = 3  # 4 optimizer steps per epoch on 2 ranks


@pytest.fixture(autouse=True)
def _fresh_mirrors():
    buffers._reset_for_tests()
    yield
    buffers._reset_for_tests()


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def test_rewind_puts_back_what_the_forward_wrote():
    net = _bn_net()
    mirror = buffers.add(net)
    mirror.capture(7)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net.train()
    net(torch.randn(8, 4))  # running stats and num_batches_tracked move
    assert not torch.equal(net[1].running_mean, before["1.running_mean"])
    assert mirror.rewind(7) == []
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_an_older_capture_is_not_rewound_and_a_replaced_buffer_is_named():
    net = _bn_net()
    mirror = buffers.add(net)
    mirror.capture(3)
    net(torch.randn(8, 4))
    live = net[1].running_mean.clone()
    assert mirror.rewind(4) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert torch.equal(net[1].running_mean, live)  # not of minibatch 4's start: left alone
    mirror.capture(4)
    net[1].running_var = torch.full((4,), 5.0)  # replaced, not updated in place
    assert mirror.rewind(4) == ["1.running_var"]
    assert torch.equal(net[1].running_var, torch.full((4,), 5.0))


def test_capture_allocates_nothing_per_step():
    net = _bn_net()
    mirror = buffers.add(net)
    ptrs = [t.data_ptr() for t in mirror.copy]
    for step in range(3):
        net(torch.randn(8, 4))
        mirror.capture(step)
    assert [t.data_ptr() for t in mirror.copy] == ptrs


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("broadcast", [True, False])
def test_fingerprint_takes_ddp_buffers_as_captured(one_rank_group, broadcast):
    ddp = nn.parallel.DistributedDataParallel(_bn_net(), broadcast_buffers=broadcast)
    mirror = buffers.add(ddp.module, synced_by=ddp)
    mirror.capture(0)
    names = [n for n, _ in state_items([ddp], [])]
    if broadcast:
        assert "m0.module.1.running_mean" in names
    else:  # per-rank by design: never compared
        assert not any("running" in n or "num_batches" in n for n in names), names
    before = compute(state_items([ddp], []))
    ddp.train()
    ddp(torch.randn(8, 4))  # the live statistics move between two starts: not what is compared
    assert compute(state_items([ddp], [])).digest == before.digest
    if broadcast:
        mirror.capture(1)
        assert compute(state_items([ddp], [])).digest != before.digest


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bn_reference(tmp_path_factory):
    """The failure-free plain-torchrun run, once per test run (shared by xdist workers)."""
    base = _run_wide_dir(tmp_path_factory, "bn-reference")
    out = base / "reference.pt"
    with open(base / "reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            work = Path(tempfile.mkdtemp(dir=base))
            cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                "2", str(BN_TRAIN), "--epochs", str(EPOCHS), "--out", str(work / "r.pt")],
                               env={"OMP_NUM_THREADS": "1"})
            assert cp.returncode == 0, cp.stdout[-3000:]
            (work / "r.pt").rename(out)
            shutil.rmtree(work)
    return out


def _bn_job(tmp: Path, *args: str, fault: str = "") -> Job:
    out = tmp / "final.pt"
    cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--max-restarts", "3",
           "--jit-dir", str(tmp / "jit"), str(BN_TRAIN), "--epochs", str(EPOCHS), "--out", str(out), *args]
    cp = run_tree(cmd, env={"OMP_NUM_THREADS": "1", **({"JITCKPT_FAULT": fault} if fault else {})})
    return Job(cp.returncode, cp.stdout, tmp / "jit", out)


def _assert_recovered_exactly(job: Job, reference: Path) -> None:
    assert job.returncode == 0, job.output[-6000:]
    assert_same_state(reference, job.out)
    (rec,) = job.of("recovery")
    assert rec["redone_minibatches"] <= 1, rec
    # every process of the failed attempt: a survivor saved (75), the faulty rank died of its own
    # SIGKILL or, stopped, was killed by the agent; the restarted attempt ended 0 (job_end)
    evs = job.events()
    cut = next(i for i, e in enumerate(evs) if e["event"] == "restart")
    first = {e["rank"]: e["exitcode"] for e in evs[:cut] if e["event"] == "worker_exit"}
    assert sorted(first.values()) == [-9, 75], first
    assert [e["exitcode"] for e in job.of("job_end")] == [0]
    assert "Traceback" not in job.output, job.output[-4000:]


@pytest.mark.parametrize("fault", [
    "rank=1,step=5,phase=backward,kind=sigkill",   # BatchNorm statistics one update ahead before
    "rank=0,step=6,phase=forward,kind=sigkill",    # rank 1's own buffers before
    "rank=1,step=4,phase=backward,kind=sigstop",   # first minibatch of epoch 1, after validate + step
])
def test_bn_model_resumes_bit_identical_after_a_fault_in_a_minibatch(tmp_path, bn_reference, fault):
    job = _bn_job(tmp_path, fault=fault)
    _assert_recovered_exactly(job, bn_reference)
    assert "own module buffers" not in job.output  # every save had the broadcast buffers


@pytest.mark.parametrize("kill", ["validate:0:1", "between:0:0", "validate:1:0"])
def test_bn_model_resumes_bit_identical_after_a_kill_between_minibatches(tmp_path, bn_reference, kill):
    job = _bn_job(tmp_path, "--kill", kill)
    _assert_recovered_exactly(job, bn_reference)
    (rec,) = job.of("recovery")
    assert rec["restore_step"] == 4 * (int(kill.split(":")[1]) + 1), rec  # the epoch's steps, none twice


def test_a_wrong_buffer_after_a_restore_is_refused(tmp_path):
    job = _bn_job(tmp_path, "--skew-buffer", fault="rank=1,step=5,phase=backward,kind=sigkill")
    assert job.returncode != 0, job.output[-4000:]
    assert "REFUSING TO TRAIN" in job.output and "running_mean" in job.output, job.output[-4000:]
    evs = job.events()
    cut = next(i for i, e in enumerate(evs) if e["event"] == "restart")
    exits = {e["rank"]: e["exitcode"] for e in evs[cut:] if e["event"] == "worker_exit"}
    assert exits == {0: 77, 1: 77}, exits
    assert len(job.of("restart")) == 1  # never restarted again


def test_unsynced_buffers_are_said_once_and_weights_stay_exact(tmp_path):
    ref = tmp_path / "ref.pt"
    cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(BN_TRAIN), "--epochs", "2", "--out", str(ref), "--no-broadcast-buffers"],
                       env={"OMP_NUM_THREADS": "1"})
    assert cp.returncode == 0, cp.stdout[-3000:]
    out = tmp_path / "final.pt"
    cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--max-restarts", "3", "--jit-dir",
           str(tmp_path / "jit"), str(BN_TRAIN), "--epochs", "2", "--out", str(out), "--no-broadcast-buffers"]
    job = run_tree(cmd, env={"OMP_NUM_THREADS": "1", "JITCKPT_FAULT": "rank=0,step=5,phase=backward,kind=sigkill"})
    assert job.returncode == 0, job.stdout[-4000:]
    assert job.stdout.count("DDP model with broadcast_buffers=False") == 2, job.stdout[-4000:]  # rank 0, per attempt
    assert "replica state checks turned off" not in job.stdout
    a, b = torch.load(ref, weights_only=True), torch.load(out, weights_only=True)
    for k, v in a["model"].items():
        if "running" not in k and "num_batches" not in k:
            assert torch.equal(v, b["model"][k]), k
    assert a["scheduler"] == b["scheduler"]
