"""EC snapshots end to end with real torch (gloo) under jitrun.

Every worker of the job is SIGKILLed at the same minibatch start, so no replica can take a JIT checkpoint:
the job must come back from the newest committed EC snapshot, bit-identical to a failure-free run,
redoing at most N (--jit-ec-every) minibatches. Multi-node: nodes are network namespaces, each with its
own private /dev/shm and jit dir (tests/netns.py), which vanish with the node.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import test_multinode
from conftest import assert_same_state, assert_verified_fingerprint, jitrun
from netns import Cluster
from test_multinode import Job

mn_reference = test_multinode.mn_reference  # the failure-free multi-node references (a fixture), shared

EVERY = 4
STEPS = 24
KILL_AT = 11  # the forward of minibatch 11: the newest snapshot is step 8, 3 minibatches to redo
SLEEP = ["--step-sleep", "0.3"]  # time for the step-8 version to commit before the kill, even on a busy host


def _kill_all(world: int, step: int = KILL_AT, ranks: range | None = None) -> dict:
    """``ranks`` (default all) die at the forward of ``step``, and any rank of the job that is asked
    for a JIT save first dies at it instead: on a busy host one rank can still be in the previous
    minibatch's tail when another's death is seen, and would save that minibatch, so the premise
    (nothing of ``step`` saved anywhere) would depend on timing."""
    kill = [f"rank={r},step={step},phase=forward,kind=sigkill" for r in (ranks or range(world))]
    at_save = [f"rank={r},phase=save,kind=sigkill" for r in range(world)]
    return {"JITCKPT_FAULT": ";".join(kill + at_save)}


def _check_ec_recovery(evs: list[dict], out: str) -> dict:
    src = [e for e in evs if e["event"] == "restore_source"]
    assert src and all(e["source"] == "ec" for e in src), (src, out[-4000:])
    assert {e["step"] for e in src} == {8}, src
    assert not [e for e in evs if e["event"] == "checkpoint_saved"], "no replica could save: all were killed"
    restored = [e for e in evs if e["event"] == "ec_restored"]
    assert restored and {e["step"] for e in restored} == {8}, out[-4000:]
    rec = [e for e in evs if e["event"] == "recovery"]
    assert len(rec) == 1 and rec[0]["restore_step"] == 8, rec
    assert_verified_fingerprint(rec[0])
    assert KILL_AT + 1 - rec[0]["restore_step"] <= EVERY  # at most N minibatches redone
    return src[0]


@pytest.mark.slow
def test_single_node_all_workers_killed(tmp_path, reference, monkeypatch):
    """One node: the default code is 1+0, a copy in /dev/shm that outlives the processes."""
    shm = tmp_path / "shm"  # stands for /dev/shm (the agent reads the same variable); removed with tmp_path
    shm.mkdir(mode=0o700)
    job = jitrun(tmp_path, nproc=2, steps=STEPS, fault=_kill_all(2)["JITCKPT_FAULT"], timeout_s=5,
                 extra=["--jit-ec-every", str(EVERY)], train_args=SLEEP, env={"JITCKPT_EC_SHM": str(shm)})
    assert job.returncode == 0, job.output[-4000:]
    src = _check_ec_recovery(job.events(), job.output)
    assert src["ec"]["k"] == 1 and src["ec"]["m"] == 0
    assert "restoring from the erasure-coded snapshot of step 8" in job.output
    assert_same_state(reference(2, STEPS), job.out)


@pytest.mark.slow
def test_default_interval_recovers_a_whole_job_crash(tmp_path, reference):
    """No --jit-ec-* flag at all: the default interval (jitrun.cli.DEFAULT_EC_EVERY) takes the
    snapshot at minibatch 100, and a crash of every worker after it costs the minibatches since."""
    from jitrun.cli import DEFAULT_EC_EVERY

    steps, kill_at = DEFAULT_EC_EVERY + 8, DEFAULT_EC_EVERY + 5  # 5 x 0.15 s for the version to commit
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    job = jitrun(tmp_path, nproc=2, steps=steps, fault=_kill_all(2, step=kill_at)["JITCKPT_FAULT"], timeout_s=5,
                 train_args=["--step-sleep", "0.15"], env={"JITCKPT_EC_SHM": str(shm)})
    assert job.returncode == 0, job.output[-4000:]
    evs = job.events()
    src = [e for e in evs if e["event"] == "restore_source"]
    assert src and all(e["source"] == "ec" and e["step"] == DEFAULT_EC_EVERY for e in src), (src, job.output[-4000:])
    rec = [e for e in evs if e["event"] == "recovery"]
    assert len(rec) == 1 and rec[0]["restore_step"] == DEFAULT_EC_EVERY, rec
    assert_verified_fingerprint(rec[0])
    assert f"restoring from the erasure-coded snapshot of step {DEFAULT_EC_EVERY}" in job.output
    assert_same_state(reference(2, steps), job.out)


WHY = Cluster.unavailable()
netns = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@netns
@pytest.mark.slow
def test_three_nodes_all_workers_killed(mn_reference):
    ref = mn_reference(3, 1, STEPS)
    with Cluster(3) as c:
        job = Job(c, 1, STEPS, train=SLEEP, extra=["--jit-ec-every", str(EVERY)], timeout_s=5)
        job.start_all(env=_kill_all(3))
        codes = job.wait(timeout=300)
        assert all(v == 0 for v in codes.values()), (codes, job.logs())
        src = _check_ec_recovery(job.all_events(), job.logs())
        assert (src["ec"]["k"], src["ec"]["m"]) == (2, 1), src
        assert_same_state(ref, Path(job.out))


@netns
@pytest.mark.slow
def test_three_nodes_one_node_lost_2_plus_1(mn_reference):
    """Every worker killed and one whole node gone with its /dev/shm: 2 of 3 chunks per stripe survive.
    The ranks stop themselves at the forward of 11 and the test loses node 2 before it kills the other
    two (``_stop_all_then_kill``): killing node 2 when rank 0 logged step 10 raced with ranks 0 and 1
    dying at 11 on their own, and on a busy host node 2's agent was still there to decide with them."""
    ref = mn_reference(3, 1, STEPS)
    with Cluster(3) as c:
        job = _stop_all_then_kill(c, lose=[2])
        codes = job.wait(timeout=300, killed=("agent2",))
        assert all(v == 0 for v in codes.values()), (codes, job.logs())
        evs = job.all_events()
        src = _check_ec_recovery(evs, job.logs())
        assert (src["ec"]["k"], src["ec"]["m"]) == (2, 1), src
        dec = [e for e in evs if e["event"] == "restore_decision"]
        assert dec and dec[0]["lost"], dec
        assert_same_state(ref, Path(job.out))


