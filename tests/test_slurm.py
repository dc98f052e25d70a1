"""The ``slurm`` scheduler hook against a real slurmctld + slurmd cluster (tests/slurm_cluster.py).

Each check runs inside a real allocation: ``salloc -N 3 python -c ...`` runs a
helper with the SLURM_JOB_ID / SLURM_JOB_NODELIST Slurm sets, which calls
``jitrun.devices.scheduler.place("slurm", failure)`` and prints the placement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import slurm_cluster

from jitrun.devices import scheduler
from jitrun.devices.scheduler import SchedulerError

cluster = slurm_cluster.cluster  # the module-scoped Slurm cluster fixture

# Runs inside the allocation: place(), then wait for the replacement's marker
# so the allocation (and with it the srun step) outlives the replacement.
HELPER = """
import json, os, sys, time
from jitrun.devices import scheduler
failure, marker = json.loads(sys.argv[1]), sys.argv[2]
assert scheduler.parse_hook("slurm") == "slurm"
p = scheduler.place("slurm", failure)
deadline = time.monotonic() + 30
while p.env and not os.path.exists(marker) and time.monotonic() < deadline:
    time.sleep(0.1)
print(json.dumps({"action": p.action, "env": p.env, "job": os.environ["SLURM_JOB_ID"],
                  "nodelist": os.environ["SLURM_JOB_NODELIST"]}))
