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
    "jit_transparent_waste",
    "jit_user_waste",
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
