"""When a failure episode starts: a worker exited non-zero, a worker reported
a failure, another node's agent is handling one, the hang watch confirmed a
hang (hang.py), or a rank is stopped after its peers finished (no collective
is left to time out). Agent's main thread."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..workers import Proc, is_stopped
from .failure import Failure
from .reports import ReportBook


class Detector:
    def __init__(self, book: ReportBook, events) -> None:
        self._book = book
        self._events = events
        # an injected fault's announcement only timestamps the failure; detection
        # is the healthy ranks' (or an exit), as it would be for a real fault
        self._fault_t: float | None = None
        self._fault_step = -1  # the step an injected fault announced, read before the failure was seen

    def check(self, msgs: list[dict], codes: dict[int, int | None], procs: dict[int, Proc],
              other_node_failed: bool, hung: dict[int, str] | None = None,
              peers_finished: Callable[[], bool] = lambda: False) -> Failure | None:
        """A new episode, or None. ``msgs``: this node's reports read this tick;
        ``codes``: this node's workers' exit codes (None: running); ``hung``:
        a hang the hang watch confirmed (rank -> why; empty: a lost collective);
        ``peers_finished()``: has a rank of another node finished the job (asked
        only when a rank here is stopped)."""
        failed = any(c not in (None, 0) for c in codes.values()) or hung is not None
        now = [m for m in msgs if self._book.of_this_round(m)]
        for m in now:
            if m["event"] == "fault_injected":
                self._fault_t = m["t"] if self._fault_t is None else min(self._fault_t, m["t"])
                self._fault_step = max(self._fault_step, int(m.get("step", -1)))
        reported = any(m["event"] == "failure_detected" for m in now) or (not failed and other_node_failed)
        self._book.finished |= {m["rank"] for m in msgs if m["event"] == "finished"}
        if not failed and not reported:
            # a rank stopped in its last minibatch would be waited on forever
            stopped = [r for r, c in codes.items() if c is None and procs[r].pid and is_stopped(procs[r].pid)]
            if stopped and (self._book.finished or peers_finished()):
                failed = True
                for r in stopped:
                    self._events.emit("failure_detected", rank=r, reason="stopped after peers finished")
        if not (failed or reported):
            return None
        # the failing rank said its step before it died, possibly a poll earlier: without it a
        # recovery with no surviving reporter (every rank killed) could not say what it redid
        f = Failure(time.time(), fault_t=self._fault_t, progress=self._fault_step)
        self._fault_t, self._fault_step = None, -1
        for r, why in (hung or {}).items():
            f.note_hang(r, why)
        return f
