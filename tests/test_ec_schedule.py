"""When EC snapshots are due (jitckpt/ec/schedule.py): ranks as threads, each with a main
thread that trains at its own pace and an EC thread that lags behind it by chance, agreeing
through an all-gather stand-in. Every rank must take the same steps whatever the timing."""

from __future__ import annotations

import queue
import random
import threading
import time

import pytest

from jitckpt.ec.schedule import BUDGET, MAX_EVERY, Schedule


def test_fixed_interval_is_every_multiple_and_never_waits():
    s = Schedule(100, adaptive=False)
    due = [step for step in range(1, 1001) if s.due(step, wait_s=lambda: 0.0) is not None]
    assert due == list(range(100, 1001, 100))
    assert s.propose(10.0, 0.001) == 100  # costs change nothing


def test_the_proposal_keeps_snapshots_within_the_budget():
    s = Schedule(100, adaptive=True)
    assert s.propose(None, 0.006) == 100 and s.propose(0.04, None) == 100  # nothing measured yet
    n = s.propose(0.04, 0.006)  # 40 ms a snapshot, 6 ms minibatches
    assert n > 100 and 0.04 / (n * 0.006) <= BUDGET < 0.04 / ((n - 1) * 0.006)
    assert s.propose(0.0001, 0.3) == 100  # cheap next to long minibatches: the least interval
    assert s.propose(1e9, 1e-6) == MAX_EVERY


class AllGather:
    """The EC group's first all-gather of each version, for threads."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.cond = threading.Condition()
        self.got: dict[int, dict[int, int]] = {}

    def __call__(self, item: int, rank: int, value: int) -> list[int]:
        with self.cond:
            self.got.setdefault(item, {})[rank] = value
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: len(self.got[item]) == self.world, timeout=30)
            return [self.got[item][r] for r in range(self.world)]


def _rank(rank: int, sched: Schedule, gather: AllGather, cost_s: float, steps: int, seed: int,
          out: dict[int, list[int]]) -> None:
    rnd = random.Random(seed)
    q: queue.Queue = queue.Queue()

    def ec_thread() -> None:
        while (got := q.get()) is not None:
            item, proposal = got
            time.sleep(rnd.random() * 0.01)  # pack and encode: the lag differs per rank and version
            sched.agree(item, gather(item, rank, proposal))

    t = threading.Thread(target=ec_thread, daemon=True)
    t.start()
    due = out[rank] = []
    for step in range(1, steps + 1):
        item = sched.due(step, wait_s=lambda: 30)
        if item is not None:
            due.append(step)
            q.put((item, sched.propose(cost_s, 0.001)))  # 1 ms minibatches: the cost decides
        if rnd.random() < 0.01:
            time.sleep(0.002)  # a rank running behind now and then
    q.put(None)
    t.join(30)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ranks_agree_on_every_due_step_whatever_the_timing(seed):
    costs = [0.0004, 0.0015, 0.0008]  # each rank measures its own cost: the largest proposal wins
    world, steps = len(costs), 3000
    scheds = [Schedule(100, adaptive=True) for _ in range(world)]
    gather, out = AllGather(world), {}
    threads = [threading.Thread(target=_rank, args=(r, scheds[r], gather, costs[r], steps, seed * 10 + r, out))
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out[0] == out[1] == out[2], out
    due = out[0]
    want = max(s.propose(c, 0.001) for s, c in zip(scheds, costs, strict=True))
    assert want == 750  # 1.5 ms at most 0.2 % of 1 ms minibatches
    # the first at the least interval; each later one as far as the costliest rank asked
    assert due[0] == 100 and len(due) == (steps - 100) // want + 1
    assert all(b - a == want for a, b in zip(due, due[1:], strict=False)), due


def test_a_released_item_does_not_hold_the_main_thread():
    s = Schedule(10, adaptive=True)
    assert s.due(10, wait_s=lambda: 1) == 1
    s.release(1)  # the version failed before its all-gather: EC goes off on this rank
    assert s.due(20, wait_s=lambda: 1) == 2 and s.interval == 10


def test_no_agreement_in_time_raises():
    s = Schedule(10, adaptive=True)
    assert s.due(10, wait_s=lambda: 1) == 1
    with pytest.raises(TimeoutError, match="did not agree"):
        s.due(20, wait_s=lambda: 0.05)
