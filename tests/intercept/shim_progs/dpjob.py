"""Runs the `dp` program as a multi-rank job on the stand-in, with a real
torch.distributed TCPStore as the job's store (MASTER_ADDR/MASTER_PORT), as
torchrun/jitrun provide it. Used by test_shim_transparent.py and
scripts/bench_transparent.py.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import shimtest as st  # noqa: E402

FINAL = re.compile(r"FINAL rank=(\d+) pid=(\d+) dev=(\w+) host=(\w+) recoveries=(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Store:
    """A TCPStore server: in this process (torch) or in a child python."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = None
        self.store = None
        try:
            import torch.distributed as dist  # noqa: PLC0415

            self.store = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False)
        except ImportError:  # pragma: no cover - torch is a test dependency
            raise

    def close(self) -> None:
        self.store = None


def run(
    tmp: Path,
    nranks: int,
    steps: int = 6,
    per_rank_env: dict[int, dict[str, str]] | None = None,
    timeout: float = 60.0,
    on_start=None,
    **env: str,
) -> dict:
    """Starts nranks `dp` processes, waits for all; returns outputs, exit codes,
    FINAL lines, final buffers and the event lines."""
    tmp.mkdir(parents=True, exist_ok=True)
    store = Store()
    events = tmp / "events.jsonl"
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(nranks),
        "JITCKPT_SHIM_EVENTS": str(events),
        "JITCKPT_ON_HANG": "recover",
        "JITCKPT_TIMEOUT": "1",
        "JITCKPT_RECOVER_TIMEOUT": "10",
        "JITCKPT_POLL_MS": "20",
    }
    base.update(env)
    res: dict = {"rc": {}, "out": {}, "final": {}, "buf": {}, "pids": {}}
    with st.Job(tmp) as job:
        procs = []
        for r in range(nranks):
            e = dict(base, RANK=str(r), LOCAL_RANK=str(r))
            e.update((per_rank_env or {}).get(r, {}))
            e = {k: v for k, v in e.items() if v is not None}
            procs.append(job.spawn([str(st.PROGS / "dp"), str(r), str(nranks), str(steps), str(tmp)], f"r{r}", **e))
            res["pids"][r] = procs[-1].pid
        t0 = time.monotonic()
        if on_start:
            on_start(procs)
        for r, p in enumerate(procs):
            left = max(0.1, timeout - (time.monotonic() - t0))
            try:
                res["rc"][r] = p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
                res["rc"][r] = "timeout"
        res["wall"] = time.monotonic() - t0
        for r in range(nranks):
            out = job.output(f"r{r}")
            res["out"][r] = out
            m = FINAL.search(out)
            if m:
                res["final"][r] = {
                    "pid": int(m.group(2)),
                    "dev": m.group(3),
                    "host": m.group(4),
                    "recoveries": int(m.group(5)),
                }
            f = tmp / f"final.{r}"
            res["buf"][r] = f.read_bytes() if f.exists() else None
    res["store_done"] = {
        e: int(store.store.add(f"jitckpt/shim/0/done/{e}", 0)) for e in (1, 2)
    }  # the C client's ADDs, read back through torch's own client
    store.close()
    res["events"] = st.events(events)
    return res
