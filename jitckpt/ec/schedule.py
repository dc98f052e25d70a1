"""When the next EC snapshot is due.

Every rank must take its snapshots at the same steps: each one is a round of
collectives on the EC group (ec/snapshot.py), and the ranks' background threads
stay in lockstep only if every rank hands them one item per due step.

``--jit-ec-every N`` given: every N minibatches, as the user asked. Not given
(the default): N is the least interval, and the ranks lengthen it together so
that snapshots cost at most ``BUDGET`` of the training time. A snapshot costs
its main-thread stall (save_fn into tmpfs) plus its background thread's CPU,
which competes with training for the cores; with short minibatches a fixed
count would make the fallback the largest steady-state cost of the job (at 6 ms
minibatches, every 100 took ~5 % on 2 cores).

How the ranks agree without a collective of their own: at a due step the main
thread proposes the interval its own costs call for (``propose``) and hands it
to the background thread with the item; that thread's first all-gather of the
version (which every item has, a skipped one too) carries the proposals, and
every rank takes the largest (``agree``). The main thread reads the agreed
interval at the next due check, after the least interval; if its background
thread has not agreed yet (it is still busy with an older version), it waits
for it: all ranks then continue from the same interval.

Threads: ``due`` and ``propose`` on the main thread, ``agree``/``release`` on the
EC thread; ``_cond`` guards ``_agreed``, ``_next`` and ``_asked``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

# the share of the training time each periodic cost may take (adaptive intervals): snapshots and replica
# checks are two, and with both at 0.5 % they took the whole of a 1 % overhead target on short minibatches
BUDGET = 0.002
MAX_EVERY = 1_000_000


def interval_for(least: int, cost_s: float | None, minibatch_s: float | None) -> int:
    """The minibatches between two runs of a periodic cost ``cost_s`` (seconds of one run) so that it
    stays within BUDGET of the training time of ``minibatch_s`` minibatches; at least ``least``."""
    if not cost_s or not minibatch_s:
        return least
    return max(least, min(MAX_EVERY, math.ceil(cost_s / (BUDGET * minibatch_s))))


class Schedule:
    def __init__(self, every: int, adaptive: bool) -> None:
        self.least = every
        self.adaptive = adaptive
        self.interval = every  # the interval in force (main thread)
        self.anchor: int | None = None  # the last due step, or where counting started (main thread)
        self._cond = threading.Condition()
        self._asked = 0  # items handed to the EC thread (main thread writes)
        self._agreed = 0  # items whose interval the ranks agreed on (EC thread writes)
        self._next = every  # the newest agreed interval
        self._read = 0  # the items whose agreed interval the main thread has taken (main thread only)

    def due(self, step: int, wait_s: Callable[[], float]) -> int | None:
        """At a minibatch start (main thread): the item number to hand over with the snapshot of
        ``step``, or None when none is due. Raises TimeoutError when the EC thread did not agree
        within ``wait_s()`` seconds (it is stuck: the caller turns EC off). Called every minibatch:
        the lock is taken once per item, when its agreed interval is first needed."""
        if not self.adaptive:
            return self._next_item() if step % self.least == 0 else None
        if self.anchor is None:
            # the multiple of the least interval before the first step seen (the same on every rank:
            # they start at the same step), so a first step on a multiple is due, as with a fixed interval
            self.anchor = (step - 1) // self.least * self.least
        if step < self.anchor + self.least:
            return None
        if self._read < self._asked:
            timeout = wait_s()
            with self._cond:
                if not self._cond.wait_for(lambda: self._agreed >= self._asked, timeout=timeout):
                    raise TimeoutError(f"the EC thread did not agree on the snapshot interval within {timeout:.0f}s")
                self.interval = self._next
            self._read = self._asked
        if step < self.anchor + self.interval:
            return None
        self.anchor = step
        return self._next_item()

    def _next_item(self) -> int:
        with self._cond:
            self._asked += 1
            return self._asked

    def propose(self, cost_s: float | None, minibatch_s: float | None) -> int:
        """The interval this rank's own figures call for: ``cost_s`` (one snapshot's stall plus
        background CPU) at most BUDGET of the training time of ``minibatch_s`` minibatches."""
        return interval_for(self.least, cost_s, minibatch_s) if self.adaptive else self.least

    def agree(self, item: int, proposals: list[int]) -> None:
        """EC thread, after the version's first all-gather: the largest proposal is the interval."""
        with self._cond:
            self._next = max(self.least, min(MAX_EVERY, max(proposals)))
            self._agreed = max(self._agreed, item)
            self._cond.notify_all()

    def release(self, item: int) -> None:
        """EC thread: item ``item`` is done without an agreement (EC failed or is off here); the
        main thread keeps the interval it has instead of waiting."""
        with self._cond:
            self._agreed = max(self._agreed, item)
            self._cond.notify_all()
