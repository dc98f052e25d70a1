"""``jitrun migrate`` across nodes: the demo trains on 2 nodes (network
namespaces, each agent with a private tmpfs jit dir and /dev/shm) under
``--jit-migratable on``; a third node runs a spare agent of the same job. One rank,
or every rank of a node, is moved to the spare by ``jitrun migrate`` run on the
source node (inside its agent's namespaces: the control file with the job's token
is on that node's private disk). The job must finish bit-identical to a
failure-free plain-torchrun run, with no restart and no minibatch redone, and the
script's initialisation must have run once per rank (``--init-log``). When the
migration itself breaks (CRIU killed, an image corrupted, no agent on the target)
the job falls back to a JIT checkpoint and a restart: still bit-identical, at most
one minibatch redone, and the events say what failed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_same_state, assert_verified_fingerprint
from netns import Cluster, Proc
from test_multinode import Job, mn_reference  # noqa: F401  (the fixture)

from jitckpt.wire.config import EXIT_SAVED
from jitrun.migration import criu

WHY = Cluster.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=WHY or "")]
STEPS = 160
TRAIN = ["--step-sleep", "0.05"]


@pytest.fixture(scope="module")
def criu_ok() -> None:
    try:
        criu.check()
    except criu.CriuError as e:
        pytest.skip(f"no working criu: {e}")


def _rank_output(job: Job, agent: str, rank: int) -> str:
    p = job.procs[agent].host_path(f"{job.jit}/migrate/out/rank{rank}.a0.log")
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def _wait_rank_output(job: Job, agent: str, rank: int, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in _rank_output(job, agent, rank):
        if time.monotonic() > deadline or job.procs[agent].popen.poll() is not None:
            pytest.fail(f"rank {rank} on {agent} never printed {text!r}\n" + job.logs())
        time.sleep(0.05)


def _migrate(job: Job, agent: str, *args: str) -> subprocess.CompletedProcess:
    """`jitrun migrate` on ``agent``'s node: in its network and mount namespaces."""
    p: Proc = job.procs[agent]
    cmd = ["nsenter", "-t", str(p.popen.pid), "-m", "-n", "--", sys.executable, "-m", "jitrun.cli", "migrate",
           "--jit-dir", job.jit, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})


def _start(c: Cluster, nproc: int, env: dict | None = None, spare: bool = True,
           extra: tuple[str, ...] = ()) -> tuple[Job, object]:
    job = Job(c, nproc, STEPS, nnodes=2, train=[*TRAIN, "--init-log", str(c.dir / "init.log")],
              extra=["--jit-migratable", "on", *extra])
    for node in c.nodes[:2]:
        job.start(node, env=env)
    _wait_rank_output(job, "agent0", 0, "step   10")
    third = None
    if spare:
        third = c.add_node()
        job.start(third, name="spare")
        job.wait_spare()
    assert "step  150" not in _rank_output(job, "agent0", 0), "training too short for this test"
    return job, third


def _inits(c: Cluster) -> list[str]:
    return (c.dir / "init.log").read_text().split("\n")[:-1]


def _finish(job: Job) -> list[dict]:
    # the spare ends when the job's rendezvous closes, with the job's outcome
    codes = job.wait()
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n{job.logs()}"
    return job.all_events()


@pytest.mark.parametrize("nproc", [1, 2])
def test_one_rank_migrates_to_a_third_node(nproc, mn_reference, criu_ok):  # noqa: F811
    ref = mn_reference(2, nproc, STEPS)
    moved = 2 * nproc - 1  # the last rank: on node 1
    with Cluster(2, tag="mr") as c:
        # EC snapshots from step 5 on: their gloo group of its own is let go for the dump too
        job, spare = _start(c, nproc, extra=("--jit-ec-every", "5"))
        cp = _migrate(job, "agent1", "--rank", str(moved), "--to", spare.addr)
        assert cp.returncode == 0, cp.stdout + cp.stderr + job.logs()
        evs = _finish(job)
        assert_same_state(ref, job.out)
        assert not [e for e in evs if e["event"] in ("restart", "recovery", "failure_detected")], job.logs()
        restored = [e for e in evs if e["event"] == "migration_restored"]
        assert [e["rank"] for e in restored] == [moved] and restored[0]["to"] == spare.addr, restored
        arrived = [e for e in job.events("spare") if e["event"] == "migration_arrived"]
        assert [e["rank"] for e in arrived] == [moved], job.events("spare")
        exits = [e for e in job.events("spare") if e["event"] == "worker_exit"]
        assert exits == [] or all(e["exitcode"] == 0 for e in exits), exits
        # the moved worker ran its set-up once: 2*nproc lines, one per rank, none twice
        ranks = sorted(int(line.split()[0]) for line in _inits(c))
        assert ranks == list(range(2 * nproc)), _inits(c)
        # every rank paused at the same minibatch start and went on from it: none redone
        paused = {e["rank"]: e["step"] for e in evs if e["event"] in ("migrating", "migration_resumed", "migrated")}
        assert len(set(paused.values())) == 1, paused
        # the replicas compared their states after the move, before the next step: one digest
        fps = {e["rank"]: e.get("fingerprint") for e in evs if e["event"] in ("migration_resumed", "migrated")}
        assert len(fps) == 2 * nproc and None not in fps.values() and len(set(fps.values())) == 1, fps


