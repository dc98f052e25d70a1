"""A rank's collective waits, timed and published for its agent.

The hooks (hooks.py) mark where the main thread may wait for its peers once
training runs: an explicit collective, DDP's forward (its buffer broadcast),
the backward pass (DDP's gradient all-reduces), ``Work.wait``. Each
outermost such region counts one collective (``seq``: every rank enters the
same sequence of them) and its duration feeds the hang bound
(hang/bound.py), with each minibatch's duration. The record the agent reads
(hang/status.py) says whether the rank waits, since when, and under which
bound; the agent does the rest (launcher/recovery/hang.py).

Work set aside (``aside``: a periodic checkpoint, an evaluation, a delay the
script announced) is not learned: its time is taken out of the minibatch it
falls in, the waits inside it and the first wait after it (where a faster
rank catches up with a slower one's) are not observed, and that wait's time
is taken out of its minibatch as well. Otherwise one rank's
6 s save every 20 minibatches would be the high quantile of every rank's
window, and a rank stopped later would be found after 30 s, not 1 s.

Main thread, except ``beat`` (the watcher thread).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .bound import HangBound, Rule
from .status import StatusWriter

WORLD = "world"
REFRESH_EVERY = 10  # minibatches between recomputations of the bound, once it settled


def group_key(group: object) -> str:
    """The process group a collective runs in, as a key of the bound's windows."""
    if group is None:
        return WORLD
    name = getattr(group, "group_name", None)
    return name if isinstance(name, str) and name else f"group-{id(group)}"


def open_waits(root: Path, rank: int, attempt: int, rule: Rule) -> Waits | None:
    """The rank's Waits, or None (said in one line) when its status record
    cannot be created: the agent then has no hang record of this rank."""
    try:
        return Waits(root, rank, attempt, rule)
    except OSError as e:
        print(f"[jitckpt] rank {rank}: no hang watch for this rank: cannot create its status record in "
              f"{root} ({e.strerror or e}); free space there or pass --jit-dir on a larger disk",
              file=sys.stderr, flush=True)
        return None


class Waits:
    def __init__(self, root: Path, rank: int, attempt: int, rule: Rule) -> None:
        self.model = HangBound(rule)
        self.status = StatusWriter(root, rank, attempt)
        self._depth = 0
        self._group = WORLD
        self._since = 0.0
        self._bounds: dict[str, float] = {}
        self._aside = 0  # depth of aside regions
        self._aside_t0 = 0.0  # when the outermost one began, or the minibatch start inside it
        self._aside_s = 0.0  # set-aside seconds in the current minibatch
        self._skip_wait = False  # the first wait after an aside region: not learned
        self._refresh()

    def _refresh(self) -> None:
        m = self.model
        self._bounds = {g: m.bound(g) for g in [WORLD, *m.groups()]}
        self.status.typical_s = m.typical()

    def _bound(self, group: str) -> float:
        b = self._bounds.get(group)
        if b is None:
            b = self._bounds[group] = self.model.bound(group)
        return b

    def enter(self, group: object = None) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        s = self.status
        self._group = group_key(group)
        self._since = s.wait_since = time.monotonic()
        s.seq += 1
        s.bound_s = self._bound(self._group)
        s.flush()

    def leave(self) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth:
            return
        if not self._aside:
            waited = time.monotonic() - self._since
            if self._skip_wait:
                self._aside_s += waited  # the catching up is the aside's time too, in the same minibatch
            else:
                self.model.observe_wait(self._group, waited)
            self._skip_wait = False
        self.status.wait_since = 0.0
        self.status.flush()

    def minibatch(self, seconds: float | None, steps: int) -> None:
        """A minibatch ended (``seconds``: its duration, None for the first)."""
        if self._aside:  # a start inside an aside region: its part so far belongs to the minibatch ending
            now = time.monotonic()
            self._aside_s += now - self._aside_t0
            self._aside_t0 = now
        if seconds is not None:
            self.model.observe_minibatch(max(0.0, seconds - self._aside_s))
        else:
            self.model.minibatches += 1
        self._aside_s = 0.0
        n = self.model.minibatches
        if n <= REFRESH_EVERY * 2 or n % REFRESH_EVERY == 0:  # a few sorts of 200 numbers: not every step
            self._refresh()
        self.status.steps = steps
        self.status.bound_s = self._bounds[WORLD]
        self.status.flush()

    def beat(self) -> None:
        self.status.beat()

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Work the hang bound must not learn (see the module docstring). Main thread."""
        self._aside += 1
        if self._aside == 1:
            self._aside_t0 = time.monotonic()
        try:
            yield
        finally:
            self._aside -= 1
            if not self._aside:
                self._aside_s += time.monotonic() - self._aside_t0
                self._skip_wait = True

    @contextmanager
    def delay(self, seconds: float) -> Iterator[None]:
        s = self.status
        before = s.delay_until
        s.delay_until = max(before, time.monotonic() + seconds)
        s.flush()
        try:
            with self.aside():
                yield
        finally:
            s.delay_until = before
            s.flush()
