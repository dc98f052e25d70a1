"""How long a rank may wait in a collective before its peers are checked:
the bound, learned from the job's own timing.

A rank records how long each of its collective waits lasted (per process
group) and how long each minibatch took. The bound on its next wait is

    max(floor, mult x max(q(waits of that group), q(minibatches)))

with ``q`` the high quantile of a recent window: a rare outlier (one long
evaluation) does not move it, a recurring one (a straggler, an evaluation
every few minibatches) does. Until ``warmup`` minibatches are done it is at
least ``startup_s`` (compilation, warm-up, the data loader's first fetch).
An explicit ceiling caps it. Crossing the bound is a suspicion only: the agent
then checks the lagging ranks' liveness (launcher/recovery/hang.py) and
stretches the bound for a rank that is alive and busy elsewhere.

Pure: no clock, no I/O; the runtime feeds durations, tests feed numbers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# No bound below this (scheduler noise, a page fault storm, a GC pause). Under a second, so that a
# stopped rank is found within a second of the fault with the agent's 0.1 s tick; a suspicion this
# early costs nothing, since only a stopped, deaf or dead laggard confirms it (launcher/recovery/hang.py).
FLOOR_S = 0.8
MULT = 5.0  # the shim's multiplier on its longest collective, the same rule
STARTUP_S = 10.0  # the first minibatches: compilation, warm-up, the loader's first batch
WARMUP = 2  # minibatches under the start-up bound
WINDOW = 200  # recent samples a quantile is taken over
QUANTILE = 0.99


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile of ``values`` (non-empty), q in [0, 1]."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Rule:
    """The constants of the rule (contract.py carries them to the workers and the shim)."""

    floor_s: float = FLOOR_S
    mult: float = MULT
    startup_s: float = STARTUP_S
    warmup: int = WARMUP
    ceiling_s: float | None = None  # an explicit --jit-timeout: never longer than this
    fixed: bool = False  # --jit-timeout fixed:S: the bound is the ceiling, nothing is learned

    def __post_init__(self) -> None:
        if self.fixed and self.ceiling_s is None:
            raise ValueError("a fixed hang bound needs its seconds (--jit-timeout fixed:SECONDS)")
        for name in ("floor_s", "mult", "startup_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hang bound {name} must be > 0, got {getattr(self, name)!r}")


class HangBound:
    """One rank's view: its minibatch durations, its waits per process group."""

    def __init__(self, rule: Rule | None = None, window: int = WINDOW) -> None:
        self.rule = rule or Rule()
        self.minibatches = 0
        self._mb: deque[float] = deque(maxlen=window)
        self._waits: dict[str, deque[float]] = {}
        self._window = window

    def observe_minibatch(self, seconds: float) -> None:
        self.minibatches += 1
        if seconds >= 0:
            self._mb.append(seconds)

    def observe_wait(self, group: str, seconds: float) -> None:
        if seconds >= 0:
            self._waits.setdefault(group, deque(maxlen=self._window)).append(seconds)

    def groups(self) -> list[str]:
        return list(self._waits)

    def typical(self, group: str | None = None) -> float:
        """The high quantile of recent minibatches and of waits (in ``group``,
        or in any group); 0 before anything was observed."""
        t = quantile(list(self._mb), QUANTILE) if self._mb else 0.0
        groups = [group] if group is not None else list(self._waits)
        for g in groups:
            w = self._waits.get(g)
            if w:
                t = max(t, quantile(list(w), QUANTILE))
        return t

    def bound(self, group: str | None = None) -> float:
        """Seconds a wait in ``group`` (None: the longest over every group) may
        last before the agent checks the ranks it waits for."""
        r = self.rule
        if r.fixed:
            assert r.ceiling_s is not None
            return r.ceiling_s
        b = max(r.floor_s, r.mult * self.typical(group))
        if self.minibatches < r.warmup:
            b = max(b, r.startup_s)
        return b if r.ceiling_s is None else min(b, r.ceiling_s)


def parse_timeout(raw: str) -> tuple[float, bool]:
    """``--jit-timeout``'s value: ``S`` (a ceiling on the learned bound) or
    ``fixed:S`` (the old fixed timeout, nothing learned) as (seconds, fixed).
    Raises ValueError for another form; the range is the caller's check."""
    text = raw.strip()
    fixed = text.lower().startswith("fixed:")
    try:
        return float(text[6:] if fixed else text), fixed
    except ValueError:
        raise ValueError(f"{raw!r} is not SECONDS or fixed:SECONDS (e.g. 300 or fixed:120)") from None
