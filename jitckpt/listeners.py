"""What the runtime tells the parts that joined it: one list of listeners per event.

The runtime (runtime.py) knows where a minibatch starts; the parts that act there join
it here instead of writing its fields: the shim (intercept.py: its replay log and
optimizer phase marks), the process groups' timeouts (hooks.py), ``resumable``
(resume.py), the integrations (accelerate, transformers) and EC snapshots
(ec/snapshot.py). Listeners are called in the order they were added (``first=True``:
before the others, for a check that must run before anything is snapshotted); one
that raises stops the rest and the exception goes to the runtime's caller, as a
single callback's did.

Main thread only: listeners are added by set-up calls of the script's main thread
and called from the runtime's phase hooks on it; a listener may remove itself (or
add another) while called: each call walks the tuple it started with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Event:
    """The events, plain ints: their lists are looked up several times a minibatch, and an
    Enum member hashes in Python (~150 ns a lookup, against ~20 for an int)."""

    TRAINING_START = 0  # the first minibatch's begin, once (fire_once)
    MINIBATCH_BEGIN = 1  # every minibatch, from the first
    MINIBATCH_START = 2  # (provisional: bool): the consistent point, before a deferred save
    SNAPSHOT = 3  # (collective: bool): after an optimizer step, the state verified
    OPTIMIZER_BEGIN = 4  # the optimizer step starts
    OPTIMIZER_END = 5  # and ended
    COUNT = 6


class Listeners:
    """Each event's listeners as a tuple, replaced (never changed in place) when one is
    added or removed: a call walks the tuple it started with, with no copy."""

    def __init__(self) -> None:
        self._fns: list[tuple[Callable[..., Any], ...]] = [()] * Event.COUNT

    def add(self, event: int, fn: Callable[..., Any], *, first: bool = False) -> None:
        fns = self._fns[event]
        self._fns[event] = (fn, *fns) if first else (*fns, fn)

    def remove(self, event: int, fn: Callable[..., Any]) -> None:
        """Drop ``fn`` (not there: nothing to do)."""
        self._fns[event] = tuple(f for f in self._fns[event] if f is not fn)

    def has(self, event: int) -> bool:
        return bool(self._fns[event])

    def fire(self, event: int, *args: Any) -> None:
        for fn in self._fns[event]:
            fn(*args)

    def fire_once(self, event: int, *args: Any) -> None:
        """Call and drop every listener of ``event``: those added later wait for the next call."""
        fns, self._fns[event] = self._fns[event], ()
        for fn in fns:
            fn(*args)
