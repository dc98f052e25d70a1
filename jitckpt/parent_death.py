"""A job's processes end when their jitrun agent dies (SIGKILL, the OOM killer).

Linux's ``PR_SET_PDEATHSIG`` sends a process a signal when the thread that
created it exits. The chain under jitrun:

* the warm-start fork server (a child of the agent's main thread) is bound
  with SIGKILL when it imports ``jitckpt._server_bind`` (a preload module of
  the server, launcher/warm.py): it holds no state worth saving;
* every worker is bound with SIGTERM (``bind_worker``), first thing in
  ``jitckpt._bootstrap.main``, ``attach`` (``--no-python`` Python programs)
  and ``launcher.warm.worker_main`` (forked from the server, whose death the
  binding follows): SIGTERM is the JIT save request (runtime.py's watcher),
  so a worker whose agent is gone saves its replica at the next consistent
  point and exits 75, and the next run of the same command resumes there;
* the resource tracker of multiprocessing exits on its own once every holder
  of its pipe (agent, server, workers) is gone, after unlinking what they
  leaked; the replica server and the other agent threads die with the agent.

The binding is cleared by ``fork`` and set after the process starts, so a
parent that died in between would be missed: after binding, the expected
parent (and the agent, by its PID in JITCKPT_AGENT_PID) is checked, and the
signal is sent to ourselves when it is gone. A program that is not Python
under ``--no-python``, and a ``--jit-migratable`` worker (CRIU restores the
binding against another parent), are not bound.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from .wire import contract
from .wire.layout import _alive  # the one liveness probe (kill 0; EPERM: alive)

_PR_SET_PDEATHSIG = 1


def _prctl_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def agent_gone() -> bool:
    """This worker's jitrun agent has died (False outside jitrun, and for a
    ``--jit-migratable`` worker: PID 1 of its own PID namespace sees no PID of
    the agent's, so the probe would take a live agent for a dead one)."""
    agent = contract.AGENT_PID.get()
    return bool(agent) and not contract.MIGRATABLE.get() and not _alive(agent)


def bind(sig: int, expected_parent: int | None = None, agent: int | None = None) -> bool:
    """Have ``sig`` sent to this process when its parent dies; if the parent
    (``expected_parent``) or the ``agent`` is already gone, send it now.
    False where the kernel offers no such binding."""
    if not _prctl_pdeathsig(sig):
        return False
    gone = (expected_parent is not None and os.getppid() != expected_parent) or (
        agent is not None and agent > 0 and not _alive(agent))
    if gone:
        os.kill(os.getpid(), sig)
    return True


def bind_worker(expected_parent: int | None = None) -> bool:
    """A worker's binding (SIGTERM, a JIT save request), under jitrun only."""
    agent = contract.AGENT_PID.get()
    if not agent or contract.MIGRATABLE.get():
        return False
    if expected_parent is None and os.getppid() == agent:
        expected_parent = agent
    return bind(signal.SIGTERM, expected_parent, agent)
