"""The hang bound's rule (jitckpt/hang/bound.py), the status record the agent
reads (jitckpt/hang/status.py) and the agent's verdict on a suspicion
(launcher/recovery/hang.py assess): pure parts, fed numbers."""

from __future__ import annotations

import contextlib
import os
import random
import time

import pytest

from jitckpt.hang.bound import FLOOR_S, MULT, STARTUP_S, HangBound, Rule, parse_timeout, quantile
from jitckpt.hang.status import StatusReader, StatusWriter
from jitckpt.wire import contract
from jitrun.recovery.hang import Facts, assess


def warm(m: HangBound, n: int = 50, mb: float = 0.1) -> HangBound:
    for _ in range(n):
        m.observe_minibatch(mb)
    return m


def test_startup_bound_then_floor():
    m = HangBound()
    assert m.bound() == STARTUP_S  # nothing seen: compilation, warm-up, the loader's start
    warm(m, n=2, mb=0.01)
    assert m.bound() == FLOOR_S  # fast minibatches: the floor


def test_bound_follows_the_high_quantile():
    m = warm(HangBound(), mb=0.5)
    assert m.bound() == pytest.approx(MULT * 0.5)
    for _ in range(100):
        m.observe_wait("world", 0.8)  # waiting for a straggler every minibatch
    assert m.bound("world") == pytest.approx(MULT * 0.8)
    assert m.bound("other") == pytest.approx(MULT * 0.5)  # per process group
    assert m.bound() == pytest.approx(MULT * 0.8)  # the longest over every group


def test_one_outlier_does_not_move_it_recurring_ones_do():
    m = warm(HangBound(), n=199, mb=0.1)
    m.observe_minibatch(30.0)  # one long evaluation among 200
    assert m.bound() < 2 * FLOOR_S
    for _ in range(10):
        m.observe_minibatch(3.0)  # an evaluation every 20 minibatches
    assert m.bound() == pytest.approx(MULT * 3.0, rel=0.05)


def test_jitter_stays_within_the_floor():
    rng = random.Random(0)
    m = HangBound()
    for _ in range(200):
        m.observe_minibatch(0.1 * (1 + rng.uniform(-0.5, 0.5)))
    assert m.bound() == FLOOR_S


def test_ceiling_and_fixed():
    m = warm(HangBound(Rule(ceiling_s=2.0)), mb=10.0)
    assert m.bound() == 2.0
    assert HangBound(Rule(ceiling_s=7.0, fixed=True)).bound() == 7.0
    with pytest.raises(ValueError, match="fixed:SECONDS"):
        Rule(fixed=True)
    with pytest.raises(ValueError, match="floor_s"):
        Rule(floor_s=0)


def test_quantile():
    assert quantile([3.0], 0.99) == 3.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert quantile([0.0, 10.0], 0.99) == pytest.approx(9.9)


@pytest.mark.parametrize("raw,want", [("120", (120.0, False)), ("fixed:5", (5.0, True)), (" FIXED:2.5 ", (2.5, True))])
def test_parse_timeout(raw, want):
    assert parse_timeout(raw) == want


def test_parse_timeout_rejects():
    with pytest.raises(ValueError, match="'soon' is not SECONDS or fixed:SECONDS"):
        parse_timeout("soon")


def test_contract_rule_from_environment():
    env = {"JITCKPT_TIMEOUT": "300", "JITCKPT_TIMEOUT_FLOOR": "0.5"}
    r = contract.hang_rule(env)
    assert (r.ceiling_s, r.floor_s, r.mult, r.fixed) == (300.0, 0.5, MULT, False)
    assert contract.hang_rule({"JITCKPT_TIMEOUT": "9", "JITCKPT_TIMEOUT_FIXED": "1"}).fixed
    # learned: the groups' own timeout is a backstop past the ceiling; fixed: the timeout itself
    assert contract.pg_timeout_s(120, shim=False, fixed=False) > 120
    assert contract.pg_timeout_s(120, shim=False, fixed=True) == 120