def test_whole_node_migrates_to_a_third_node(mn_reference, criu_ok):  # noqa: F811
    ref = mn_reference(2, 2, STEPS)
    with Cluster(2, tag="mw") as c:
        job, spare = _start(c, 2)
        cp = _migrate(job, "agent1", "--node", c.nodes[1].addr, "--to", spare.addr)
        assert cp.returncode == 0, cp.stdout + cp.stderr + job.logs()
        assert "ranks [2, 3]" in cp.stdout, cp.stdout
        evs = _finish(job)
        assert_same_state(ref, job.out)
        assert not [e for e in evs if e["event"] in ("restart", "recovery", "failure_detected")], job.logs()
        assert sorted(e["rank"] for e in evs if e["event"] == "migration_restored") == [2, 3]
        assert sorted(int(line.split()[0]) for line in _inits(c)) == [0, 1, 2, 3], _inits(c)


@pytest.mark.parametrize("fault", ["kill-criu", "corrupt-image", "no-target"])
def test_failed_migration_falls_back_to_jit_restart(fault, mn_reference, criu_ok):  # noqa: F811
    ref = mn_reference(2, 1, STEPS)
    env = {"JITCKPT_MIGRATE_TIMEOUT": "10"}
    if fault != "no-target":
        env["JITCKPT_TEST_MIGRATE_FAULT"] = fault
    with Cluster(2, tag="mf") as c:
        # no spare: after the fallback's restart three healthy agents would compete for two
        # places, and the one left out would wait on a rendezvous whose host then ends. The
        # target is node 0's agent (every migratable agent takes migrated workers).
        job, _ = _start(c, 1, env=env, spare=False)
        to = "10.255.255.1" if fault == "no-target" else c.nodes[0].addr  # no agent has that address
        cp = _migrate(job, "agent1", "--rank", "1", "--to", to)
        assert cp.returncode == 1 and "FAILED" in cp.stderr, cp.stdout + cp.stderr
        evs = _finish(job)
        assert_same_state(ref, job.out)
        # the source's record (the target, when it got as far, records its side too)
        failed = [e for e in evs if e["event"] == "migration_failed" and "to" in e]
        assert len(failed) == 1, (failed, job.logs())
        want = {"kill-criu": "dump", "corrupt-image": "restore", "no-target": "transfer"}[fault]
        assert failed[0]["stage"] == want, failed
        recs = [e for e in evs if e["event"] == "recovery"]
        assert len(recs) == 1 and recs[0]["redone_minibatches"] <= 1, (recs, job.logs())
        assert_verified_fingerprint(recs[0])
        assert not [e for e in evs if e["event"] == "migration_restored"]
        # every rank of the failed attempt that still ran took the JIT save where it paused and
        # exited with it (not only the one a stop signal happened to reach in time); the dumped rank
        # was ended by its dump
        restart_t = min(e["t"] for e in evs if e["event"] == "restart")
        exits = {e["rank"]: e["exitcode"] for e in evs if e["event"] == "worker_exit" and e["t"] < restart_t}
        assert exits == {0: EXIT_SAVED, 1: EXIT_SAVED if fault == "kill-criu" else -signal.SIGKILL}, exits
        step = failed[0].get("step") or next(e["step"] for e in evs if e["event"] == "migrating")
        saved = sorted(e["rank"] for e in evs if e["event"] == "checkpoint_saved" and e["step"] == step)
        assert saved == ([0, 1] if fault == "kill-criu" else [0]), saved


def test_failing_device_moves_its_rank_live(mn_reference, criu_ok):  # noqa: F811
    """NVML (the stand-in libnvidia-ml.so.1) reports node 1's device
    lost while it trains; jitrun's health monitor asks the scheduler hook, which
    answers migrate to the spare: the rank moves live, nothing restarts."""
    ref = mn_reference(2, 1, STEPS)
    root = Path(__file__).resolve().parent.parent
    subprocess.run(["make", "-s", "-C", str(root / "libintercept"), "sim"], check=True, capture_output=True)
    with Cluster(2, tag="mh") as c:
        hook = c.dir / "hook.sh"
        hook.write_text(f"#!/bin/sh\ncat > {c.dir}/hook-in.json\ncat {c.dir}/hook-out.json\n")
        hook.chmod(0o700)
        (c.dir / "hook-out.json").write_text('{"action": "restart"}')
        state = c.dir / "nvml1.state"
        job = Job(c, 1, STEPS, nnodes=2, train=[*TRAIN, "--init-log", str(c.dir / "init.log")],
                  extra=["--jit-migratable", "on", "--jit-health-interval", "0.3", "--jit-scheduler", f"exec:{hook}"])
        job.start(c.nodes[0])
        job.start(c.nodes[1], env={"JITCKPT_NVML_LIB": str(root / "build" / "sim" / "libnvidia-ml.so.1"),
                                   "JITSIM_NVML_STATE": str(state), "JITSIM_NVML_DEVICES": "1"})
        _wait_rank_output(job, "agent0", 0, "step   10")
        spare = c.add_node()
        job.start(spare, name="spare")
        job.wait_spare()
        (c.dir / "hook-out.json").write_text(f'{{"action": "migrate", "to": "{spare.addr}"}}')
        state.write_text("device=0 lost\n")
        evs = _finish(job)
        assert_same_state(ref, job.out)
        asked = json.loads((c.dir / "hook-in.json").read_text())
        assert asked["event"] == "device_unhealthy" and asked["ranks"] == [1], asked
        assert not [e for e in evs if e["event"] in ("restart", "recovery")], job.logs()
        req = [e for e in evs if e["event"] == "migration_requested"]
        assert len(req) == 1 and req[0]["ranks"] == [1] and req[0]["to"] == spare.addr, req
        assert [e["rank"] for e in evs if e["event"] == "migration_restored"] == [1], job.logs()
        assert sorted(int(line.split()[0]) for line in _inits(c)) == [0, 1], _inits(c)
