"""A real 2-node jitrun job in a real Slurm allocation loses a node and is healed by the slurm hook.

The cluster is tests/slurm_cluster.py (munged + slurmctld + slurmd n1..n3 on
this host). An allocation of n1..n3 (``salloc --no-shell``) runs two jitrun
agents as steps on n1 and n2 (``srun --jobid --overlap -w nX``), n3 stays
spare. Once training is under way the whole n2 "node" is SIGKILLed (its agent
and its workers: every process of ours whose environment says
SLURMD_NODENAME=n2 in this job). The surviving agent's ``--jit-scheduler
slurm`` hook must drain n2 in slurmctld, start a replacement agent with the
same command on n3 through srun, and the job must finish with the same final
state as a failure-free run.

Rendezvous host: both agents use ``--rdzv-endpoint 127.0.0.1:PORT`` without
is_host; torch's c10d backend then takes the endpoint host as local on both
and tries to host the store on each, and the second bind fails over to client
mode (``_create_tcp_store``), so the n1 agent, started first, hosts it and
neither n2 nor the replacement can take it down.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster
from conftest import TRAIN, assert_same_state
from netns import signal_all

cluster = slurm_cluster.cluster  # the module-scoped Slurm cluster fixture

pytestmark = pytest.mark.slow

STEPS = 160




def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait(ok, timeout: float, what: str, diag) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout:.0f}s\n{diag()}")
        time.sleep(0.2)


def _node_pids(cluster, job: str, node: str) -> list[int]:
    """Our processes on Slurm node ``node`` of ``job``: the step's tasks (the jitrun agent)
    and their children (its workers, in sessions of their own), told by their environment.
    slurmstepd and slurmd are Slurm's, not the node's workload: left alone."""
    marks = [f"SLURM_CONF={cluster.conf}".encode(), f"SLURM_JOB_ID={job}".encode(),
             f"SLURMD_NODENAME={node}".encode()]
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = set((d / "environ").read_bytes().split(b"\0"))
            exe = os.readlink(d / "exe")
        except OSError:
            continue
        if all(m in env for m in marks) and not os.path.basename(exe).startswith(("slurmstepd", "slurmd")):
            pids.append(int(d.name))
    return pids


def _kill_node(cluster, job: str, node: str) -> list[int]:
    """SIGKILL everything of ours on ``node`` at once (stopped first, so that no part of
    the node reacts to the death of another, as when a machine goes away)."""
    return signal_all(_node_pids(cluster, job, node), signal.SIGSTOP, signal.SIGKILL)


def _events(jit: Path) -> list[dict]:
    p = jit / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def test_lost_node_drained_and_replaced_by_srun_on_spare(cluster, tmp_path, reference):
    t_start = time.monotonic()
    cluster.reset()
    jit, out = tmp_path / "jit", tmp_path / "final.pt"
    logs = {n: tmp_path / f"srun-{n}.log" for n in ("n1", "n2")}
    # the job token, as an operator exports it before srun (jitrun never shares it through the store)
    env = {**cluster.env, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
           "JITCKPT_TOKEN": secrets.token_hex(16)}
    env.pop("JITCKPT_SLURM_LOG", None)  # the replacement's log: the hook's default in the jit dir
    port = _free_port()
    agent = [sys.executable, "-m", "jitrun.cli", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "slurmtest",
             "--rdzv-conf", "keep_alive_interval=2", "--max-restarts", "3", "--jit-timeout", "5",
             "--jit-dir", str(jit), "--jit-scheduler", "slurm",
             str(TRAIN), "--steps", str(STEPS), "--step-sleep", "0.05", "--out", str(out)]
    sruns: dict[str, subprocess.Popen] = {}
    job = None

    def replacement_log() -> Path:
        return jit / "slurm-replacement-n3.log"

    def diag() -> str:
        parts = []
        for name, p in [*logs.items(), ("replacement", replacement_log())]:
            text = p.read_text(errors="replace") if p.exists() else "(none)"
            parts.append(f"--- {name} ({p})\n{text[-5000:]}")
        parts.append("--- squeue --steps\n" + cluster.run("squeue", "--steps", check=False).stdout)
        return "\n".join(parts) + "\n" + cluster.logs()

    try:
        cp = cluster.run("salloc", "--nodes=3", "--no-shell", "--immediate=30", "--job-name=jitrun-e2e", timeout=60)
        m = re.search(r"Granted job allocation (\d+)", cp.stderr)
        assert m, cp.stderr
        job = m.group(1)
        state = cluster.run("squeue", "--noheader", "--jobs", job, "--format", "%T %N").stdout.split()
        assert state == ["RUNNING", "n[1-3]"], state

        def start(node: str) -> None:
            with open(logs[node], "wb") as log:  # srun keeps its own copy
                sruns[node] = subprocess.Popen(
                    ["srun", f"--jobid={job}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
                     "--kill-on-bad-exit=0", f"--job-name=jitrun-{node}", *agent],
                    env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path,
                    start_new_session=True)

        start("n1")  # first: hosts the rendezvous store
        _wait(lambda: _listening(port) or sruns["n1"].poll() is not None, 60, "n1 agent's rendezvous store", diag)
        assert sruns["n1"].poll() is None, diag()
        start("n2")

        def training() -> bool:
            # rank 0 is on whichever node the rendezvous made group rank 0
            return any("[rank 0] step   10" in p.read_text(errors="replace") for p in logs.values() if p.exists())

        _wait(lambda: training() or any(p.poll() is not None for p in sruns.values()), 120,
              "rank 0 at step 10", diag)
        assert all(p.poll() is None for p in sruns.values()), diag()

        killed = _kill_node(cluster, job, "n2")
        assert len(killed) >= 2, f"expected n2's agent and worker, killed {killed}\n{diag()}"  # agent + 1 rank
        t_kill = time.monotonic()

        try:
            rc1 = sruns["n1"].wait(timeout=150)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the n1 agent did not finish\n{diag()}")
        assert rc1 == 0, diag()

        # The replacement's agent writes its own job_end to the shared timeline.
        def repl_node() -> str | None:
            return next((e["node"] for e in _events(jit) if e["event"] == "rendezvous" and e.get("host") == "n3"),
                        None)

        def repl_end() -> dict | None:
            node = repl_node()
            return next((e for e in _events(jit) if e["event"] == "job_end" and e.get("node") == node), None)

        _wait(lambda: repl_end() is not None, 60, "the replacement agent's job_end", diag)
        t_done = time.monotonic()
        evs = _events(jit)
        assert repl_end()["exitcode"] == 0, diag()

        # drained in the real slurmctld, with the hook's reason
        node = cluster.node("n2")
        assert "DRAIN" in node, node
        assert re.search(r"Reason=jitrun: agent \S+ lost \(job slurmtest\)", node), node
        for n in ("n1", "n3"):
            assert "DRAIN" not in cluster.node(n)
        n1_log = logs["n1"].read_text(errors="replace")
        assert "jitrun: slurm: drained node n2" in n1_log, diag()
        assert "started a replacement agent for n2 on spare node n3" in n1_log, diag()

        # the replacement joined round 1 on n3 and its rank resumed from the JIT checkpoint
        rounds = {(e.get("host"), e["round"]) for e in evs if e["event"] == "rendezvous"}
        assert {("n1", 0), ("n2", 0), ("n1", 1), ("n3", 1)} <= rounds, rounds
        decision = [e for e in evs if e["event"] == "restore_decision"]
        assert decision and decision[-1]["step"] is not None and len(decision[-1]["lost"]) == 1, decision
        repl = replacement_log().read_text(errors="replace")
        assert re.search(r"\[rank \d\] resumed from \S+ at step [1-9]\d*", repl), diag()

        print(f"slurm e2e: kill -> job done {t_done - t_kill:.1f}s, allocation -> job done {t_done - t_start:.1f}s")

        # bit-identical to a failure-free run (2 ranks on one host = 2 nodes x 1 rank)
        assert_same_state(reference(2, STEPS), out)
    finally:
        for p in sruns.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        if job is not None:
            cluster.run("scancel", job, check=False)
        cluster.reset()
