"""The agent's side of a preemption (launcher/preempt.py says what it is and how
the agent learns of it): this node's workers finish their JIT saves within the
grace period (``stop_workers``), then the outcome: the exit code, the one line
for the operator and the ``preempted`` record (``outcome``). Agent's main thread."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from jitckpt.wire import layout

from ..preempt import ASK_AFTER_S, EXIT_PREEMPTED, Preemption
from ..workers import Proc
from .failure import Failure


def _answered(f: Failure, r: int) -> bool:
    """The worker said it is saving, saved or cannot: asking again changes nothing."""
    return r in f.rank_step or r in f.saved or r in f.done


def stop_workers(pre: Preemption, procs: dict[int, Proc], f: Failure, *, exited: dict[int, int],
                 wait: Callable[[list[int], float], None], poll: Callable[[], object], events) -> list[int]:
    """Let this node's workers finish their JIT save and exit, within the grace
    period; SIGKILL what is left then (or at a second signal). The ranks killed."""
    pre.handling = True
    asked: set[int] = set()
    while True:
        poll()
        alive = _note_exits(procs, exited, events)
        if not alive:
            return []
        now = time.monotonic()
        if pre.again or now >= pre.deadline():
            return _kill(procs, alive, events, "second signal" if pre.again else "grace period over")
        for r in alive:
            if r not in asked and (_answered(f, r) or now - pre.t0 >= ASK_AFTER_S):
                asked.add(r)
                if not _answered(f, r):
                    procs[r].signal(signal.SIGTERM)
        wait([procs[r].pid for r in alive if procs[r].pid], min(0.1, pre.deadline() - now))


def _note_exits(procs: dict[int, Proc], exited: dict[int, int], events) -> list[int]:
    alive = []
    for r, p in procs.items():
        c = p.poll()
        if c is None:
            alive.append(r)
        elif r not in exited:
            exited[r] = c
            events.emit("worker_exit", rank=r, exitcode=c, signal=signal.Signals(-c).name if c < 0 else None)
    return alive


def _kill(procs: dict[int, Proc], ranks: list[int], events, why: str) -> list[int]:
    for r in ranks:
        procs[r].signal(signal.SIGKILL)
    events.emit("ranks_killed", ranks=sorted(ranks), signal="SIGKILL", why=why)
    for r in ranks:
        procs[r].wait()
        c = procs[r].poll()
        events.emit("worker_exit", rank=r, exitcode=c, killed=True,
                    signal=signal.Signals(-c).name if c is not None and c < 0 else None)
    return sorted(ranks)


def outcome(pre: Preemption, f: Failure | None, *, root: Path, shards: set[str],
            killed: list[int], exited: dict[int, int], events) -> tuple[int, str]:
    """(exit code, the one line for the operator), and a ``preempted`` event.
    Saved: the newest step with a published replica of every shard is not
    behind any rank's progress (at most the minibatch in flight is redone)."""
    pub = layout.published(root)
    step = max((s for s, have in pub.items() if (shards or {"0"}) <= have), default=None)
    steps = [*(f.rank_step.values() if f else ()), *(int(m["step"]) for m in (f.saved.values() if f else ()))]
    progress = max(steps, default=-1)  # -1: no rank reported a step (none trained this round)
    saved = step is not None and step >= progress
    finished = bool(exited) and not killed and all(c == 0 for c in exited.values()) and not (f and f.saved)
    events.emit("preempted", signal=pre.name, source=pre.source, step=step, progress=progress if progress >= 0
                else None, saved=saved, killed=killed, grace_s=pre.grace_s, finished=finished,
                seconds=round(time.monotonic() - pre.t0, 3))
    sig = f"jitrun: preempted ({pre.name}{', to the workers' if pre.source == 'workers' else ''})"
    if finished:
        return 0, f"{sig} after this node's workers finished the job; its result stands"
    if saved and progress < 0:  # e.g. during a restart: what the job would have resumed from
        return EXIT_PREEMPTED, (f"{sig} before any rank reported training progress; the newest checkpoint is step "
                                f"{step}; relaunch the same command to resume from it")
    if saved:
        return EXIT_PREEMPTED, f"{sig} at step {step}; saved; relaunch the same command to resume"
    if progress < 0:
        return EXIT_PREEMPTED, (f"{sig} before any rank reported training progress; nothing saved; relaunching the "
                                "same command starts from step 0")
    why = _why_not(pre, killed, events, since=min(f.detected_t, pre.t0_wall) if f else pre.t0_wall)
    at = f" at step {progress}"
    if step is None:
        return EXIT_PREEMPTED, f"{sig}{at}; NOT saved ({why}); relaunching the same command starts from step 0"
    return EXIT_PREEMPTED, (f"{sig}{at}; NOT saved ({why}); relaunch the same command to resume from step {step}"
                            + (f" ({progress - step} minibatches redone)" if progress > step else ""))


def _why_not(pre: Preemption, killed: list[int], events, since: float) -> str:
    if killed:
        return ("a second signal ended the save" if pre.again else
                f"the save did not end within the grace period, --jit-preempt-grace {pre.grace_s:g} s")
    for e in reversed(events.events):
        if e["event"] in ("checkpoint_skipped", "checkpoint_failed") and e["t"] >= since:
            return e.get("why") or e.get("error") or e["event"]
    return "no worker took a checkpoint"
