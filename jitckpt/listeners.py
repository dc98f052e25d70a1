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
add another) while called: each call walks a copy of the list.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any


class Event(enum.Enum):
    TRAINING_START = "training_start"  # the first minibatch's begin, once (fire_once)
    MINIBATCH_BEGIN = "minibatch_begin"  # every minibatch, from the first
    MINIBATCH_START = "minibatch_start"  # (provisional: bool): the consistent point, before a deferred save
    SNAPSHOT = "snapshot"  # (collective: bool): after an optimizer step, the state verified
    OPTIMIZER_BEGIN = "optimizer_begin"  # the optimizer step starts
    OPTIMIZER_END = "optimizer_end"  # and ended


class Listeners:
    def __init__(self) -> None:
        self._fns: dict[Event, list[Callable[..., Any]]] = {e: [] for e in Event}

    def add(self, event: Event, fn: Callable[..., Any], *, first: bool = False) -> None:
        if first:
            self._fns[event].insert(0, fn)
        else:
            self._fns[event].append(fn)

    def remove(self, event: Event, fn: Callable[..., Any]) -> None:
        """Drop ``fn`` (not there: nothing to do)."""
        fns = self._fns[event]
        if fn in fns:
            fns.remove(fn)

    def has(self, event: Event) -> bool:
        return bool(self._fns[event])

    def fire(self, event: Event, *args: Any) -> None:
        fns = self._fns[event]
        if fns:
            for fn in list(fns):
                fn(*args)

    def fire_once(self, event: Event, *args: Any) -> None:
        """Call and drop every listener of ``event``: those added later wait for the next call."""
        fns, self._fns[event] = self._fns[event], []
        for fn in fns:
            fn(*args)
