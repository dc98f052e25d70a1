"""Helpers for the stand-in runtime's tests (tests/intercept/test_sim*.py).

Builds nothing itself beyond calling `make -C libintercept sim test-progs`
once per session; runs rank processes in their own sessions, and guarantees
that every process started and every /dev/shm segment created is gone
afterwards (by PID and by the per-test JITSIM_JOB tag).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BUILD = Path(os.environ.get("BUILD", ROOT / "build"))
SIM = BUILD / "sim"
PROGS = BUILD / "sim-tests"
SHM = Path("/dev/shm")

_built = False


def build() -> None:
    """Build the stand-in and its test programs (incremental; once per session)."""
    global _built
    if _built:
        return
    subprocess.run(
        ["make", "-s", "-C", str(ROOT / "libintercept"), f"BUILD={BUILD}", "sim", "test-progs"],
        check=True,
        capture_output=True,
        text=True,
    )
    _built = True


def shm_entries(job: str) -> list[Path]:
    return sorted(SHM.glob(f"jitsim-{job}-*"))


@dataclass
class Ranks:
    """Rank processes of one test job; use as a context manager."""

    tmp: Path
    job: str = field(default_factory=lambda: "t" + uuid.uuid4().hex[:12])
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, mode: str, nranks: int, env_of=None, only=None) -> list[subprocess.Popen]:
        for r in only if only is not None else range(nranks):
            env = {**os.environ, "JITSIM_JOB": self.job}
            for k in [k for k in env if k.startswith("JITSIM_") and k != "JITSIM_JOB"]:
                env.pop(k)
            env.update((env_of(r) if env_of else None) or {})
            p = subprocess.Popen(
                [str(PROGS / "sim_nccl"), mode, str(r), str(nranks), str(self.tmp)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                start_new_session=True,
            )
            self.procs.append(p)
        return self.procs

    def wait(self, procs=None, timeout: float = 30) -> list[str]:
        outs = []
        deadline = time.monotonic() + timeout
        for p in procs if procs is not None else self.procs:
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.close()
                raise AssertionError(f"rank pid {p.pid} did not finish in {timeout}s") from None
            outs.append(out)
            assert p.returncode == 0, f"rank pid {p.pid} exited {p.returncode}:\n{out}"
        return outs

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                # SIGKILL works on stopped processes too; wake them anyway so
                # nothing lingers in T state.
                for sig in (signal.SIGKILL, signal.SIGCONT):
                    try:
                        os.kill(p.pid, sig)
                    except ProcessLookupError:
                        pass
            try:
                p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for e in shm_entries(self.job):
            e.unlink(missing_ok=True)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_stopped(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} never stopped")
