"""One failure episode on this node: from the first failure signal to every
local worker gone, with as many replicas saved as the job needs.

1. every live worker is asked to save now (SIGTERM; the worker runtime turns
   it into a JIT save at the next consistent point);
2. the agent waits until every shard has a complete checkpoint from this
   failure and no live rank could still publish a newer one, no saver is
   left, or ``timeout + save_timeout`` passed;
3. savers that published exit on their own; whatever still runs (stopped or
   hung ranks, a saver of a replica nobody needs) is SIGKILLed.

The episode's stage moves DETECTED -> SAVING -> STOPPED here (failure.py).
Agent's main thread only.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from jitckpt.wire.config import EXIT_SAVED

from ..preempt import ASK_AFTER_S, STOP_REASONS
from ..workers import Proc, is_stopped
from .failure import Failure

DIVERGED = ("jitrun: ABORT: the ranks of this job loaded different checkpoint steps or states (see the workers' "
            "'REFUSING TO TRAIN' lines); no training step was taken and the job is not restarted. Check that every "
            "node sees the same jit dir contents or can reach the others.")


def no_space_line(f: Failure, jit) -> str:
    """The one line of a job stopped by a full jit dir (agent._handle_failure)."""
    from jitckpt.wire import layout

    replicas, _bad = layout.scan(jit.root, jit.job_id, jit.identity)
    step = layout.select_step(replicas, {r.shard for r in replicas})
    kept = (f"the newest complete checkpoint here, step {step}, is kept" if step is not None
            else "no complete checkpoint here yet")
    return f"jitrun: the job stops, not restarting on a full disk ({kept}): {f.no_space}"


def refused_line(refused: tuple[int, str] | None) -> str:
    """The one line of a job stopped by a worker's refusal: its reason when its report came
    (the worker's own line may be lost with its last output), else where to look."""
    head = "jitrun: the job stops, not restarting (every attempt would refuse the same way): "
    if refused is not None:
        rank, why = refused
        return f"{head}rank {rank} refused to train: {why}"
    return f"{head}a worker refused to train (its '[jitckpt] rank N: REFUSED:' line says why and how to fix it)"


UNHEARD_S = 0.5  # a healthy rank answers the SIGTERM from its watcher thread within this
SAVE_GRACE_S = 1.0  # another replica of a complete step mid-save: not needed, not waited for longer
EXIT_GRACE_S = 2.0  # savers that published exit on their own within this


class Episode:
    """Runs steps 1-3 for ``f`` over this node's ``procs``.

    ``exited``: rank -> exit code of this node's workers (shared with the
    agent, which clears it at a restart); ``shards``: rank -> shard from the
    reports; ``wait(pids, seconds)`` blocks until one of them exits or a
    report arrives; ``poll()`` reads new reports into ``f``; ``check()`` may
    raise to end the episode where it stands (its workers left to the caller)."""

    def __init__(self, f: Failure, procs: dict[int, Proc], *, exited: dict[int, int], shards: dict[int, str],
                 timeout_s: float, save_timeout_s: float, wait: Callable[[list[int], float], None],
                 poll: Callable[[], object], events, check: Callable[[], None] = lambda: None) -> None:
        self.f = f
        self.procs = procs
        self.exited = exited
        self.shards = shards
        self.timeout_s = timeout_s
        self.save_timeout_s = save_timeout_s
        self.wait = wait
        self.poll = poll
        self.events = events
        self.check = check  # raises to leave the episode (a preemption: launcher/preempt.py)

    def run(self) -> None:
        self.f.saving_started()
        self._ask_and_wait()
        self._kill_the_rest()
        t = time.time()
        self.poll()  # the reports the last savers wrote before they exited
        self.f.stopped(t)

    def _note_exits(self) -> list[int]:
        """Record new exits; the ranks still running."""
        codes = {r: h.poll() for r, h in self.procs.items()}
        for r, c in codes.items():
            if c is not None and r not in self.exited:
                self.exited[r] = c
                self.f.note_exit(r, c)
                self.events.emit("worker_exit", rank=r, exitcode=c,
                                 signal=signal.Signals(-c).name if c < 0 else None)
        return [r for r, c in codes.items() if c is None]

    def _ask_and_wait(self) -> None:
        f = self.f
        deadline = time.monotonic() + self.timeout_s + self.save_timeout_s
        termed: set[int] = set()
        termed_at = time.monotonic()
        grace_until: float | None = None
        while True:
            self.check()
            alive = self._note_exits()
            # Ask live workers to save now instead of waiting for their collectives
            # to time out; a stopped rank keeps it pending and is killed below. Not
            # at once when the failure so far is stop signals: a preemption's reaches
            # every rank, and each must say it got it before it is asked (preempt.py).
            hold = self._stop_signals_only() and time.monotonic() - termed_at < ASK_AFTER_S
            for r in alive:
                if r not in termed and not hold:
                    termed.add(r)
                    self.procs[r].signal(signal.SIGTERM)
            if not alive:
                return
            complete = (set(self.shards.values()) or {"0"}) <= {m["shard"] for m in f.saved.values()}
            if complete:
                if self._newer_may_come(alive, termed_at):
                    pass  # a live replica is ahead of the saved step: its save is the one to restore
                elif not (f.saving & set(alive)):
                    return
                elif grace_until is None:
                    grace_until = time.monotonic() + SAVE_GRACE_S
                elif time.monotonic() > grace_until:
                    return
            elif not f.saving & set(alive) and not self._may_still_save(alive, termed_at):
                return  # no complete checkpoint will come; fall back to an older one
            if time.monotonic() > deadline:
                return
            self.wait([self.procs[r].pid for r in alive if self.procs[r].pid], 0.1)
            self.poll()

    def _stop_signals_only(self) -> bool:
        return bool(self.f.reasons) and all(why in STOP_REASONS for why in self.f.reasons.values())

    def _kill_the_rest(self) -> None:
        f = self.f
        exit_by = time.monotonic() + EXIT_GRACE_S
        while time.monotonic() < exit_by:
            savers = [self.procs[r].pid for r in f.saved if r in self.procs and self.procs[r].poll() is None]
            if not savers:
                break
            if any(savers):
                self.wait([p for p in savers if p], exit_by - time.monotonic())
            else:  # only migrated ranks: their exits come through the store
                time.sleep(0.05)
        for r, h in self.procs.items():
            if h.poll() is None:
                f.note_killed(r)
                h.signal(signal.SIGKILL)
        if f.killed:
            self.events.emit("ranks_killed", ranks=sorted(f.killed), signal="SIGKILL")
        for h in self.procs.values():
            h.wait()
        for r, h in self.procs.items():
            c = h.poll()
            if r not in self.exited and c is not None:  # savers that left after the loop, the killed
                self.events.emit("worker_exit", rank=r, exitcode=c, killed=r in f.killed,
                                 signal=signal.Signals(-c).name if c < 0 else None)

    def _possible_savers(self, alive: list[int], since: float, grace: float) -> list[int]:
        """Live ranks that could still publish a checkpoint: not one without a
        save_fn, one already done or saved, one that is stopped, or one that
        has said nothing for ``grace`` since it was asked to save (a healthy
        rank answers at once from its watcher thread; a rank hung holding the
        GIL never does)."""
        f, now = self.f, time.monotonic()
        return [r for r in alive if r in self.shards and r not in f.done and r not in f.saved
                and not is_stopped(self.procs[r].pid) and (r in f.responded or now - since <= grace)]

    def _newer_may_come(self, alive: list[int], since: float) -> bool:
        """Every shard has a replica, but could a live rank still publish a newer
        step? One that is saving (or will save at its next minibatch start) a
        step past the newest saved, or one that has not answered yet: a rank
        whose failure was its own SIGTERM saves at its minibatch start while its
        peer completes that minibatch and moves on; restoring the first replica
        would redo two minibatches."""
        f = self.f
        newest = max(int(m["step"]) for m in f.saved.values())
        return any(f.rank_step[r] > newest if r in f.rank_step else r not in f.responded
                   for r in self._possible_savers(alive, since, UNHEARD_S))

    def _may_still_save(self, alive: list[int], since: float) -> bool:
        """Could a live rank still publish a checkpoint (see _possible_savers)?"""
        grace = max(2.0, min(self.timeout_s, 10.0))
        return bool(self._possible_savers(alive, since, grace))


def culprits(codes: dict[int, int | None], life: dict[int, tuple[float, float]]) -> list[int]:
    """The ranks torchrun's failure report names, earliest last sign of life
    first: those that failed, not the healthy ones that saved (exit 75)."""
    bad = [r for r, c in codes.items() if c not in (0, EXIT_SAVED)] or [r for r, c in codes.items() if c != 0]
    return sorted(bad, key=lambda r: life.get(r, (0, float("inf")))[1])


def failed_ranks(f: Failure | None, exited: dict[int, int]) -> list[int]:
    """This node's ranks that failed (not the ones that saved and exited 75)."""
    killed, saved = (set(f.killed), set(f.saved)) if f else (set(), set())
    failed = ({r for r, c in exited.items() if c not in (0, EXIT_SAVED)} | killed) - saved
    # a replica whose state differed from the majority's (jitckpt/verify/verifier.py) saved the verified
    # state like the others, but its device is suspect: the scheduler hook sees it as failed
    return sorted(failed | sdc_suspects(f, exited))


def sdc_suspects(f: Failure | None, exited: dict[int, int]) -> set[int]:
    """This node's ranks named as the odd one out of a replica state check."""
    return {r for r, why in (f.reasons if f else {}).items() if why == "sdc_suspect" and r in exited}


def torchrun_failures(procs: dict[int, Proc], local_of: dict[int, int], error_files: dict,
                      life: dict[int, tuple[float, float]]) -> dict:
    """What torchrun's failure report shows when restarts run out: the first
    failure as root cause (earliest last sign of life first). An error file a
    killed worker left empty or torn is reported, not read (error_files.py)."""
    from ..error_files import TolerantProcessFailure  # torch's elastic package, only when needed

    codes = {r: h.poll() for r, h in procs.items()}
    return {r: TolerantProcessFailure(local_rank=local_of[r], pid=procs[r].pid, exitcode=codes[r],
                                     error_file=error_files[local_of[r]])
            for r in culprits(codes, life)}


def last_alive(f: Failure, exited: dict[int, int], life: dict[int, tuple[float, float]]) -> float | None:
    """When the first of this node's failed ranks last used CPU."""
    failed = set(f.killed) | {r for r, c in exited.items() if c not in (0, EXIT_SAVED, 76)}
    times = [life[r][1] for r in failed if r in life]
    return min(times) if times else None
