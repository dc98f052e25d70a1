"""Slurm glue for the ``slurm`` scheduler hook: drain lost nodes, find a spare
node of the job's allocation, start a replacement jitrun agent there.

Only works inside a Slurm allocation (``salloc``, ``sbatch`` or ``srun``, also
``srun --jobid=ID`` from outside it): the allocation is SLURM_JOB_ID, its nodes
are asked from slurmctld, and all requests go through the ordinary client
tools (``scontrol``, ``squeue``, ``srun``), so whatever SLURM_CONF / auth setup
they use applies here too.

Node names: a host given to these functions is a Slurm node name; a fully
qualified hostname is reduced to its first label (``n3.cluster`` -> ``n3``),
the usual Slurm convention.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

from jitckpt.wire import contract

# Node state flags (``scontrol show node`` State=BASE+FLAG+...) that make a node
# unfit to host a replacement agent.
BAD_STATES = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING",
                        "MAINTENANCE", "MAINT", "REBOOT_REQUESTED", "REBOOT_ISSUED", "POWERED_DOWN",
                        "POWERING_DOWN", "POWER_DOWN", "FUTURE", "UNKNOWN"})
# Steps Slurm runs itself; they don't mean a node is in use by a jitrun agent.
_SYSTEM_STEPS = ("batch", "extern", "interactive")
TIMEOUT_S = 30.0


class SlurmError(RuntimeError):
    pass


def node_name(host: str) -> str:
    return host.split(".", 1)[0]


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SlurmError(f"{name!r} not found on PATH ({os.environ.get('PATH', '')}); the slurm scheduler hook "
                         "needs the Slurm client tools (Debian/Ubuntu: apt-get install slurm-client) on every "
                         "node that runs jitrun")
    return path


def allocation() -> tuple[str, str]:
    """(job id, compressed node list) of the allocation we run in."""
    job, nodes = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_JOB_NODELIST")
    if not job or not nodes:
        raise SlurmError("not inside a Slurm allocation (SLURM_JOB_ID / SLURM_JOB_NODELIST not set); run jitrun "
                         "under salloc, sbatch or srun, e.g. `salloc -N 3 srun -N 2 jitrun --jit-scheduler slurm "
                         "...` so one allocated node stays spare")
    return job, nodes


def _run(argv: list[str]) -> str:
    argv = [tool(argv[0]), *argv[1:]]
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv)}` did not answer within {TIMEOUT_S:.0f}s; is slurmctld up "
                         "(`scontrol ping`)?") from None
    if cp.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` exited {cp.returncode}: {cp.stderr.strip()[:500]}")
    return cp.stdout


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``n[1-3],gpu7``."""
    return _run(["scontrol", "show", "hostnames", nodelist]).split()


def node_states(nodes: list[str]) -> dict[str, set[str]]:
    """{node: {"IDLE", "DRAIN", ...}}; a trailing ``*`` (not responding) becomes NOT_RESPONDING."""
    if not nodes:
        return {}
    states: dict[str, set[str]] = {}
    for line in _run(["scontrol", "show", "node", "-o", ",".join(nodes)]).splitlines():
        # One node per line; Reason= may contain spaces but NodeName=/State= never do.
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        if "NodeName" not in fields:
            continue
        raw = fields.get("State", "UNKNOWN")
        flags = set(raw.rstrip("*$#~!%@^-").split("+"))
        if raw.endswith("*"):
            flags.add("NOT_RESPONDING")
        states[fields["NodeName"]] = flags
    return states


def drain(host: str, reason: str) -> None:
    """Mark the node DRAIN so Slurm gives it to no further job; running jobs keep it.

    Needs Slurm operator rights (SlurmUser, root, or `sacctmgr modify user NAME set adminlevel=operator`).
    """
    # scontrol takes the rest of argv as key=value pairs; the reason is one argv
    # element, so spaces and quotes in it are safe.
    _run(["scontrol", "update", f"NodeName={node_name(host)}", "State=DRAIN", f"Reason={reason[:200]}"])


def _step_nodes(job: str) -> set[str]:
    """Nodes running a step of this job (a jitrun agent, or an earlier replacement)."""
    busy: set[str] = set()
    for line in _run(["squeue", "--steps", "--noheader", "--jobs", job, "--format", "%i %N"]).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].rsplit(".", 1)[-1] not in _SYSTEM_STEPS:
            busy.update(hostnames(parts[1]))
    return busy


def spare_nodes(in_use: Iterable[str] = (), lost: Iterable[str] = ()) -> list[str]:
    """Nodes of our allocation that can take a replacement agent, in allocation order.

    Excluded: ``in_use`` (surviving agents' hosts), ``lost``, nodes running a step
    of this job, and nodes that are drained, down or not responding.
    """
    job, _ = allocation()
    # The allocation's nodes from slurmctld, not from SLURM_JOB_NODELIST: in a
    # step started with `srun --jobid=ID` from outside the allocation, that is
    # the step's node list only.
    state, _, nodelist = _run(["squeue", "--noheader", "--jobs", job, "--format", "%T %N"]).strip().partition(" ")
    if state != "RUNNING":
        raise SlurmError(f"job {job} (SLURM_JOB_ID) is {state or 'unknown to slurmctld'}, not RUNNING; "
                         "a replacement can only join a running allocation")
    nodes = hostnames(nodelist.strip())
    taken = {node_name(h) for h in (*in_use, *lost)} | _step_nodes(job)
    free = [n for n in nodes if n not in taken]
    states = node_states(free)
    return [n for n in free if n in states and not states[n] & BAD_STATES]


def _log_path(node: str) -> Path:
    if contract.SLURM_LOG.get():
        return Path(contract.SLURM_LOG.get())
    root = contract.DIR.get() or tempfile.gettempdir()
    return Path(root) / f"slurm-replacement-{node}.log"


def start_replacement(node: str, command: list[str], log: Path | None = None) -> int:
    """Start ``command`` (a jitrun agent's argv) on ``node`` as a new step of our job.

    Detached: returns the pid of the local ``srun`` at once; srun lives as long
    as the remote command and forwards its output to ``log`` (default
    $JITCKPT_SLURM_LOG, else $JITCKPT_DIR/slurm-replacement-NODE.log).
    """
    if not command:
        raise SlurmError("no command to start a replacement agent with (failure['command'] is empty)")
    job, _ = allocation()
    log = log or _log_path(node)
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [tool("srun"), f"--jobid={job}", f"--nodelist={node}", "--nodes=1", "--ntasks=1",
            # --overlap: share CPUs/memory with the job's other steps (the old
            # agents' step may still hold them); --kill-on-bad-exit=0 and
            # --no-kill: the replacement's fate must not cancel the job.
            "--overlap", "--kill-on-bad-exit=0", "--no-kill", "--job-name=jitrun-replacement", *command]
    # SLURM_* from our own step (SLURM_NTASKS, SLURM_NNODES, SLURM_STEP_*, ...)
    # would be read by srun as defaults and contradict --nodes=1 --ntasks=1.
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("SLURM_", "SRUN_")) and k != "SLURM_CONF")}
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)  # our agent's signals must not reach it
    return proc.pid
