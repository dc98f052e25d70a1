"""The failure episode (launcher/recovery/episode.py) with fake workers: each rank is a
thread that answers the agent's signals with the reports a real worker sends
(failure_detected, save_started, checkpoint_saved) and an exit code, so the
episode's choices (whom to ask, whom to wait for, whom to kill, when a complete
checkpoint is enough) run in milliseconds, without process trees. The end-to-end
suites run the same paths with real workers; these pin the choices one by one.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import pytest

from jitckpt.wire.config import EXIT_SAVED
from jitrun.recovery import episode as ep
from jitrun.recovery.failure import Failure, Stage
from jitrun.workers import Proc

STEP = 7
FAKE_PID = 1 << 30  # above any pid_max: never a real process


@dataclass
class Fake:
    """One rank. ``on_term``: what it does when asked to save: "save" (reports, then
    exits 75 after ``save_s``), "deaf" (nothing: hung holding the GIL), "stopped"
    (SIGSTOPped: nothing, and /proc says stopped), "refuse" (checkpoint_skipped, exit 1)."""

    rank: int
    on_term: str = "save"
    step: int = STEP
    save_s: float = 0.02
    shard: str = "0"
    code: int | None = None  # set when it exited
    signals: list[int] = field(default_factory=list)
    node: World | None = None

    def send(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGKILL:
            self.exit(-signal.SIGKILL)
        elif sig == signal.SIGTERM and self.on_term in ("save", "refuse") and self.code is None:
            threading.Thread(target=self._answer, daemon=True).start()

    def _answer(self) -> None:
        w = self.node
        assert w is not None
        w.report("failure_detected", self.rank, reason="sigterm", step=self.step)
        if self.on_term == "refuse":
            w.report("checkpoint_skipped", self.rank, why="no save_fn registered")
            self.exit(1)
            return
        w.report("save_started", self.rank, step=self.step, shard=self.shard)
        time.sleep(self.save_s)
        if self.code is not None:  # killed meanwhile
            return
        w.report("checkpoint_saved", self.rank, step=self.step, shard=self.shard)
        self.exit(EXIT_SAVED)

    def exit(self, code: int) -> None:
        if self.code is None:
            self.code = code
            assert self.node is not None
            self.node.wake.set()


class World:
    """The node: its fakes, their report stream and the episode's callbacks."""

    def __init__(self, fakes: list[Fake]) -> None:
        self.fakes = {f.rank: f for f in fakes}
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._reports: list[tuple[str, int, dict]] = []
        self.f = Failure(time.time())
        for f in fakes:
            f.node = self

    def report(self, ev: str, rank: int, **m) -> None:
        with self._lock:
            self._reports.append((ev, rank, {"event": ev, "rank": rank, "t": time.time(), **m}))
        self.wake.set()

    def poll(self) -> None:
        with self._lock:
            got, self._reports = self._reports, []
        for ev, rank, m in got:
            self.f.note_report(ev, rank, m, lambda: {x.shard for x in self.fakes.values()})

    def wait(self, pids: list[int], seconds: float) -> None:
        self.wake.wait(max(seconds, 0.0))
        self.wake.clear()

    def procs(self) -> dict[int, Proc]:
        # signals go through ``send`` (as to a migrated rank); the pid only names the fake
        return {r: Proc(pid=FAKE_PID + r, poll=lambda f=f: f.code, wait=lambda: None, send=f.send, rank=r)
                for r, f in self.fakes.items()}

    def run(self, timeout_s: float = 5.0, save_timeout_s: float = 5.0) -> float:
        class Events:
            def __init__(self) -> None:
                self.emitted: list[tuple[str, dict]] = []

            def emit(self, ev: str, **fields) -> None:
                self.emitted.append((ev, fields))

        self.events = Events()
        shards = {r: f.shard for r, f in self.fakes.items()}
        t0 = time.monotonic()
        ep.Episode(self.f, self.procs(), exited={}, shards=shards, timeout_s=timeout_s,
                   save_timeout_s=save_timeout_s, wait=self.wait, poll=self.poll, events=self.events).run()
        return time.monotonic() - t0


@pytest.fixture(autouse=True)
def fake_proc_state(monkeypatch):
    """/proc is not asked about fakes: a fake with on_term "stopped" is the stopped one."""
    state: dict[str, World] = {}

    def is_stopped(pid: int) -> bool:
        f = state["world"].fakes[pid - FAKE_PID]
        return f.on_term == "stopped" and f.code is None

    monkeypatch.setattr(ep, "is_stopped", is_stopped)
    return state