def test_status_record_roundtrip(tmp_path):
    w = StatusWriter(tmp_path, 3, attempt=2)
    r = StatusReader(tmp_path, 3)
    s = r.read()
    assert s is not None and (s.pid, s.attempt, s.seq, s.wait_since) == (os.getpid(), 2, 0, 0.0)
    w.seq, w.wait_since, w.bound_s, w.steps = 7, time.monotonic(), 1.5, 4
    w.flush()
    w.beat()
    s = r.read()
    assert (s.seq, s.bound_s, s.steps) == (7, 1.5, 4) and 0 <= s.waiting_s(time.monotonic()) < 1
    assert time.monotonic() - s.heartbeat < 1
    assert oct((tmp_path / "status" / "rank-3").stat().st_mode & 0o777) == "0o600"
    StatusWriter(tmp_path, 3, attempt=3)  # a restarted rank replaces the file: the reader follows
    assert r.read().attempt == 3


def _st(tmp_path, rank: int, *, seq: int, waiting: float = 0.0, bound: float = 1.0, beat_age: float = 0.0,
        delay: float = 0.0):
    w = StatusWriter(tmp_path, rank, attempt=0)
    now = time.monotonic()
    w.seq, w.bound_s = seq, bound
    w.wait_since = now - waiting if waiting else 0.0
    w.delay_until = now + delay if delay else 0.0
    w.flush()
    from jitckpt.hang.status import _BEAT, _BEAT_AT

    _BEAT.pack_into(w._m, _BEAT_AT, now - beat_age)
    return StatusReader(tmp_path, rank).read()


def test_verdicts(tmp_path):
    now = time.monotonic() + 0.01
    waiter = Facts(_st(tmp_path, 0, seq=10, waiting=1.5), "running", False)

    def verdict(lag: Facts, world: int = 2):
        return assess({0: waiter, 1: lag}, [0], now, world_size=world, ceiling_s=120.0)

    stopped = verdict(Facts(_st(tmp_path, 1, seq=9, beat_age=2), "stopped", False))
    assert stopped.kind == "hang" and stopped.hung == {1: "stopped"} and stopped.lagging == [1]
    deaf = verdict(Facts(_st(tmp_path, 1, seq=9, beat_age=1.5), "running", False))
    assert deaf.kind == "hang" and deaf.hung == {1: "deaf"}
    # silent but a thread waits for a CPU (a loaded machine): alive
    assert verdict(Facts(_st(tmp_path, 1, seq=9, beat_age=1.5), "running", False, runnable=True)).kind == "stretch"
    # deaf but computing (one long C call): alive; beating but idle (a data loader, a save): alive
    assert verdict(Facts(_st(tmp_path, 1, seq=9, beat_age=1.5), "running", True)).kind == "stretch"
    assert verdict(Facts(_st(tmp_path, 1, seq=9, beat_age=0.05), "running", False)).kind == "stretch"
    assert verdict(Facts(_st(tmp_path, 1, seq=9, beat_age=9, delay=5), "running", False)).kind == "stretch"
    # one rank still in a collective the other left, both past their bounds, nobody computing: lost, no one
    # to blame (with a third rank busy elsewhere it would just be waiting for that one)
    stuck = verdict(Facts(_st(tmp_path, 1, seq=9, waiting=3.0), "running", False))
    assert stuck.kind == "lost" and not stuck.hung and "#9, #10" in stuck.why, stuck
    busy = Facts(_st(tmp_path, 2, seq=8), "running", True)
    third = assess({0: waiter, 1: Facts(_st(tmp_path, 1, seq=9, waiting=3.0), "running", False), 2: busy}, [0],
                   now, world_size=3, ceiling_s=120.0)
    assert third.kind == "stretch" and third.lagging == [1, 2], third
    # every rank in the same collective past its bound, nobody computing: lost
    lost = verdict(Facts(_st(tmp_path, 1, seq=10, waiting=0.5), "running", False))
    assert lost.kind == "wait"  # rank 1 is not past its bound yet: look again next tick
    both = assess({0: waiter, 1: Facts(_st(tmp_path, 1, seq=10, waiting=1.4), "running", False)}, [0, 1], now,
                  world_size=2, ceiling_s=120.0)
    assert both.kind == "lost" and not both.hung and not both.lagging
    # the same on one of two nodes: the laggard is elsewhere
    assert assess({0: waiter}, [0], now, world_size=2, ceiling_s=120.0).kind == "remote"
    # past the ceiling, a live laggard is ended too, unless a delay was announced
    late = Facts(_st(tmp_path, 0, seq=10, waiting=5.0), "running", False)
    alive = Facts(_st(tmp_path, 1, seq=9), "running", True)
    assert assess({0: late, 1: alive}, [0], now, world_size=2, ceiling_s=4.0).hung == {
        1: "no arrival within the ceiling (--jit-timeout)"}
    said = Facts(_st(tmp_path, 1, seq=9, delay=30), "running", True)
    assert assess({0: late, 1: said}, [0], now, world_size=2, ceiling_s=4.0).kind == "stretch"


