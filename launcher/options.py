"""What one jitrun agent is told by its command line, and who it is."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from . import decision


@dataclass
class JitOptions:
    root: Path
    job_id: str
    token: str
    timeout_s: float  # the hang bound's ceiling, or with timeout_fixed the fixed bound
    save_timeout_s: float
    scheduler: str
    command: list[str] = field(default_factory=list)  # this agent's argv, to start a replacement
    health_interval_s: float = 0.0  # NVML checks while the job runs (0: only before each start)
    timeout_fixed: bool = False  # --jit-timeout fixed:S: no learned bound, no hang watch
    identity: str | None = None  # what makes it the same job (cli.job_identity): checked in every manifest
    preempt_grace_s: float = 15.0  # --jit-preempt-grace (launcher/preempt.py: DEFAULT_GRACE_S)


def this_node(local_addr: str | None) -> decision.NodeInfo:
    """This agent's identity in the job: its address (``--local-addr``, else
    the host's FQDN) and PID, and its host name (under Slurm the scheduler's
    name for the node: several slurmd may share a host)."""
    addr = local_addr or socket.getfqdn()
    host = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    return decision.NodeInfo(node_id=f"{addr}-{os.getpid()}", host=host, addr=addr)
