"""Failure-overhead cost model from the JIT-checkpointing paper (EuroSys '24, §5).

Pure Python (no torch). Symbols follow the paper:

* ``N`` -- number of GPUs in the job.
* ``f`` -- failure rate, failures per GPU per second.
* ``o`` -- cost of one periodic checkpoint, seconds (GPU time lost per GPU).
* ``r`` -- fixed recovery cost per failure (restart, init, restore), seconds.
* ``m`` -- minibatch iteration time, seconds.
* ``o_jit`` -- JIT steady-state overhead, a fraction of time (seconds lost per
  second of useful training, per GPU).
* ``c`` -- periodic checkpoint frequency, checkpoints per second.

Every ``*_waste`` function returns ``w``: wasted GPU time per GPU per unit of
useful training time (dimensionless, seconds per second), i.e. the paper's
``W / (N t)``. :func:`wasted_fraction` turns ``w`` into the fraction of wall
time that is wasted (eq. 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0

__all__ = [
    "SECONDS_PER_DAY",
    "SECONDS_PER_HOUR",
    "CostParams",
    "failures_per_gpu_second",
    "ec_overhead",
    "jit_backstop_waste",
    "jit_ec_waste",
    "jit_transparent_waste",
    "jit_user_waste",
    "optimal_ec_interval",
    "optimal_checkpoint_frequency",
    "periodic_optimal_waste",
    "periodic_waste",
    "wasted_fraction",
]


def _check_number(name: str, value: float, *, positive: bool, unit: str) -> float:
    """Return ``value`` as float; raise TypeError/ValueError naming the parameter."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number ({unit}), got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number ({unit}), got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0 ({unit}), got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be >= 0 ({unit}), got {value!r}")
    return value


def _check_gpus(n_gpus: int) -> int:
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int):
        raise TypeError(f"n_gpus (N) must be an integer >= 1, got {n_gpus!r}")
    if n_gpus < 1:
        raise ValueError(f"n_gpus (N) must be an integer >= 1, got {n_gpus!r}")
    return n_gpus


def failures_per_gpu_second(per_gpu_day: float) -> float:
    """Convert a failure rate in failures per GPU per day to per GPU per second."""
    rate = _check_number(
        "failures_per_gpu_day (f)",
        per_gpu_day,
        positive=True,
        unit="failures per GPU per day",
    )
    return rate / SECONDS_PER_DAY


@dataclass(frozen=True)
class CostParams:
    """Per-job parameters of the cost model. All validated on construction.

    Attributes:
        ckpt_seconds: ``o``, seconds per periodic checkpoint (> 0).
        restore_seconds: ``r``, fixed recovery cost per failure in seconds (>= 0).
            The paper uses the same ``r`` for periodic and user-level JIT.
        minibatch_seconds: ``m``, seconds per minibatch iteration (>= 0).
        failure_rate: ``f``, failures per GPU per second (> 0).
        jit_overhead: ``o_jit``, JIT steady-state overhead as a fraction of time
            (seconds per second, >= 0), e.g. per-minibatch overhead / ``m``.
    """

    ckpt_seconds: float
    restore_seconds: float
    minibatch_seconds: float
    failure_rate: float
    jit_overhead: float = 0.0

    def __post_init__(self) -> None:
        checks = (
            ("ckpt_seconds", "ckpt_seconds (o)", True, "seconds per checkpoint"),
            ("restore_seconds", "restore_seconds (r)", False, "seconds per failure"),
            (
                "minibatch_seconds",
                "minibatch_seconds (m)",
                False,
                "seconds per minibatch",
            ),
            ("failure_rate", "failure_rate (f)", True, "failures per GPU per second"),
            ("jit_overhead", "jit_overhead (o_jit)", False, "fraction of time"),
        )
        for attr, label, positive, unit in checks:
            value = _check_number(
                label, getattr(self, attr), positive=positive, unit=unit
            )
            object.__setattr__(self, attr, value)