def test_waits_publish_the_wait_and_the_announced_delay(tmp_path):
    from jitckpt.hang.waits import Waits

    w = Waits(tmp_path, 0, attempt=0, rule=Rule(startup_s=4.0))
    r = StatusReader(tmp_path, 0)
    w.enter()
    w.enter("inner")  # nested (a collective inside DDP's forward): one wait
    s = r.read()
    assert s.seq == 1 and s.wait_since > 0 and s.bound_s == 4.0
    w.leave()
    assert r.read().wait_since > 0
    w.leave()
    assert r.read().wait_since == 0.0 and r.read().seq == 1
    for steps in range(1, 4):
        w.minibatch(None if steps == 1 else 0.01, steps)
    assert r.read().bound_s == FLOOR_S and r.read().steps == 3  # past the start-up bound
    with w.delay(30):
        assert r.read().delay_until > time.monotonic() + 29
    assert r.read().delay_until == 0.0


def test_set_aside_work_is_not_learned(tmp_path, monkeypatch):
    """One rank's slow periodic save (set aside) every few minibatches: neither its
    own minibatches nor its peers' catching-up waits raise the bound; the same
    pattern not set aside does, which is what the test would miss if aside did nothing."""
    from jitckpt.hang import waits as waits_mod

    clock = [1000.0]
    monkeypatch.setattr(waits_mod.time, "monotonic", lambda: clock[0])

    def rank(name: str, set_aside: bool, save_s: float, wait_s: float) -> float:
        """One rank's 100 minibatches (optimizer step to optimizer step, as the runtime times
        them); every 5th ends with the step-end save, which takes this rank ``save_s`` and
        keeps it ``wait_s`` in the next minibatch's first collective."""
        w = waits_mod.Waits(tmp_path / name, 0, attempt=0, rule=Rule())
        for step in range(1, 101):
            save, t0 = step % 5 == 0, clock[0]
            with w.aside() if set_aside and save else contextlib.nullcontext():
                clock[0] += save_s if save else 0.0
            w.enter()
            clock[0] += wait_s if save else 0.01
            w.leave()
            clock[0] += 0.04
            w.minibatch(None if step == 1 else clock[0] - t0, step)
        return w.model.bound()

    def job(set_aside: bool) -> tuple[float, float]:
        return (rank(f"saver-{set_aside}", set_aside, 6.0, 0.01),  # rank 0 writes the checkpoint
                rank(f"peer-{set_aside}", set_aside, 0.001, 6.0))  # and rank 1 waits for it

    assert min(job(set_aside=False)) >= 6.0 * MULT  # what a periodic save did to the bound
    assert job(set_aside=True) == (FLOOR_S, FLOOR_S)


def test_aside_takes_a_minibatch_start_inside_it_apart(tmp_path, monkeypatch):
    from jitckpt.hang import waits as waits_mod

    clock = [50.0]
    monkeypatch.setattr(waits_mod.time, "monotonic", lambda: clock[0])
    w = waits_mod.Waits(tmp_path, 0, attempt=0, rule=Rule())
    seen: list[float] = []
    monkeypatch.setattr(w.model, "observe_minibatch", seen.append)
    with w.aside():
        clock[0] += 2.0  # set aside before the start (a log's gather taken for the start) ...
        w.minibatch(2.5, 1)
        clock[0] += 3.0  # ... and after it
    w.minibatch(3.25, 2)
    assert seen == [0.5, 0.25]
    with w.delay(10):  # an announced delay is set aside too
        clock[0] += 4.0
    w.minibatch(4.5, 3)
    assert seen[-1] == 0.5


def test_expect_delay_api(monkeypatch):
    import jitckpt
    from jitckpt import api

    monkeypatch.setattr(api, "_runtime", None)  # the runtime this creates goes with the test

    assert "expect_delay" in jitckpt.__all__
    with jitckpt.expect_delay(seconds=5):  # not under jitrun: does nothing
        pass
    for bad in (0, -1, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match="expect_delay: seconds must be"):
            with jitckpt.expect_delay(seconds=bad):
                pass


