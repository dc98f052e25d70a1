"""What the gpu_check's phases share: the context, running a process tree, the results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@dataclass
class Ctx:
    """One gpu_check run. ``device``: a GPU with torch's real CUDA runtime and NCCL;
    otherwise the CPU stand-in (CI, here): what needs the device is skipped."""

    device: bool
    py: str
    out: Path
    build: Path
    work: Path
    deadline: float = float("inf")  # time.monotonic() by which every phase has ended
    probe: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, str] = field(default_factory=dict)  # built programs: name -> path

    def t(self, limit: float) -> float:
        """A process's time limit: ``limit``, cut to what is left of the run's."""
        return max(1.0, min(limit, self.deadline - time.monotonic()))

    @property
    def shim(self) -> Path:
        return self.build / "libjitintercept.so"

    def env(self, **extra: str) -> dict[str, str]:
        """The workers' environment: the shim jitrun preloads, quiet torch, one thread per rank."""
        e = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("JITCKPT_")}
        e.update({"JITCKPT_INTERCEPT_LIB": str(self.shim), "OMP_NUM_THREADS": "1",
                  "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"})
        e.update(extra)
        return e


@dataclass
class Run:
    rc: int | None  # None: killed at its time limit
    out: str
    secs: float

    def tail(self, n: int = 1500) -> str:
        return self.out[-n:]


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None) -> Run:
    """cmd in a session of its own; at the time limit that session (our processes only) is killed."""
    t0 = time.monotonic()
    p = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, cwd=cwd, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc: int | None = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc = None
    return Run(rc, out, time.monotonic() - t0)


def last_json(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON line in: {text[-500:]}")


class Phase(Exception):
    """A phase's verdict other than ok: ``skipped`` (needs what this machine lacks) or ``failed``."""

    def __init__(self, status: str, why: str, **data: Any) -> None:
        super().__init__(why)
        self.status, self.why, self.data = status, why, data


def skip(why: str) -> Phase:
    return Phase("skipped", why)


def fail(why: str, **data: Any) -> Phase:
    return Phase("failed", why, **data)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
