"""Preemption: SIGTERM or SIGINT for the job, from a scheduler (Slurm's ``scancel``
or ``--signal=B:TERM@N``, a Kubernetes pod deletion, a spot-instance notice) or
Ctrl-C in the job's terminal.

Whoever it reaches first (this launcher, its workers, or both, in any order),
the healthy replicas take the JIT checkpoint of the current minibatch start
(the workers' side: jitckpt/signal_watch.py), the job is not restarted, and
jitrun exits ``EXIT_PREEMPTED`` after one line (``line``): relaunching the same
command resumes from that checkpoint.

How the agent learns of it
--------------------------
* its own signal: ``Preemption``'s handler (main thread, between two
  bytecodes; installed by cli.run before anything starts, in place of
  torch's, which would raise SignalException anywhere) records the first
  signal and wakes the monitor loop (``poke``). Where no worker of this node
  runs (start-up, a rendezvous, between a failure episode and the restart:
  ``interruptible``) it raises ``Preempted`` at once, as torch's handler
  raises; elsewhere the agent raises it at its next ``check`` (the monitor
  loop, a failure episode's loop, the restart), never in the middle of a
  store call or a timeline write. A signal after the first sets ``again``.
* its workers' signals (the launcher not signalled): every rank of this node
  reported a stop signal the agent did not send (``by_workers``, at the end of
  the failure episode those reports start). One rank's stop signal alone
  (``kill`` of one worker) stays that rank's failure: the job recovers.

What the agent then does (recovery/preempted.py, from the agent's ``_shutdown``):
each live worker that has not answered yet is sent SIGTERM after ASK_AFTER_S
(a group signal has reached it already; a script's own handler should run
once), then the agent waits until every worker has exited, at most until the
grace period ends (``--jit-preempt-grace``, counted from the first signal),
and SIGKILLs what is left; a second signal ends the wait at once.

Main thread only; the handler touches only this object's fields and ``poke``.
Imports no torch: jitrun installs the handler before it imports torch.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on purpose, relaunch the same command (docs/recovery.md)
DEFAULT_GRACE_S = 15.0  # well under Slurm's KillWait and Kubernetes' terminationGracePeriodSeconds (30 s)
ASK_AFTER_S = 0.5  # a worker reached by the same signal answers from its watcher thread within this (episode.UNHEARD_S)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# what a worker reports for a SIGTERM / SIGINT it acted on (jitckpt.runtime.Runtime.on_stop_signal)
STOP_REASONS = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT}


class Preempted(Exception):
    """Unwinds the agent's run to its shutdown (launch.py maps it to EXIT_PREEMPTED)."""


def torch_signals(configured: str) -> str:
    """torchrun's ``--signals-to-handle`` without SIGTERM and SIGINT (ours; torch's
    handler would raise SignalException anywhere), for TORCHELASTIC_SIGNALS_TO_HANDLE."""
    ours = {s.name for s in STOP_SIGNALS}
    rest = [s.strip() for s in configured.split(",") if s.strip() and s.strip() not in ours]
    return ",".join(rest) or "SIGHUP"  # never empty: torch logs a traceback for an empty name


class Preemption:
    def __init__(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self.source = ""  # "launcher" or "workers"
        self.t0 = 0.0  # time.monotonic() of the first signal
        self.t0_wall = 0.0  # and time.time(), for the timeline's records
        self.again = False  # a signal after the first: stop at once
        self.handling = False  # the agent is stopping the workers: no more raising
        self.poke: Callable[[], None] = lambda: None  # wakes the agent's monitor loop (set by the agent)
        self.interruptible: Callable[[], bool] = lambda: True  # no worker of this node runs now

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.signum is None:
            self._note(signum, "launcher")
            if self.interruptible() and not self.handling:
                raise Preempted(signal.Signals(signum).name)
        else:
            self.again = True
        self.poke()

    def _note(self, signum: int, source: str) -> None:
        self.signum, self.source, self.t0, self.t0_wall = int(signum), source, time.monotonic(), time.time()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "?"

    def check(self) -> None:
        """Raise ``Preempted`` where the agent can stop (main thread)."""
        if self.signum is not None and not self.handling:
            raise Preempted(self.name)

    def deadline(self) -> float:
        return self.t0 + self.grace_s

    def by_workers(self, stop_reports: dict[int, tuple[str, float]], local_ranks: set[int],
                   asked: dict[int, float]) -> bool:
        """Did every rank of this node get a stop signal that the agent did not send
        (reported before the agent asked it to save, or never asked)? Then it is a
        preemption, noted as such. ``stop_reports``: a failure episode's
        (recovery.failure.Failure), which holds its requests back a moment for
        this (ASK_AFTER_S)."""
        stops = [stop_reports.get(r) for r in local_ranks]
        if not local_ranks or any(s is None or s[1] >= asked.get(r, float("inf"))
                                  for r, s in zip(local_ranks, stops, strict=True)):
            return False
        if self.signum is None:
            self._note(STOP_REASONS[stops[0][0]], "workers")
        return True