class _Events:
    def __init__(self) -> None:
        self.got: list[tuple[str, dict]] = []

    def emit(self, event: str, **fields) -> None:
        self.got.append((event, fields))


def test_hang_watch_confirms_here_or_asks_the_laggards_node(tmp_path):
    """Two real processes stand for the ranks (rank 1 SIGSTOPped). On one
    node the watch confirms the hang; split over two nodes, the waiter's node
    posts the suspicion and the laggard's node confirms it."""
    import signal
    import subprocess
    import sys

    from jitrun.recovery.hang import HangWatch

    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        os.kill(kids[1].pid, signal.SIGSTOP)
        import psutil

        deadline = time.monotonic() + 10
        while psutil.Process(kids[1].pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.01)  # the stop is delivered when the child is next scheduled
        pids = {0: kids[0].pid, 1: kids[1].pid}
        _st(tmp_path, 0, seq=10, waiting=1.5, bound=1.0)
        _st(tmp_path, 1, seq=9, beat_age=2.0)
        ev = _Events()
        one = HangWatch(tmp_path, ev, ceiling_s=120.0, enabled=True)
        one.new_round(0, {0, 1}, world_size=2)
        assert one.tick({0: None, 1: None}, pids, {0: 1.0, 1: 1.0}) == {1: "stopped"}
        (name, d), = ev.got
        assert name == "hang_detected" and d["lagging"] == [1] and d["waiting"] == {0: pytest.approx(1.5, abs=0.5)}

        posted: list[dict] = []
        a = HangWatch(tmp_path, _Events(), ceiling_s=120.0, enabled=True)
        a.new_round(0, {0}, world_size=2)
        a.post = posted.append
        assert a.tick({0: None}, {0: kids[0].pid}, {0: 1.0}) is None
        assert posted and posted[0]["seq"] == 10
        b = HangWatch(tmp_path, _Events(), ceiling_s=120.0, enabled=True)
        b.new_round(0, {1}, world_size=2)
        assert b.tick({1: None}, {1: kids[1].pid}, {1: 1.0}) is None  # nothing suspicious seen here alone
        assert b.tick({1: None}, {1: kids[1].pid}, {1: 1.0}, suspects=[{**posted[0], "node": "a"}]) == {1: "stopped"}
    finally:
        for k in kids:
            k.kill()
            k.wait()


def test_hang_watch_confirms_when_the_laggards_node_is_silent(tmp_path):
    """Every rank here waits for one on another node: a suspicion to post
    while that node's agent beats, a lost collective confirmed here once it
    is silent (its agent cannot answer the suspicion: the whole node is
    stopped or cut off)."""
    import subprocess
    import sys

    from jitrun.recovery.hang import HangWatch

    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _st(tmp_path, 0, seq=10, waiting=1.5, bound=1.0)
        ev = _Events()
        silent: list[str] = []
        w = HangWatch(tmp_path, ev, ceiling_s=120.0, enabled=True)
        w.new_round(0, {0}, world_size=2)
        posted: list[dict] = []
        w.post = posted.append
        w.silent_nodes = lambda: list(silent)
        assert w.tick({0: None}, {0: kid.pid}, {0: 1.0}) is None
        assert posted and not [e for e, _ in ev.got if e == "hang_detected"]
        silent.append("node-b")
        w._due.clear()  # looked at again at once (the watch's own recheck interval is 0.5 s)
        assert w.tick({0: None}, {0: kid.pid}, {0: 1.0}) == {}
        (d,) = [d for e, d in ev.got if e == "hang_detected"]
        assert d["kind"] == "lost" and "node-b" in d["why"]
    finally:
        kid.kill()
        kid.wait()