def _stop_all_then_kill(c: Cluster, lose: list[int]) -> Job:
    """Every rank (one per node) stops itself (SIGSTOP) at the forward of KILL_AT; once all are
    stopped, the nodes in ``lose`` are killed whole, then the other nodes' stopped ranks (by PID),
    and after 4 s (the survivors' agents decide without the lost nodes) a replacement starts for
    each lost node. Nothing of KILL_AT is saved anywhere however slow the host. The stopped ranks
    hold the job past a learned hang bound, hence the fixed timeout."""
    world = len(c.nodes)
    stop = ";".join(f"rank={r},step={KILL_AT},phase=forward,kind=sigstop" for r in range(world))
    job = Job(c, 1, STEPS, train=SLEEP, extra=["--jit-ec-every", str(EVERY)], timeout_s=test_multinode.PAUSED)
    job.start_all(env={"JITCKPT_FAULT": stop})
    # node 0's rank first, through the whole run up to KILL_AT; the others are there moments later
    stopped = {n: test_multinode._stopped_worker(c.nodes[n], timeout=240 if n == 0 else 60) for n in range(world)}
    for n in lose:
        assert c.nodes[n].kill(), "the node had processes"
    for n, pid in stopped.items():
        if n not in lose:
            os.kill(pid, signal.SIGKILL)
    time.sleep(4)
    for n in lose:
        job.start(c.add_node(), name=f"replacement{n}")
    return job


@netns
@pytest.mark.slow
def test_three_nodes_two_nodes_lost_falls_back(mn_reference):
    """Two nodes gone: 1 chunk per stripe is left of the k=2 needed. The job says so and starts afresh
    (there is no persistent checkpoint), never decoding anything, and still ends bit-identical.

    Every rank stops itself at the forward of minibatch 11; once all three are stopped the test kills
    nodes 1 and 2, then node 0's rank: nothing of step 11 is saved anywhere however slow the host.
    (Killing the nodes once rank 0 logged step 10, with rank 0 dying at 11 on its own, raced: on a busy
    host rank 0 died first, the others saved step 11 and the job chose that replica, on nodes about to
    go.) The stopped ranks hold the job past a learned hang bound, hence the fixed timeout."""
    ref = mn_reference(3, 1, STEPS)
    with Cluster(3) as c:
        job = _stop_all_then_kill(c, lose=[1, 2])
        codes = job.wait(timeout=400, killed=("agent1", "agent2"))
        assert all(v == 0 for v in codes.values()), (codes, job.logs())
        evs = job.all_events()
        assert not [e for e in evs if e["event"] == "checkpoint_saved"], job.logs()
        src = [e for e in evs if e["event"] == "restore_source"]
        assert src and src[0]["source"] == "fresh", (src, job.logs())
        assert any("EC step 8" in w and "not decodable" in w for w in src[0]["not_used"]), src
        assert "RESTARTS FROM SCRATCH" in job.procs["agent0"].output()
        assert not [e for e in evs if e["event"] in ("ec_restored", "ec_restore_failed")]
        assert_same_state(ref, Path(job.out))
