"""One failure episode's state, and the agent's book of episodes.

``Failure`` is an explicit state machine; its stage only moves forward, one
stage at a time, through the method named after the new stage:

    DETECTED   recovery/detect.py saw the failure (or a preemption began one)
    SAVING     ``saving_started``: the episode asks live workers to save (episode.py)
    STOPPED    ``stopped(t)``: every worker of this node is gone
    DECIDED    ``decided(step)``: the job-wide restore step is set (restore.py)
    RESTARTED  ``restarted(t)``: the agent restarts the workers
    RESUMED    ``resumed()``: the first minibatch after the restart finished

STOPPED stands between saving and deciding because the decision reads the
replicas this node saved, final only once every worker is gone; and the ends
that take no decision happen there: ranks that diverged or refused, a full
disk, or a job that finished despite the failure. A preemption ends an episode
wherever it stands (recovery/preempted.py reads its facts, moves no stage).
A move to any other stage raises ``IllegalTransition``: a programming error.

Besides its stage an episode gathers facts (what the reports said, which
workers exited or were killed, what the other nodes knew); they are written
through the ``note_*`` methods and read anywhere.

``RecoveryBook`` holds the agent's episodes: the one being handled, the one
restarted and waiting for its first minibatch, and this round's exit codes.

Agent's main thread only (the monitor loop, the reports it reads, torch's
restart and shutdown paths run there); nothing here takes a lock.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable

from jitckpt.wire.config import EXIT_DIVERGED, EXIT_REFUSED, EXIT_SAVED

from ..preempt import STOP_REASONS


class Stage(enum.Enum):
    DETECTED = 1
    SAVING = 2
    STOPPED = 3
    DECIDED = 4
    RESTARTED = 5
    RESUMED = 6


_NEXT = {Stage.DETECTED: Stage.SAVING, Stage.SAVING: Stage.STOPPED, Stage.STOPPED: Stage.DECIDED,
         Stage.DECIDED: Stage.RESTARTED, Stage.RESTARTED: Stage.RESUMED}


class IllegalTransition(RuntimeError):
    """A failure episode asked to move to a stage that does not follow its own."""

    def __init__(self, stage: Stage | None, to: Stage | str, why: str = "") -> None:
        nxt = _NEXT.get(stage) if stage is not None else None
        legal = f"only {nxt.name} follows it" if nxt else "it is the last stage"
        frm = stage.name if stage is not None else "(no episode)"
        self.stage, self.to = stage, to.name if isinstance(to, Stage) else to
        super().__init__(f"failure episode: no transition {frm} -> {self.to} ({why or legal})")


class Failure:
    """One failure episode on this node: its stage and what is known about it."""

    def __init__(self, t: float, *, fault_t: float | None = None, progress: int = -1) -> None:
        self._stage = Stage.DETECTED
        self.detected_t = t
        self.fault_t = fault_t  # when the fault happened: an injector's stamp, else the failed rank's last sign of life
        self.saved: dict[int, dict] = {}
        self.saving: set[int] = set()
        self.done: set[int] = set()  # ranks that will not save (failed, skipped, exited)
        self.reasons: dict[int, str] = {}
        self.responded: set[int] = set()  # ranks that reported anything since the failure
        # the step each rank last said it is at (failure_detected, save_started):
        # a live rank ahead of the newest saved replica may still save a newer one
        self.rank_step: dict[int, int] = {}
        self.progress = progress
        self.minibatch_s: list[float] = []
        self.killed: list[int] = []
        self.restore_step: int | None = None
        self.restart_t: float | None = None
        self.ckpt_done_t: float | None = None
        self.stopped_t: float | None = None  # every worker of this node gone
        self.rdzv_t: float | None = None  # the next round's rendezvous done
        self.handling_since = time.monotonic()
        self.diverged = False  # ranks loaded different states: never train on
        self.refused = False  # a worker refused what the script asked (jitckpt/refusal.py): never restart
        self.no_space: str | None = None  # a save failed on a full disk (jitckpt/save_space.py): its line
        # rank -> (reason, t) of its first report of a stop signal (preempt.STOP_REASONS): a preemption
        # when every rank of the node had one the agent did not send (launcher/preempt.py)
        self.stop_reports: dict[int, tuple[str, float]] = {}

    @property
    def stage(self) -> Stage:
        return self._stage

    def _to(self, stage: Stage) -> None:
        if _NEXT.get(self._stage) is not stage:
            raise IllegalTransition(self._stage, stage)
        self._stage = stage

    # -- transitions ---------------------------------------------------------------

    def saving_started(self) -> None:
        self._to(Stage.SAVING)

    def stopped(self, t: float) -> None:
        """Every worker of this node is gone at ``t``: what was saved is final. Without
        a report that completed the saved set, its completion is taken as ``t``."""
        self._to(Stage.STOPPED)
        self.stopped_t = t
        if self.ckpt_done_t is None and self.saved:
            self.ckpt_done_t = t

    def decided(self, step: int | None) -> None:
        """The job restores ``step`` (None: the workers start without a checkpoint)."""
        self._to(Stage.DECIDED)
        self.restore_step = step

    def restarted(self, t: float) -> None:
        self._to(Stage.RESTARTED)
        self.restart_t = t

    def resumed(self) -> None:
        self._to(Stage.RESUMED)

    # -- facts -----------------------------------------------------------------------

    def note_hang(self, rank: int, why: str) -> None:
        """The hang watch named ``rank`` (hang.py); a stopped or deaf rank cannot
        answer the request to save: the episode does not wait for it."""
        self.reasons[rank] = f"hang: {why}"
        if why in ("stopped", "deaf"):
            self.done.add(rank)

    def note_exit(self, rank: int, code: int) -> None:
        """A worker exited with ``code`` during the episode: it saves nothing more."""
        self.done.add(rank)
        if code != EXIT_SAVED:
            self.reasons.setdefault(rank, f"exit {code}")
        if code == EXIT_DIVERGED:
            self.diverged = True
        elif code == EXIT_REFUSED:
            self.refused = True

    def note_killed(self, rank: int) -> None:
        self.killed.append(rank)

    def note_rendezvous(self, t: float) -> None:
        """The restarted round's rendezvous is done (a stage of the recovery record)."""
        if self._stage is not Stage.RESTARTED:
            raise IllegalTransition(self._stage, "rendezvous", "a rendezvous is noted only after a restart")
        self.rdzv_t = t

    def note_job_facts(self, progress: int, fault_t: float | None, last_alive: float | None) -> None:
        """What the job's decision learnt from every node (a rank's step, a fault's time)."""
        self.progress = max(self.progress, progress)
        if fault_t is not None:
            self.fault_t = min(fault_t, self.fault_t or fault_t)
        if self.fault_t is None and last_alive:
            self.fault_t = min(last_alive, self.detected_t)

    def note_fault_at(self, t: float | None) -> None:
        """The fault's time when nothing stamped it yet (the failed ranks' last sign of life)."""
        if self.fault_t is None:
            self.fault_t = t

    def note_report(self, ev: str, rank: int | None, m: dict, local_shards: Callable[[], Iterable[str]]) -> None:
        """A worker's report of this round read during the episode (recovery/reports.py);
        ``local_shards()``: the shards this node's ranks save."""
        if rank is not None and ev != "fault_injected":
            self.responded.add(rank)
        if ev == "fault_injected" and self.fault_t is None:
            self.fault_t = m["t"]
        if m.get("minibatch_s"):
            self.minibatch_s.append(m["minibatch_s"])
        if "step" in m:
            self.progress = max(self.progress, int(m["step"]))
            if rank is not None and ev in ("failure_detected", "save_started"):
                self.rank_step[rank] = int(m["step"])
        if ev == "failure_detected":
            self.detected_t = min(self.detected_t, m["t"])
            if m.get("reason") in STOP_REASONS and rank not in self.stop_reports:
                self.stop_reports[rank] = (m["reason"], m["t"])
            self.reasons.setdefault(rank, m.get("reason", "?"))
            if m.get("reason") == "sdc_suspect":  # outranks the SIGTERM the episode may have sent it first
                self.reasons[rank] = "sdc_suspect"
        elif ev == "save_started":
            self.saving.add(rank)
        elif ev == "checkpoint_saved":
            self.saving.discard(rank)
            self.saved[rank] = m
            shards = set(local_shards()) or {"0"}
            if self.ckpt_done_t is None and shards <= {s["shard"] for s in self.saved.values()}:
                self.ckpt_done_t = m["t"]
        elif ev in ("checkpoint_failed", "checkpoint_skipped"):
            self.saving.discard(rank)
            self.done.add(rank)
            if m.get("no_space") and self.no_space is None:
                self.no_space = str(m.get("error", "no space for the JIT checkpoint"))


