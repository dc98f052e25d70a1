"""What this node's workers' reports tell its agent (jitckpt/wire/report.py writes
them): which shard each rank saves, which finished the job, what each loaded
and when each reached its start-up milestones this round, and, during a
failure episode, who detected it, who is saving and what was saved.

An agent reads only its own node's ranks' reports (and the agents' messages
on the job stream): what the job needs from every node reaches the deciding
agent through the coordination store (each node's shard map, inventory and
marks, ``launcher.decide``), so no agent reads every rank's reports.
Agent's main thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .failure import Failure


class ReportBook:
    def __init__(self, events) -> None:
        self._events = events
        self.round = 0
        self.local_ranks: set[int] = set()
        self.shards: dict[int, str] = {}  # global rank -> shard, from "registered"
        self.finished: set[int] = set()  # this node's ranks that finished their script
        self.finished_now: set[int] = set()  # those that finished it this round
        self.refused: tuple[int, str] | None = None  # (rank, why) of the first "refused" report, any round
        # rank -> (CPU seconds, when they last changed): a failed process's last
        # sign of life, the failure time when no injector stamped it
        self.life: dict[int, tuple[float, float]] = {}
        self.loaded: dict[int, object] = {}  # rank -> step it loaded, this round
        self.fingerprint: dict[int, object] = {}  # rank -> its state digest the replicas verified, this round
        # this round's start-up milestones per rank: process created,
        # get_checkpoint_path() asked, first training step entered
        self.boot: dict[int, float] = {}
        self.query: dict[int, float] = {}
        self.train: dict[int, float] = {}
        self.migrating: dict[int, list[dict]] = {}  # gen -> this node's ranks' "migrating" reports

    def new_round(self, round_: int, local_ranks: set[int]) -> None:
        self.round = round_
        self.local_ranks = set(local_ranks)
        for d in (self.loaded, self.fingerprint, self.life, self.boot, self.query, self.train, self.finished_now):
            d.clear()

    def of_this_round(self, m: dict) -> bool:
        """False for a report of an earlier round read late: the reader waits up
        to SLOT_GRACE_S on a slot a killed writer left empty, so reports written
        after it can arrive in the next round. Every use of a report for this
        round's failure, restore or recovery record asks this first."""
        return m.get("attempt", self.round) == self.round

    def track_life(self, cpu: dict[int, float | None]) -> None:
        now = time.time()
        for r, secs in cpu.items():
            if secs is not None and (r not in self.life or self.life[r][0] != secs):
                self.life[r] = (secs, now)

    def local_shards(self) -> dict[int, str]:
        """This round's ranks' shards: what this node's failure episode can save."""
        return {r: s for r, s in self.shards.items() if r in self.local_ranks}

    def done_ranks(self, exited: dict[int, int]) -> set[int]:
        """This node's ranks that finished the job: reported, or exited 0."""
        return self.finished | {k for k, c in exited.items() if c == 0}

    def absorb(self, m: dict, failure: Failure | None, on_resumed: Callable[[dict], None]) -> None:
        ev, rank = m["event"], m.get("rank")
        current = self.of_this_round(m)
        if ev in ("loaded", "started") and not current:
            return  # this round's facts only
        if ev == "registered":
            self.shards[rank] = m["shard"]
            return
        if ev == "refused" and self.refused is None:  # read before or after the exit that ends the attempt
            self.refused = (rank, str(m.get("error", "")))
        if ev == "finished":
            self.finished.add(rank)
            if current:
                self.finished_now.add(rank)
            if m.get("loaded") is not None and self.loaded.get(rank) is None and current:
                self.loaded[rank] = m["loaded"]
            if m.get("fingerprint") is not None and current:
                self.fingerprint.setdefault(rank, m["fingerprint"])
            if current:
                # restored after the last minibatch (e.g. a save at a barrier
                # after the loop): the job ends without another minibatch
                on_resumed(m)
        if ev == "loaded":
            self.loaded[rank] = m.get("loaded")
            self.fingerprint[rank] = m.get("fingerprint")
            self.train[rank] = m["t"]
            if m.get("query_t"):
                self.query[rank] = m["query_t"]
        if ev == "started":
            self.boot[rank] = m.get("proc_start_t") or m["t"]
        if ev == "migrating" and rank in self.local_ranks and current:
            self.migrating.setdefault(int(m["gen"]), []).append(m)
        local = rank is None or rank in self.local_ranks
        # an earlier round's report read late goes to the timeline but says
        # nothing about this round's failure or recovery
        if ev == "resumed":
            if local:
                self._events.emit("resumed", t=m["t"], rank=rank, step=m["step"])
            if current:
                on_resumed(m)
            return
        if local:
            self._events.emit(ev, **{k: v for k, v in m.items() if k != "event"})
        if failure is not None and current:
            failure.note_report(ev, rank, m, lambda: self.local_shards().values())