def test_collective_group_given_by_position_or_keyword():
    """A collective's wait is timed under its own group's bound however the
    group is passed (``all_reduce(t, op, group)`` as much as ``group=``)."""
    from types import SimpleNamespace

    from jitckpt import hooks
    from jitckpt.runtime import Phase

    entered: list[object] = []
    waits = SimpleNamespace(enter=entered.append, leave=lambda: None)
    rt = SimpleNamespace(waits=waits, phase=Phase.FWD, on_collective=lambda: None)

    def all_reduce(tensor, op="sum", group=None, async_op=False):
        return tensor

    def barrier(group=None, async_op=False, device_ids=None):
        return None

    g = object()
    hooks._guard(rt, all_reduce)(1, "sum", g)
    hooks._guard(rt, all_reduce)(1, group=g)
    hooks._guard(rt, all_reduce)(1)
    hooks._guard(rt, barrier)(g)
    assert entered == [g, g, None, g]


def test_lost_collective_across_nodes_confirmed_by_the_others_word(tmp_path):
    """Rank 0 on node a, rank 1 on node b, both waiting past their bound in
    collective #10, neither computing: each node alone only sees a remote
    laggard; b, holding a's word (same collective, not computing), confirms a
    lost collective. a's word for another collective, or with its ranks
    computing, confirms nothing."""
    import subprocess
    import sys

    from jitrun.recovery.hang import HangWatch

    kids = [subprocess.Popen([sys.executable, "-c", "print(1, flush=True); import time; time.sleep(60)"],
                             stdout=subprocess.PIPE) for _ in range(2)]
    try:
        import psutil

        for k in kids:
            k.stdout.readline()  # past its start-up
            deadline = time.monotonic() + 10
            while psutil.Process(k.pid).status() != psutil.STATUS_SLEEPING and time.monotonic() < deadline:
                time.sleep(0.01)  # asleep: not computing, no thread runnable
        _st(tmp_path, 0, seq=10, waiting=1.5, bound=1.0)
        _st(tmp_path, 1, seq=10, waiting=1.5, bound=1.0)
        posted: list[dict] = []
        a = HangWatch(tmp_path, _Events(), ceiling_s=120.0, enabled=True)
        a.new_round(0, {0}, world_size=2)
        a.post = posted.append
        assert a.tick({0: None}, {0: kids[0].pid}, {0: 1.0}) is None
        (word,) = posted
        assert word["seq"] == 10 and word["computing"] is False and "0" in word["waiting"]

        def node_b(suspect: dict) -> tuple[dict | None, _Events]:
            ev = _Events()
            b = HangWatch(tmp_path, ev, ceiling_s=120.0, enabled=True)
            b.new_round(0, {1}, world_size=2)
            b.post = lambda fields: None
            return b.tick({1: None}, {1: kids[1].pid}, {1: 1.0}, suspects=[{**suspect, "node": "a"}]), ev

        got, ev = node_b(word)
        assert got == {}
        (d,) = [d for e, d in ev.got if e == "hang_detected"]
        assert d["kind"] == "lost" and "[0]" in d["why"], d
        assert node_b({**word, "seq": 9})[0] is None
        assert node_b({**word, "computing": True})[0] is None
        assert node_b({k: v for k, v in word.items() if k != "computing"})[0] is None  # an older agent: no word
    finally:
        for k in kids:
            k.kill()
            k.wait()


def test_stopped_laggard_ends_at_the_floor_not_the_learned_bound(tmp_path):
    """A waiter past the floor but within its learned bound (a loaded machine
    raised it): a stopped laggard is conclusive already; an alive one is left
    alone, without even a stretch in the timeline."""
    import signal
    import subprocess
    import sys

    import psutil

    from jitrun.recovery.hang import HangWatch

    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        pids = {0: kids[0].pid, 1: kids[1].pid}
        _st(tmp_path, 0, seq=10, waiting=0.9, bound=3.0)
        _st(tmp_path, 1, seq=9)  # beating, outside any collective: alive
        ev = _Events()
        w = HangWatch(tmp_path, ev, ceiling_s=120.0, enabled=True)
        assert w.floor_s == 0.8
        w.new_round(0, {0, 1}, world_size=2)
        assert w.tick({0: None, 1: None}, pids, {0: 1.0, 1: 1.0}) is None and ev.got == []
        os.kill(kids[1].pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while psutil.Process(kids[1].pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.tick({0: None, 1: None}, pids, {0: 1.0, 1: 1.0}) == {1: "stopped"}
        (name, d), = ev.got
        assert name == "hang_detected" and d["bound_s"] == 3.0 and "floor" in d["why"], d
    finally:
        for k in kids:
            k.kill()
            k.wait()
