"""What jitrun tells each worker, read from the environment once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import contract

# Exit codes of a worker that handled a failure (documented in README).
EXIT_SAVED = 75  # a JIT checkpoint was published, the worker stopped on purpose
EXIT_NOT_SAVED = 76  # a failure was detected but no consistent state could be saved
EXIT_DIVERGED = 77  # ranks loaded different checkpoint steps: refused before any training step
EXIT_REFUSED = 78  # the script asked for what jitckpt cannot make exact (refusal.py): never restarted

DEFAULT_TIMEOUT_S = contract.DEFAULT_TIMEOUT_S


def shim_preloaded() -> bool:
    """jitrun put libintercept into this worker (the GPU path)."""
    return "libjitintercept" in os.environ.get("LD_PRELOAD", "")


@dataclass(frozen=True)
class WorkerConfig:
    root: Path | None  # jit dir; None when not launched by jitrun
    job_id: str
    token: str
    timeout_s: float
    rank: int
    world_size: int
    restart_count: int
    plan: contract.RestorePlan
    store_addr: tuple[str, int] | None
    fault_spec: str
    attempt: int = 0  # job-wide (the rendezvous round under jitrun), same on every node
    report_stream: str = ""  # its node's report stream, read by that node's agent
    identity: str = ""  # what makes it the same job (recorded in, and checked against, every manifest)

    @property
    def managed(self) -> bool:
        """True under jitrun: reports and JIT saves are possible."""
        return self.root is not None and bool(self.token)


def from_env(env: os._Environ | dict = os.environ) -> WorkerConfig:
    addr = None
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        addr = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    return WorkerConfig(
        root=contract.DIR.get(env),
        job_id=contract.JOB_ID.get(env),
        token=contract.TOKEN.get(env),
        timeout_s=contract.TIMEOUT.get(env),
        rank=int(env.get("RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        attempt=contract.attempt(env),
        plan=contract.RestorePlan.from_env(env),
        store_addr=addr,
        fault_spec=contract.FAULT.get(env),
        report_stream=contract.REPORT_STREAM.get(env),
        identity=contract.JOB_IDENTITY.get(env),
    )