"""




@pytest.fixture
def fresh(cluster):
    cluster.reset()
    yield cluster
    cluster.reset()


def _in_allocation(cluster, tmp_path: Path, failure: dict, nodes: int = 3, in_step: bool = False,
                   **env: str) -> tuple[dict, str]:
    """Run HELPER under ``salloc``; ``in_step``: inside an srun step on n1, as an agent started by
    ``srun jitrun ...`` would be (SLURM_STEP_*, SLURM_NTASKS, SLURMD_NODENAME=n1 set)."""
    marker = tmp_path / "marker"
    env = {**cluster.env, "JITCKPT_DIR": str(tmp_path / "jit"), **env}
    step = ["srun", "--nodes=1", "--ntasks=1", "--nodelist=n1"] if in_step else []
    cp = subprocess.run(["salloc", f"--nodes={nodes}", "--quiet", "--immediate=20", "--", *step, sys.executable,
                         "-c", HELPER, json.dumps(failure), str(marker)],
                        env=env, capture_output=True, text=True, timeout=90)
    assert cp.returncode == 0, f"{cp.stdout}\n{cp.stderr}\n{cluster.logs()}"
    return json.loads(cp.stdout.strip().splitlines()[-1]), cp.stderr


def _marker_cmd(tmp_path: Path) -> list[str]:
    # Stands in for the jitrun agent's argv: proves where srun ran it.
    return ["sh", "-c", f'echo "$SLURMD_NODENAME $SLURM_JOB_ID" > {tmp_path}/marker.tmp && '
                        f"mv {tmp_path}/marker.tmp {tmp_path}/marker"]


def _failure(tmp_path: Path, **kw) -> dict:
    return {"job_id": "j1", "restart_count": 1, "failed_ranks": [2, 3], "reasons": {"2": "agent lost"},
            "hosts": ["n1"], "failed_hosts": ["n2"], "command": _marker_cmd(tmp_path),
            "lost_nodes": [{"node_id": "agent-n2", "host": "n2", "addr": "127.0.0.1"}], **kw}


@pytest.mark.parametrize("in_step", [False, True], ids=["salloc", "srun-step"])
def test_lost_node_drained_and_replaced_on_spare(fresh, tmp_path, in_step):
    ans, err = _in_allocation(fresh, tmp_path, _failure(tmp_path), in_step=in_step)
    assert ans["action"] == "restart" and ans["nodelist"] == "n[1-3]"
    assert ans["env"] == {"JITCKPT_SLURM_SPARE": "n3"}, err
    node = fresh.node("n2")
    assert "DRAIN" in node, node
    assert "Reason=jitrun: agent agent-n2 lost (job j1)" in node, node
    # The replacement really ran on the spare, as a step of the same allocation.
    assert (tmp_path / "marker").read_text().split() == ["n3", ans["job"]]
    assert "started a replacement agent for n2 on spare node n3" in err
    for n in ("n1", "n3"):
        assert "DRAIN" not in fresh.node(n)
    assert (tmp_path / "jit" / "slurm-replacement-n3.log").exists()  # srun's own output goes there


def test_step_started_from_outside_the_allocation(fresh, tmp_path):
    # `srun --jobid=ID -w n1` from outside the allocation (how a batch system's
    # wrapper or a test starts agents): the step's SLURM_JOB_NODELIST is n1 only,
    # the spare is still found among the allocation's nodes (asked from slurmctld).
    cp = fresh.run("salloc", "--nodes=3", "--no-shell", "--immediate=20")
    job = cp.stderr.split("Granted job allocation ")[1].split()[0]
    env = {**fresh.env, "JITCKPT_DIR": str(tmp_path / "jit")}
    cp = subprocess.run(["srun", f"--jobid={job}", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n1",
                         sys.executable, "-c", HELPER, json.dumps(_failure(tmp_path)), str(tmp_path / "marker")],
                        env=env, capture_output=True, text=True, timeout=90)
    assert cp.returncode == 0, f"{cp.stdout}\n{cp.stderr}\n{fresh.logs()}"
    ans = json.loads(cp.stdout.strip().splitlines()[-1])
    assert ans["job"] == job and ans["nodelist"] == "n1"
    assert ans["env"] == {"JITCKPT_SLURM_SPARE": "n3"}, cp.stderr
    assert (tmp_path / "marker").read_text().split() == ["n3", job]


def test_no_spare_restarts_without_replacement(fresh, tmp_path):
    # n3 is busy too (a surviving agent), so nothing of the allocation is left.
    ans, err = _in_allocation(fresh, tmp_path, _failure(tmp_path, hosts=["n1", "n3"]))
    assert ans["action"] == "restart" and ans["env"] == {}
    assert "no spare node for 1 of 1 lost node(s)" in err and "restarting anyway" in err
    assert "DRAIN" in fresh.node("n2")
    assert not (tmp_path / "marker").exists()


def test_drained_node_is_no_spare(fresh, tmp_path):
    fresh.run("scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=maintenance")
    ans, err = _in_allocation(fresh, tmp_path, _failure(tmp_path), nodes=2)
    assert ans["nodelist"] == "n[1-2]" and ans["env"] == {}
    assert "no spare node" in err


def test_only_first_surviving_agent_replaces(fresh, tmp_path):
    # Agents on n1 and n3 both survive n2; the one on n3 leaves the replacement to n1.
    ans, err = _in_allocation(fresh, tmp_path, _failure(tmp_path, hosts=["n1", "n3"]), SLURMD_NODENAME="n3")
    assert ans["env"] == {}
    assert "DRAIN" in fresh.node("n2") and "replacement" not in err


def test_parse_hook_outside_allocation(cluster, monkeypatch):
    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    with pytest.raises(SchedulerError, match="not inside a Slurm allocation") as ei:
        scheduler.parse_hook("slurm")
    assert "salloc" in str(ei.value)
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no scontrol there
    with pytest.raises(SchedulerError, match="'scontrol' not found on PATH"):
        scheduler.parse_hook("slurm")


def test_slurm_errors_are_not_fatal(cluster, tmp_path, monkeypatch, capsys):
    # An unknown node and a job id that does not exist: both reported, place() still restarts.
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.setenv("SLURM_JOB_ID", "999999")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    p = scheduler.place("slurm", _failure(tmp_path, lost_nodes=[{"node_id": "x", "host": "nosuchnode"}]))
    assert p.action == "restart" and p.env == {}
    err = capsys.readouterr().err
    assert "could not drain nosuchnode" in err and "Invalid node name" in err
    assert "could not look for spare nodes" in err and "Invalid job id" in err
    assert "no spare node for 1 of 1" in err
