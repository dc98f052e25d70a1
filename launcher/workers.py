"""This node's worker processes, wherever they run now, and the facts the
agent reads about them (/proc: state, CPU time).

A worker is normally a child of torchrun's process context (a subprocess,
or a forkserver child under the warm start). A migrated worker runs on
another node (or, after a lost device, as a restored process here) and is
reached through a handle with the same poll / wait / signal surface.
Main thread only.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from jitckpt.torch_compat import elastic
from jitckpt.wire import layout

from .migration.agents import Remote


@dataclass
class Proc:
    pid: int  # 0: runs on another node (migrated), reached through send
    poll: Callable[[], int | None]
    wait: Callable[[], object]
    send: Callable[[int], None] | None = None
    rank: int = -1
    # rank -> when this agent last sent it SIGTERM (a request to save): a stop signal a
    # worker reports before that, or unasked, came from elsewhere (launcher/preempt.py)
    asked: dict[int, float] | None = None

    def signal(self, sig: int) -> None:
        if sig == signal.SIGTERM and self.asked is not None:
            self.asked[self.rank] = time.time()
        if self.send is not None:
            self.send(sig)
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class Whereabouts:
    """Where this node's migratable ranks run: the host PID of each rank's
    namespace init (what CRIU dumps), its output file (held open, on this
    node's disk), and the ranks that left their first process (a ``jitrun
    migrate`` to another node, or a lost device's process moved)."""

    moved: dict[int, object] = field(default_factory=dict)
    ns_pids: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, str] = field(default_factory=dict)
    asked: dict[int, float] = field(default_factory=dict)  # Proc.asked, this round's (cleared by the agent)

    def reset(self, ranks: dict[str, dict]) -> None:
        self.ns_pids = {int(r): w["pid"] for r, w in ranks.items() if w["pid"]}
        self.outputs = {int(r): w["output"] for r, w in ranks.items()}
        self.moved.clear()

    def procs(self, pcontext, wg: WorkerGroup) -> dict[int, Proc]:
        """Global rank -> process, for both of torchrun's process contexts
        (subprocesses, or forkserver children with the warm start)."""
        assert pcontext is not None
        if hasattr(pcontext, "subprocess_handlers"):
            procs = {wg.workers[lr].global_rank: Proc(h.proc.pid, h.proc.poll, h.proc.wait)
                     for lr, h in pcontext.subprocess_handlers.items()}
        else:
            procs = {wg.workers[lr].global_rank: Proc(p.pid, _mp_poll(p), p.join)
                     for lr, p in enumerate(elastic.processes(pcontext) or ())}
        for r, remote in self.moved.items():  # its wrapper here ended with the dump
            procs[r] = Proc(getattr(remote, "pid", 0), remote.poll, remote.wait, remote.send)
        for r, p in procs.items():
            p.rank, p.asked = r, self.asked
        return procs


def _mp_poll(p) -> Callable[[], int | None]:
    return lambda: p.exitcode


_TICK = os.sysconf("SC_CLK_TCK")


def _fields(path: str) -> list[str] | None:
    """The fields of a /proc stat file after the command name (state first), or None (gone).
    Read directly, not through psutil: the agent looks at every rank each tick, and a
    psutil.Process reads the file twice more to build itself."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # the name is in parentheses and may hold spaces and parentheses of its own
    return raw[raw.rfind(b")") + 2:].decode("ascii", "replace").split()


def _stat(pid: int) -> list[str] | None:
    return _fields(f"/proc/{pid}/stat") if pid > 0 else None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (None: gone)."""
    f = _stat(pid)
    if f is None or len(f) < 13:
        return None
    return (int(f[11]) + int(f[12])) / _TICK  # utime, stime: fields 14 and 15 of proc(5)


def run_state(pid: int) -> str:
    """"stopped" (state T, e.g. SIGSTOP), "dead" (gone or a zombie) or "running"."""
    f = _stat(pid)
    if not f:
        return "dead"
    if f[0] == "T":
        return "stopped"
    return "dead" if f[0] in ("Z", "X", "x") else "running"


def is_stopped(pid: int) -> bool:
    return run_state(pid) == "stopped"


def has_runnable_thread(pid: int) -> bool:
    """Whether a thread of ``pid`` is in state R (running or waiting for a CPU):
    a process that holds the GIL in a busy C loop has one, a blocked one not."""
    try:
        tids = os.listdir(f"/proc/{pid}/task") if pid > 0 else []
    except OSError:
        return False
    return any((f := _fields(f"/proc/{pid}/task/{tid}/stat")) and f[0] == "R" for tid in tids)


def alive(pid: int) -> bool:
    return pid > 0 and psutil.pid_exists(pid)


def forked_progress(pcontext, wg: WorkerGroup, procs: dict[int, Proc]) -> RunResult:
    """Success path for forked workers, without MultiprocessContext._poll:
    its ProcessContext.join(-1) answers any failure by terminating every
    other worker and waiting for them, which would hang on a stopped rank
    and race our JIT saves. A forked worker returns its value through a
    queue and then waits until the parent has read them all; a worker
    started through jitckpt's bootstrap ends with os._exit(0) before that
    (see jitckpt._bootstrap), so exit code 0 counts as done."""
    returned = elastic.collect_returns(pcontext)
    if returned is None:
        return RunResult(state=WorkerState.HEALTHY)
    for p in procs.values():
        p.wait()
    if any(p.poll() != 0 for p in procs.values()):
        return RunResult(state=WorkerState.HEALTHY)  # a failed exit: the next tick handles it
    values = {wg.workers[lr].global_rank: v for lr, v in returned.items()}
    pcontext.close()
    return RunResult(state=WorkerState.SUCCEEDED, return_values=values)


def _started(pid: int) -> float | None:
    """When ``pid`` started: with the PID, what tells a later jitrun that a worker of
    this run still lives (launcher/joblock.py), not a process that reused its PID."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError):
        return None


def write_ranks(root: Path, procs: dict[int, Proc], where: Whereabouts, node, attempt: int) -> None:
    """This node's ranks, their PIDs and start times, in <jit dir>/ranks.json (a
    migratable rank's is the worker's, not its namespace wrapper's; a rank
    migrated to another node is listed there)."""
    ranks = {r: {"pid": pid, "started": _started(pid), "node": node.node_id, "host": node.host, "attempt": attempt}
             for r, p in procs.items() if not isinstance(where.moved.get(r), Remote)
             for pid in (where.ns_pids.get(r, p.pid),)}
    try:
        layout.update_ranks(root, ranks, replace=True)
    except OSError as e:
        print(f"jitrun: could not write {root / layout.RANKS_FILE}: {e}", file=sys.stderr, flush=True)