def optimal_checkpoint_frequency(p: CostParams, n_gpus: int) -> float:
    """Optimal periodic checkpoint frequency ``c* = sqrt(N f / (2 o))`` (eq. 3).

    Returns checkpoints per second.
    """
    n = _check_gpus(n_gpus)
    return math.sqrt(n * p.failure_rate / (2.0 * p.ckpt_seconds))


def periodic_waste(p: CostParams, n_gpus: int, frequency: float) -> float:
    """Wasted time per GPU per unit time at checkpoint frequency ``c`` (eq. 1 / N t).

    ``w = c o + N f r + N f / (2 c)``; ``frequency`` is in checkpoints per second
    (> 0). Returns seconds wasted per second of useful training.
    """
    n = _check_gpus(n_gpus)
    c = _check_number(
        "frequency (c)", frequency, positive=True, unit="checkpoints per second"
    )
    nf = n * p.failure_rate
    return c * p.ckpt_seconds + nf * p.restore_seconds + nf / (2.0 * c)


def periodic_optimal_waste(p: CostParams, n_gpus: int) -> float:
    """Wasted time per GPU per unit time at ``c*`` (eq. 5).

    ``w* = sqrt(N f o / 2) + N f r + sqrt(N f o / 2)``.
    """
    n = _check_gpus(n_gpus)
    nf = n * p.failure_rate
    half = math.sqrt(nf * p.ckpt_seconds / 2.0)
    return half + nf * p.restore_seconds + half


def jit_user_waste(p: CostParams, n_gpus: int) -> float:
    """Wasted time per GPU per unit time, user-level JIT (eq. 7 / N t).

    ``w = f o + o_jit + N f r + N f m / 2``.
    """
    n = _check_gpus(n_gpus)
    f = p.failure_rate
    return (
        f * p.ckpt_seconds
        + p.jit_overhead
        + n * f * p.restore_seconds
        + n * f * p.minibatch_seconds / 2.0
    )


def jit_transparent_waste(p: CostParams, n_gpus: int) -> float:
    """Wasted time per GPU per unit time, transparent JIT, transient errors (eq. 8 / N t).

    ``w = o_jit + N f m / 2``.
    """
    n = _check_gpus(n_gpus)
    return p.jit_overhead + n * p.failure_rate * p.minibatch_seconds / 2.0


def wasted_fraction(w: float) -> float:
    """Fraction of total wall time that is wasted, ``w / (1 + w)`` (eq. 6).

    ``w`` is wasted time per unit of useful time (>= 0); result is in [0, 1).
    """
    w = _check_number(
        "w (wasted time per unit time)", w, positive=False, unit="seconds per second"
    )
    return w / (1.0 + w)


# -- the EC tier: JIT + erasure-coded in-memory snapshots ------------------------------------------
#
# The paper's JIT recovery assumes a healthy data-parallel replica of every shard survives the failure. Let
# ``p`` (--correlated-fraction) be the fraction of failures that take every replica of some shard (a job-wide
# crash, a power domain, a switch): then no JIT checkpoint can be taken. Of those, a fraction ``q``
# (--ec-undecodable-fraction) also loses more than M nodes' memory, so the EC snapshots cannot be decoded either.
# With EC snapshots every ``T_ec`` seconds (``--jit-ec-every N``: T_ec = N m), each costing ``s`` seconds of
# training stall (the save_fn into tmpfs; packing, coding and placing run in the background):
#
#   o_ec = s / T_ec                                                          steady-state EC overhead
#   w_jit+ec = o_jit + o_ec + N f r + (1-p) f o                              JIT save on the failures it covers
#            + N f [ (1-p) m/2 + p (1-q) T_ec/2 ]                            redone work: 1/2 minibatch or 1/2 interval
#            + sqrt(2 N f p q o)                                             persistent backstop for the rest
#
# The last term is periodic checkpointing (eq. 1) at its optimal frequency c_b = sqrt(N f p q / (2 o)) for the
# failures neither JIT nor EC covers: c_b o + N f p q / (2 c_b). Without EC (q = 1, o_ec = 0) this is "JIT +
# periodic backstop" (``jit_backstop_waste``); with p = 0 both reduce to the paper's eq. 7 (``jit_user_waste``).
# The EC interval that minimises w_jit+ec is T_ec* = sqrt(2 s / (N f p (1-q))) (``optimal_ec_interval``).