class RecoveryBook:
    """The agent's failure episodes.

    ``current``: the episode being handled (from its detection to its restart,
    or to the end of the job); ``pending``: the one restarted and waiting for
    its first minibatch (the recovery record is written then); ``exited``:
    rank -> exit code of this node's workers this round, written once per exit
    by the episode (episode.py) and the preemption stop (preempted.py), read by
    the restart's report, cleared at each restart. Agent's main thread only."""

    def __init__(self) -> None:
        self.current: Failure | None = None
        self.pending: Failure | None = None
        self.exited: dict[int, int] = {}

    def detected(self, f: Failure) -> None:
        """``f`` (new) becomes the episode being handled. One is handled at a time:
        torch's agent restarts or stops after each, so none is current here."""
        if f.stage is not Stage.DETECTED:
            raise IllegalTransition(f.stage, Stage.DETECTED, "only a new episode is detected")
        if self.current is not None:
            raise IllegalTransition(self.current.stage, Stage.DETECTED,
                                    "a new episode detected while this one is still handled")
        self.current = f

    def preempted(self, t: float) -> Failure:
        """The episode a preemption's stop reads the workers' reports into: the
        current one, else a new one detected at ``t``."""
        if self.current is None:
            self.current = Failure(t)
        return self.current

    def finished(self) -> None:
        """The job finished despite the current episode (every shard's replica ran
        its last minibatch before it): nothing to decide or restart."""
        f = self.current
        if f is None or f.stage is not Stage.STOPPED:
            raise IllegalTransition(f.stage if f else None, "finished", "only a STOPPED episode ends in a finished job")
        self.current = None

    def restarted(self, t: float) -> Failure | None:
        """The agent restarts its workers at ``t``: the current episode (if the
        restart is for one, not for a membership change) waits for its first
        minibatch, replacing one restarted before that never got to it; this
        round's exits are forgotten. The episode restarted, or None."""
        f = self.current
        if f is not None:
            f.restarted(t)
            self.pending = f
        self.current = None
        self.exited.clear()
        return f

    def rendezvous_done(self, t: float) -> None:
        if self.pending is not None:
            self.pending.note_rendezvous(t)

    def resumed(self) -> Failure | None:
        """The first minibatch after a restart finished (or a rank finished the
        job right after its restore): the episode that waited for it, once; None
        when none waits."""
        f, self.pending = self.pending, None
        if f is not None:
            f.resumed()
        return f
