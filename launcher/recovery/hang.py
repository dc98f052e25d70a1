"""A hang, confirmed before anything is torn down.

Every rank publishes a status record (jitckpt/hang/status.py): whether it
waits in a collective, since when, the collective's sequence number, the hang
bound it learned from its own timing (jitckpt/hang/bound.py), and its watcher
thread's heartbeat. The agent reads this node's records every tick (a few
memory reads, no store traffic). A rank waiting past its bound is only a
suspicion; the agent then looks at the ranks where they live:

* a rank that is stopped (state T), or deaf (no heartbeat: it holds the GIL
  and never lets go) and not using CPU, is hung;
* every rank of the job waiting in a collective past its bound (the same
  one, or one still in a collective the others left), none using CPU: the
  collective is lost;
* a lagging rank that is alive (beating, computing, sleeping in a data
  loader, saving, evaluating, or inside ``jitckpt.expect_delay``) is not a
  hang: the bound stretches by another bound, and the timeline says so once
  per wait;
* a wait past the ceiling (``--jit-timeout``) with no announced delay is a
  hang whatever the laggards do.

A confirmed hang starts the failure episode (episode.py) at once, the path
of any failure: every live rank is asked to save (a healthy rank saves from
its watcher thread while its main thread still waits), and what does not
answer, the stopped or deaf rank, is SIGKILLed as soon as a replica of every
shard is saved. For a lost collective no rank is to blame: every rank saves.

A laggard on another node is not visible here: the agent posts the
suspicion once per bound as a sealed report (the reports every agent already
reads; nothing is sent in steady state), and the laggard's own agent checks
its ranks and ends a stopped or deaf one. When that agent cannot answer
because it is itself stopped or cut off (its beat in the store stands still,
recovery/alive.py), the hang is confirmed here: a whole node is gone. A lost
collective across nodes: each node's ranks wait past their bound for the
others, and each agent posts its suspicion with whether its ranks compute;
an agent that holds every other rank's word for the same collective, none
computing, while none of its own computes either, confirms it. Otherwise the
ceiling, or the process groups' backstop timeout (jitckpt/wire/contract.py
pg_timeout_s), ends it. Agent's main thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from jitckpt.hang.bound import FLOOR_S
from jitckpt.hang.status import Status, StatusReader
from jitckpt.wire import contract

from ..workers import has_runnable_thread, run_state

if TYPE_CHECKING:
    from ..workers import Proc

STALE_S = 0.5  # no heartbeat for this long (the watcher beats every 0.1 s), nothing runnable: deaf
BUSY_CPU_S = 0.05  # CPU seconds within STALE_S that count as computing


@dataclass
class Facts:
    """What the agent knows of one of its ranks at a tick."""

    status: Status | None
    state: str  # "running" | "stopped" | "dead"
    cpu_busy: bool
    runnable: bool = False  # a thread of it waits for a CPU: starved by the machine's load, not hung


@dataclass
class Verdict:
    kind: str  # "stretch" | "wait" | "hang" | "lost" | "remote"
    waiting: dict[int, float]  # the suspicious waiters: rank -> seconds waited
    bound_s: float
    seq: int  # the collective they wait in
    lagging: list[int] = field(default_factory=list)
    hung: dict[int, str] = field(default_factory=dict)  # rank -> why
    evidence: dict[int, str] = field(default_factory=dict)
    why: str = ""
    steps: dict[str, int] = field(default_factory=dict)  # the waiters' minibatches done


def _computing(facts: dict[int, Facts]) -> bool:
    """A rank here uses CPU, or has a thread waiting for one: its collective may still move."""
    return any(f.cpu_busy or f.runnable for f in facts.values())


def liveness(f: Facts, now: float) -> tuple[str, str]:
    """(class, evidence): dead | stopped | declared | deaf | alive."""
    if f.state == "dead":
        return "dead", "process gone or zombie"
    if f.state == "stopped":
        return "stopped", "process stopped (state T)"
    s = f.status
    if s is None:
        return "alive", "running (no status record)"
    if s.delay_until > now:
        return "declared", f"announced delay (jitckpt.expect_delay), {s.delay_until - now:.1f} s left"
    if s.heartbeat <= 0:
        return "alive", "running (no heartbeat thread)"
    age = now - s.heartbeat
    if age > STALE_S and not f.cpu_busy and not f.runnable:
        return "deaf", f"no heartbeat for {age:.2f} s, no CPU, no thread runnable: holds the GIL and never lets go"
    if f.cpu_busy:
        return "alive", "computing (CPU advancing)"
    if age > STALE_S:
        return "alive", f"no heartbeat for {age:.2f} s but a thread is runnable (the machine is loaded)"
    return "alive", f"heartbeat {age:.2f} s ago, idle outside collectives"


def assess(facts: dict[int, Facts], suspicious: list[int], now: float, *, world_size: int,
           ceiling_s: float | None) -> Verdict:
    """The verdict on a suspicion: ``suspicious`` ranks wait past their bound."""
    st = {r: f.status for r, f in facts.items() if f.status is not None}
    seq = max(st[r].seq for r in suspicious)
    waiting = {r: round(st[r].waiting_s(now), 3) for r in suspicious}
    v = Verdict("stretch", waiting, bound_s=max(st[r].bound_s for r in suspicious), seq=seq,
                steps={str(r): st[r].steps for r in suspicious})
    in_wait = {r for r, s in st.items() if s.wait_since > 0}
    v.lagging = sorted(r for r in facts if r not in in_wait or st[r].seq < seq)
    classes = {}
    for r, f in facts.items():
        classes[r], v.evidence[r] = liveness(f, now)
    # a waiter that holds the GIL is deaf too when the wait itself does not let go of it: then every waiter is
    deaf_waits = bool(in_wait) and all(classes[r] == "deaf" for r in in_wait)
    for r, c in classes.items():
        if c == "stopped" or (c == "deaf" and (r in v.lagging or not deaf_waits)):
            v.hung[r] = c
    declared = any(c == "declared" for c in classes.values())
    if not v.hung and ceiling_s is not None and max(waiting.values()) > ceiling_s and not declared:
        v.hung = {r: "no arrival within the ceiling (--jit-timeout)" for r in v.lagging if classes[r] != "dead"}
        if not v.hung:
            v.kind, v.why = "lost", f"waited past the ceiling {ceiling_s:g} s"
            return v
    elsewhere = [r for r in v.lagging if r not in in_wait]  # busy outside collectives: computing, loading, saving
    if v.hung:
        v.kind = "hang"
    elif elsewhere or declared:
        v.kind = "stretch"  # alive and busy elsewhere, or said so
    elif len(facts) < world_size:
        v.kind = "remote"  # every rank here waits: the laggard is on another node
    elif _computing(facts):
        v.kind = "stretch"  # someone still computes inside a collective's region, or waits for a CPU
    elif any(st[r].waiting_s(now) <= st[r].bound_s for r in facts):
        v.kind = "wait"  # a rank is still within its bound: look again next tick
    else:
        # every rank of the job waits, past its bound, none computing: no collective can complete. In
        # different collectives (one rank still in one the others left) or the same one, no rank is to blame.
        seqs = sorted({st[r].seq for r in facts})
        where = f"collective #{seq}" if len(seqs) == 1 else "collectives " + ", ".join(f"#{q}" for q in seqs)
        v.kind, v.why = "lost", f"every rank waits in {where} past its bound, none computing"
    return v


class HangWatch:
    def __init__(self, root: Path, events, *, ceiling_s: float, enabled: bool) -> None:
        self._root = Path(root)
        self._events = events
        self.ceiling_s = ceiling_s
        self.enabled = enabled
        try:
            self.floor_s = contract.TIMEOUT_FLOOR.get()  # as the workers' bounds have it
        except ValueError:
            self.floor_s = FLOOR_S  # the workers say what is wrong with it
        self._round = 0
        self._world = 0
        self._readers: dict[int, StatusReader] = {}
        self._cpu: dict[int, deque[tuple[float, float]]] = {}
        self._due: dict[tuple[int, float], float] = {}  # (rank, wait began) -> when to look again
        self._told: set[tuple[int, float]] = set()  # waits whose stretch is in the timeline
        self.last: dict[int, Status] = {}  # each rank's newest record of this round
        # sends a suspicion to the other nodes' agents (a sealed report), when the laggard is not here
        self.post: Callable[[dict], None] | None = None
        # the other nodes of the round whose agents stopped beating (asked only while a laggard is elsewhere)
        self.silent_nodes: Callable[[], list[str]] | None = None
        self._post_at = 0.0
        self._remote: dict[int, tuple[int, float, bool]] = {}  # rank elsewhere -> (seq, valid until, computing)

    def new_round(self, round_: int, local_ranks: set[int], world_size: int) -> None:
        for rd in self._readers.values():
            rd.close()
        self._round, self._world = round_, world_size
        self._readers = {r: StatusReader(self._root, r) for r in local_ranks}
        self._cpu.clear()
        self._due.clear()
        self._told.clear()
        self._remote.clear()
        self.last = {}

    def _cpu_busy(self, r: int, now: float) -> bool:
        h = self._cpu.get(r)
        if not h or len(h) < 2:
            return False
        return h[-1][1] - h[0][1] >= BUSY_CPU_S

    def _note_cpu(self, cpu: dict[int, float | None], now: float) -> None:
        for r, c in cpu.items():
            if c is None:
                continue
            h = self._cpu.setdefault(r, deque())
            h.append((now, c))
            while len(h) > 2 and h[1][0] <= now - STALE_S:
                h.popleft()

    def read(self) -> dict[int, Status]:
        """This round's records (a rank not started yet, or an earlier round's, has none)."""
        out = {}
        for r, rd in self._readers.items():
            s = rd.read()
            if s is not None and s.attempt == self._round:
                out[r] = s
        self.last.update(out)
        return out

    def _suspicious(self, st: dict[int, Status], now: float) -> tuple[list[int], list[int]]:
        """(the ranks waiting past their bound, or due for another look; those
        past the floor only: a stopped or deaf laggard is conclusive already)."""
        current = set()
        sus, early = [], []
        for r, s in st.items():
            if s.wait_since <= 0:
                continue
            key = (r, s.wait_since)
            current.add(key)
            if now >= self._due.get(key, s.wait_since + s.bound_s):
                sus.append(r)
            elif key not in self._due and s.waiting_s(now) >= min(self.floor_s, s.bound_s):
                early.append(r)
        for key in [k for k in self._due if k not in current]:
            del self._due[key]
        self._told &= current
        return sus, early

    def _early(self, facts: dict[int, Facts], early: list[int], now: float) -> dict[int, str] | None:
        """Waits past the floor, within the learned bound: ended now only for a
        laggard that is stopped or deaf (the bound is there for live ones)."""
        v = assess(facts, early, now, world_size=self._world, ceiling_s=None)
        if v.kind != "hang" or not all(w in ("stopped", "deaf") for w in v.hung.values()):
            return None
        v.why = f"the laggard is {' and '.join(sorted(set(v.hung.values())))} (past the {self.floor_s:g} s floor)"
        self._confirm(v)
        return dict(v.hung)

    def tick(self, procs: dict[int, Proc], pids: dict[int, int], cpu: dict[int, float | None],
             suspects: list[dict] = ()) -> dict[int, str] | None:
        """None, or a confirmed hang: rank -> why (empty for a lost collective,
        where no rank is to blame), for the episode to end. ``suspects``:
        other nodes' suspicions read this tick (their laggard may be here)."""
        if not self.enabled or not self._readers:
            return None
        now = time.monotonic()
        self._note_cpu(cpu, now)
        st = self.read()
        sus, early = self._suspicious(st, now)
        if not sus and not early and not suspects:
            return None
        facts = {r: Facts(st.get(r), run_state(pids[r]) if pids.get(r) else "running", self._cpu_busy(r, now),
                          bool(pids.get(r)) and has_runnable_thread(pids[r]))
                 for r in procs if r in self._readers}
        self._note_remote(suspects, now)
        if not sus and early:
            hung = self._early(facts, early, now)
            if hung is not None or not suspects:
                return hung
        if not sus:
            return self._answer(suspects, facts, now)
        v = assess(facts, sus, now, world_size=self._world, ceiling_s=self.ceiling_s)
        if v.kind == "wait":
            return None
        if v.kind == "remote":
            v.why = self._remote_verdict(facts, v.seq, now)
            if v.why:
                v.kind = "lost"
                self._confirm(v)
                return {}
        if v.kind in ("stretch", "remote"):
            self._stretch(v, st, sus, now)
            if v.kind == "remote":
                self._post(v, facts, now)
            return None
        self._confirm(v)
        return dict(v.hung)

    def _note_remote(self, suspects: list[dict], now: float) -> None:
        """Keep the other nodes' suspicions of this round: their waiting ranks, in which
        collective, whether their node computes; each holds for two of its bounds."""
        for m in suspects:
            try:
                until = now + 2 * float(m.get("bound_s", 0.0))
                seq, computing = int(m["seq"]), m.get("computing") is not False  # unsaid: maybe
                for r in m.get("waiting", {}):
                    self._remote[int(r)] = (seq, until, computing)
            except (KeyError, TypeError, ValueError, AttributeError):
                continue

    def _remote_verdict(self, facts: dict[int, Facts], seq: int, now: float) -> str:
        """Every rank here waits past its bound for one elsewhere: is it a lost
        collective after all? Yes (the why) when the laggards' node is silent
        (its agent stopped: the whole node is), or when the other nodes' agents
        said every other rank waits in this same collective past its bound and
        none of them computes, as none here does. "" otherwise."""
        if self.silent_nodes is not None:
            gone = self.silent_nodes()
            if gone:
                return (f"the agent of node(s) {', '.join(gone)} stopped answering the job's store: the laggard's "
                        "whole node is stopped or cut off")
        here = [f.status for f in facts.values()]
        if any(s is None or s.wait_since <= 0 or s.seq != seq or s.waiting_s(now) <= s.bound_s for s in here):
            return ""
        if _computing(facts):
            return ""
        there = {r: v for r, v in self._remote.items() if v[1] >= now and r not in facts}
        if set(facts) | set(there) != set(range(self._world)):
            return ""
        if any(q != seq or computing for q, _, computing in there.values()):
            return ""
        return (f"every rank of the job waits in collective #{seq} past its bound, none computing (ranks "
                f"{sorted(there)} by their agents' word)")

    def _post(self, v: Verdict, facts: dict[int, Facts], now: float) -> None:
        """The suspicion to the other nodes' agents, once per bound while the wait lasts."""
        if self.post is None or now < self._post_at:
            return
        self._post_at = now + v.bound_s
        try:
            self.post({"seq": v.seq, "waiting": {str(r): w for r, w in v.waiting.items()},
                       "bound_s": round(v.bound_s, 3),
                       "computing": _computing(facts)})
        except Exception as e:  # the store is going away with the job: the backstop still holds
            print(f"jitrun: could not tell the other nodes of a suspected hang: {e}", flush=True)

    def _answer(self, suspects: list[dict], facts: dict[int, Facts], now: float) -> dict[int, str] | None:
        """Another node's ranks wait past their bound for a rank elsewhere: is
        one of this node's stopped or deaf? (Only on such a suspicion: no
        store traffic otherwise.)"""
        m = suspects[-1]
        try:  # sealed by an agent of this job; still typed before use
            v = Verdict("hang", {int(r): float(w) for r, w in m.get("waiting", {}).items()},
                        bound_s=float(m.get("bound_s", 0.0)), seq=int(m.get("seq", 0)))
        except (AttributeError, TypeError, ValueError):
            return None
        v.lagging = sorted(r for r, f in facts.items() if f.status is None or f.status.wait_since <= 0
                           or f.status.seq < v.seq)
        for r, f in facts.items():
            c, v.evidence[r] = liveness(f, now)
            if c == "stopped" or (c == "deaf" and r in v.lagging):
                v.hung[r] = c
        if not v.hung:
            return None
        v.why = f"suspected by node {m.get('node')}"
        self._confirm(v)
        return dict(v.hung)

    def _stretch(self, v: Verdict, st: dict[int, Status], sus: list[int], now: float) -> None:
        fresh = False
        for r in sus:
            key = (r, st[r].wait_since)
            # looked at again within STALE_S (a local check, no traffic): a laggard alive now may hang later
            self._due[key] = now + min(max(st[r].bound_s, 0.1), STALE_S)
            if key not in self._told:
                self._told.add(key)
                fresh = True
        if fresh:
            self._events.emit("hang_bound_stretched", waiting=v.waiting, bound_s=round(v.bound_s, 3), seq=v.seq,
                              lagging=v.lagging, evidence={str(r): e for r, e in v.evidence.items()},
                              remote=v.kind == "remote", steps=v.steps)

    def _confirm(self, v: Verdict) -> None:
        self._events.emit("hang_detected", kind=v.kind, waiting=v.waiting, bound_s=round(v.bound_s, 3), seq=v.seq,
                          ceiling_s=self.ceiling_s, lagging=v.lagging, hung={str(r): w for r, w in v.hung.items()},
                          evidence={str(r): e for r, e in v.evidence.items()}, why=v.why, steps=v.steps)
        waited = ", ".join(f"rank {r} {s:.2f} s" for r, s in sorted(v.waiting.items()))
        if v.hung:
            who = "; ".join(f"rank {r}: {v.evidence[r] if w in ('stopped', 'deaf') else w}"
                            for r, w in sorted(v.hung.items()))
            print(f"jitrun: hang confirmed in collective #{v.seq} (waited: {waited}; bound {v.bound_s:.2f} s): "
                  f"{who}; the healthy ranks save, rank(s) {sorted(v.hung)} are ended", flush=True)
        else:
            print(f"jitrun: hang confirmed: {v.why} (waited: {waited}; bound {v.bound_s:.2f} s); "
                  "asking every rank to save", flush=True)

    def learned(self) -> dict[str, dict]:
        """Each rank's bound as last read, for the timeline."""
        return {str(r): {"bound_s": round(s.bound_s, 3), "typical_s": round(s.typical_s, 4), "steps": s.steps}
                for r, s in sorted(self.last.items())}

    def announce(self, when: str) -> None:
        """The learned bound, in the timeline and as one line of jitrun's (at
        the first restart and at the end)."""
        if not self.enabled:
            return
        self.read()
        if not self.last:
            return
        b = max(s.bound_s for s in self.last.values())
        t = max(s.typical_s for s in self.last.values())
        self._events.emit("hang_bound", when=when, bound_s=round(b, 3), ceiling_s=self.ceiling_s,
                          ranks=self.learned())
        print(f"jitrun: hang bound learned {when}: {b:.2f} s (slowest rank's recent minibatch or wait "
              f"{t:.3f} s; ceiling {self.ceiling_s:g} s)", flush=True)