def _check_fraction(name: str, value: float) -> float:
    v = _check_number(name, value, positive=False, unit="fraction in [0, 1]")
    if v > 1:
        raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")
    return v


def ec_overhead(snapshot_seconds: float, interval_seconds: float) -> float:
    """``o_ec = s / T_ec``: training stall per EC snapshot over the time between snapshots (a fraction)."""
    s = _check_number("snapshot_seconds (s)", snapshot_seconds, positive=False, unit="seconds per snapshot")
    t = _check_number("interval_seconds (T_ec)", interval_seconds, positive=True, unit="seconds between snapshots")
    return s / t


def _backstop(nf: float, o: float, uncovered: float) -> float:
    """Optimal periodic checkpoints for the fraction ``uncovered`` of failures: ``sqrt(2 N f u o)``."""
    return math.sqrt(2.0 * nf * uncovered * o)


def jit_backstop_waste(p: CostParams, n_gpus: int, correlated_fraction: float) -> float:
    """User-level JIT plus optimal periodic persistent checkpoints for the correlated failures (no EC).

    ``w = o_jit + N f r + (1-p) f o + N f (1-p) m/2 + sqrt(2 N f p o)``; equals :func:`jit_user_waste` at p = 0.
    """
    n = _check_gpus(n_gpus)
    c = _check_fraction("correlated_fraction (p)", correlated_fraction)
    nf = n * p.failure_rate
    return (p.jit_overhead + nf * p.restore_seconds + (1 - c) * p.failure_rate * p.ckpt_seconds
            + nf * (1 - c) * p.minibatch_seconds / 2.0 + _backstop(nf, p.ckpt_seconds, c))


def jit_ec_waste(p: CostParams, n_gpus: int, correlated_fraction: float, ec_interval_seconds: float,
                 ec_snapshot_seconds: float = 0.0, undecodable_fraction: float = 0.0) -> float:
    """User-level JIT with EC snapshots every ``ec_interval_seconds`` as the fallback (see the block comment).

    ``w = o_jit + s/T_ec + N f r + (1-p) f o + N f [(1-p) m/2 + p (1-q) T_ec/2] + sqrt(2 N f p q o)``.
    """
    n = _check_gpus(n_gpus)
    c = _check_fraction("correlated_fraction (p)", correlated_fraction)
    q = _check_fraction("undecodable_fraction (q)", undecodable_fraction)
    t = _check_number("ec_interval_seconds (T_ec)", ec_interval_seconds, positive=True, unit="seconds")
    nf = n * p.failure_rate
    redo = (1 - c) * p.minibatch_seconds / 2.0 + c * (1 - q) * t / 2.0
    return (p.jit_overhead + ec_overhead(ec_snapshot_seconds, t) + nf * p.restore_seconds
            + (1 - c) * p.failure_rate * p.ckpt_seconds + nf * redo + _backstop(nf, p.ckpt_seconds, c * q))


def optimal_ec_interval(p: CostParams, n_gpus: int, correlated_fraction: float, ec_snapshot_seconds: float,
                        undecodable_fraction: float = 0.0) -> float:
    """``T_ec* = sqrt(2 s / (N f p (1-q)))`` seconds: balances the snapshot stall against half an interval
    redone on the failures only EC covers. ``inf`` when EC covers none (p = 0 or q = 1): snapshots off;
    0 when snapshots cost nothing (s = 0)."""
    n = _check_gpus(n_gpus)
    c = _check_fraction("correlated_fraction (p)", correlated_fraction)
    q = _check_fraction("undecodable_fraction (q)", undecodable_fraction)
    s = _check_number("ec_snapshot_seconds (s)", ec_snapshot_seconds, positive=False, unit="seconds per snapshot")
    covered = n * p.failure_rate * c * (1 - q)
    if covered == 0:
        return math.inf
    return math.sqrt(2.0 * s / covered)