def test_a_dead_rank_and_a_saving_peer_end_with_the_peers_replica(fake_proc_state):
    w = World([Fake(0, on_term="save"), Fake(1)])
    w.fakes[1].exit(-signal.SIGKILL)  # the failure: rank 1 died
    fake_proc_state["world"] = w
    w.run()
    assert w.f.stage is Stage.STOPPED
    assert sorted(w.f.saved) == [0] and w.f.saved[0]["step"] == STEP
    assert w.f.killed == []  # the saver left on its own
    assert w.fakes[0].signals == [signal.SIGTERM] and w.fakes[0].code == EXIT_SAVED


def test_a_stopped_rank_is_not_waited_for_and_is_killed_once_the_peer_saved(fake_proc_state):
    w = World([Fake(0, on_term="save"), Fake(1, on_term="stopped")])
    fake_proc_state["world"] = w
    took = w.run(timeout_s=30, save_timeout_s=30)
    assert sorted(w.f.saved) == [0]
    assert w.f.killed == [1] and w.fakes[1].code == -signal.SIGKILL
    assert took < 10, "waited for a stopped rank that can never save"


def test_with_only_a_stopped_rank_left_nothing_is_waited_for(fake_proc_state):
    """Rank 0 died, rank 1 is SIGSTOPped: no checkpoint can come from this node, and the
    episode says so at once instead of giving the stopped rank a healthy rank's grace."""
    w = World([Fake(0), Fake(1, on_term="stopped")])
    w.fakes[0].exit(-signal.SIGKILL)
    fake_proc_state["world"] = w
    took = w.run(timeout_s=30, save_timeout_s=30)
    assert w.f.saved == {} and w.f.killed == [1]
    assert took < 1.5, f"waited {took:.1f}s for a stopped rank"


def test_a_deaf_rank_is_given_up_after_its_grace_and_killed(fake_proc_state):
    """Nobody saves (the only saver is deaf): the episode ends after the grace a
    healthy rank needs to answer, not after the whole save timeout."""
    w = World([Fake(0, on_term="deaf"), Fake(1)])
    w.fakes[1].exit(-signal.SIGKILL)
    fake_proc_state["world"] = w
    took = w.run(timeout_s=3, save_timeout_s=60)
    assert w.f.saved == {} and w.f.killed == [0]
    assert took < 30, "waited out the save timeout for a rank that never answered"


def test_a_peer_ahead_of_the_saved_step_is_waited_for(fake_proc_state):
    """Rank 0 saved step 7 fast; rank 1 is at step 8 and saves slowly: its newer replica
    is the one to restore (restoring 7 would redo two minibatches), so the episode waits."""
    w = World([Fake(0, step=STEP, save_s=0.01), Fake(1, step=STEP + 1, save_s=3 * ep.SAVE_GRACE_S), Fake(2)])
    w.fakes[2].exit(-signal.SIGKILL)
    fake_proc_state["world"] = w
    w.run()
    assert {r: m["step"] for r, m in w.f.saved.items()} == {0: STEP, 1: STEP + 1}
    assert w.f.killed == []


def test_a_second_replica_of_the_saved_step_is_not_waited_for_long(fake_proc_state):
    """Both live ranks save the same step; once one replica is complete the slower
    one gets SAVE_GRACE_S, then is killed: a replica nobody needs."""
    w = World([Fake(0, save_s=0.01), Fake(1, save_s=30), Fake(2)])
    w.fakes[2].exit(-signal.SIGKILL)
    fake_proc_state["world"] = w
    took = w.run(timeout_s=30, save_timeout_s=30)
    assert sorted(w.f.saved) == [0] and w.f.killed == [1]
    assert took < 15


def test_every_shard_needs_a_replica(fake_proc_state):
    """Two shards: a replica of shard 0 alone is not a checkpoint; the episode waits
    for shard 1's saver too."""
    w = World([Fake(0, shard="0", save_s=0.01), Fake(1, shard="1", save_s=0.5), Fake(2, shard="0")])
    w.fakes[2].exit(-signal.SIGKILL)
    fake_proc_state["world"] = w
    w.run()
    assert {m["shard"] for m in w.f.saved.values()} == {"0", "1"} and w.f.killed == []


def test_a_rank_that_cannot_save_is_done_and_nothing_is_waited_for(fake_proc_state):
    w = World([Fake(0, on_term="refuse"), Fake(1)])
    w.fakes[1].exit(-signal.SIGKILL)
    fake_proc_state["world"] = w
    took = w.run(timeout_s=30, save_timeout_s=30)
    assert w.f.saved == {} and w.f.killed == [] and 0 in w.f.done
    assert took < 10


def test_exit_codes_are_recorded_once_each(fake_proc_state):
    w = World([Fake(0), Fake(1)])
    w.fakes[1].exit(-signal.SIGKILL)
    fake_proc_state["world"] = w
    w.run()
    exits = [(f["rank"], f["exitcode"]) for ev, f in w.events.emitted if ev == "worker_exit"]
    assert sorted(exits) == [(0, EXIT_SAVED), (1, -signal.SIGKILL)]
