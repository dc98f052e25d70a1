"""`jitrun plan` learns the EC tier: the cost model's EC functions (jitrun.cost_model) and the plan's
EC columns (jitrun.plan)."""

from __future__ import annotations

import json
import math

import pytest

from jitrun import cost_model as model
from jitrun import plan

F = model.failures_per_gpu_second(2e-3)
P = model.CostParams(ckpt_seconds=60.0, restore_seconds=30.0, minibatch_seconds=1.0, failure_rate=F)
BASE = ["--ckpt-seconds", "60", "--restore-seconds", "30", "--minibatch-seconds", "1",
        "--failures-per-gpu-day", "2e-3", "--gpus", "1024"]


# -- model ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 8, 1024, 8192])
def test_no_correlated_failures_reduces_to_the_papers_jit(n):
    assert model.jit_backstop_waste(P, n, 0.0) == pytest.approx(model.jit_user_waste(P, n))
    assert model.jit_ec_waste(P, n, 0.0, 50.0) == pytest.approx(model.jit_user_waste(P, n))
    # EC costs its overhead and buys nothing when JIT covers every failure
    assert model.jit_ec_waste(P, n, 0.0, 50.0, 0.5) == pytest.approx(model.jit_user_waste(P, n) + 0.01)


@pytest.mark.parametrize("n", [8, 1024])
def test_all_failures_correlated_without_ec_is_periodic(n):
    # nothing JIT can save: the backstop is periodic checkpointing at its optimum (eq. 5)
    assert model.jit_backstop_waste(P, n, 1.0) == pytest.approx(model.periodic_optimal_waste(P, n))
    # EC that never decodes (q = 1) and costs nothing is the same as no EC
    for c in (0.0, 0.3, 1.0):
        assert model.jit_ec_waste(P, n, c, 50.0, 0.0, 1.0) == pytest.approx(model.jit_backstop_waste(P, n, c))


def test_jit_ec_waste_formula_by_hand():
    n, c, q, t, s = 1024, 0.1, 0.2, 50.0, 0.5
    nf = n * F
    want = (0 + s / t + nf * 30 + (1 - c) * F * 60 + nf * ((1 - c) * 1 / 2 + c * (1 - q) * t / 2)
            + math.sqrt(2 * nf * c * q * 60))
    assert model.jit_ec_waste(P, n, c, t, s, q) == pytest.approx(want, rel=1e-12)
    assert model.ec_overhead(0.5, 50.0) == 0.01


def test_optimal_ec_interval_minimises_the_waste():
    n, c, q, s = 1024, 0.1, 0.0, 0.5
    t = model.optimal_ec_interval(P, n, c, s, q)
    assert t == pytest.approx(math.sqrt(2 * s / (n * F * c)))
    w = model.jit_ec_waste(P, n, c, t, s, q)
    for k in (0.5, 0.9, 1.1, 2.0):
        assert w < model.jit_ec_waste(P, n, c, t * k, s, q)
    assert model.optimal_ec_interval(P, n, 0.0, s) == math.inf  # EC covers nothing: off
    assert model.optimal_ec_interval(P, n, 0.5, s, 1.0) == math.inf
    assert model.optimal_ec_interval(P, n, 0.5, 0.0) == 0.0  # free snapshots: as often as possible


def test_ec_beats_the_backstop_when_snapshots_are_cheap_and_failures_correlated():
    for n in (1024, 8192):
        assert model.jit_ec_waste(P, n, 0.1, 50.0, 0.5) < model.jit_backstop_waste(P, n, 0.1)
        assert model.jit_ec_waste(P, n, 0.1, 50.0, 0.5) < model.periodic_optimal_waste(P, n)


@pytest.mark.parametrize("call", [
    lambda: model.jit_backstop_waste(P, 8, 1.5),
    lambda: model.jit_backstop_waste(P, 8, -0.1),
    lambda: model.jit_ec_waste(P, 8, 0.1, 0.0),
    lambda: model.jit_ec_waste(P, 8, 0.1, 10.0, -1.0),
    lambda: model.jit_ec_waste(P, 8, 0.1, 10.0, 0.1, 2.0),
    lambda: model.optimal_ec_interval(P, 8, math.nan, 0.1),
    lambda: model.ec_overhead(0.1, 0.0),
])
def test_ec_model_rejects_bad_inputs(call):
    with pytest.raises(ValueError):
        call()


# -- jitrun plan ------------------------------------------------------------------------------------------


def _run(capsys, *argv):
    rc = plan.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_without_ec_flags_the_output_is_unchanged(capsys):
    rc, out, _ = _run(capsys, *BASE, "--json")
    assert rc == 0 and set(json.loads(out)[0]) == {
        "gpus", "periodic_optimal_per_hour", "periodic_wasted_fraction", "jit_user_wasted_fraction",
        "jit_transparent_wasted_fraction"}
    rc, out, _ = _run(capsys, *BASE)
    assert "JIT+EC" not in out and "correlated" not in out


def test_ec_columns_json(capsys):
    rc, out, err = _run(capsys, *BASE, "--correlated-fraction", "0.1", "--ec-every", "50",
                        "--ec-snapshot-seconds", "0.5", "--json")
    assert rc == 0, err
    row = json.loads(out)[0]
    assert row["correlated_fraction"] == 0.1 and row["ec_every"] == 50 and row["ec_overhead"] == 0.01
    assert row["jit_ec_wasted_fraction"] == pytest.approx(
        model.wasted_fraction(model.jit_ec_waste(P, 1024, 0.1, 50.0, 0.5)))
    assert row["jit_backstop_wasted_fraction"] == pytest.approx(
        model.wasted_fraction(model.jit_backstop_waste(P, 1024, 0.1)))
    assert row["ec_every_optimal"] == round(model.optimal_ec_interval(P, 1024, 0.1, 0.5))
    assert row["jit_ec_optimal_wasted_fraction"] <= row["jit_ec_wasted_fraction"]
    assert row["ec_backstop_per_hour"] == 0.0 and row["backstop_per_hour"] > 0


def test_ec_overhead_is_the_same_as_its_snapshot_seconds(capsys):
    _, a, _ = _run(capsys, *BASE, "--correlated-fraction", "0.2", "--ec-every", "40", "--ec-overhead", "0.02",
                   "--json")
    _, b, _ = _run(capsys, *BASE, "--correlated-fraction", "0.2", "--ec-every", "40", "--ec-snapshot-seconds",
                   "0.8", "--json")
    ra, rb = json.loads(a)[0], json.loads(b)[0]
    assert ra.keys() == rb.keys() and all(ra[k] == pytest.approx(rb[k]) for k in ra)


def test_ec_table_and_notes(capsys):
    rc, out, _ = _run(capsys, *BASE, "--gpus", "8", "8192", "--correlated-fraction", "0.1", "--ec-every", "50",
                      "--ec-snapshot-seconds", "0.5", "--ec-undecodable-fraction", "0.05")
    assert rc == 0
    for part in ("correlated failures (every replica of a shard lost) p = 0.1; of those undecodable q = 0.05",
                 "EC stall per snapshot s = 0.5 s", "o_ec = 0.01", "JIT+periodic backstop", "JIT+EC waste",
                 "best --jit-ec-every", "JIT+EC at best"):
        assert part in out, (part, out)
    header = next(line for line in out.splitlines() if line.strip().startswith("GPUs"))
    lines = out.splitlines()
    body = lines[lines.index(header) + 2:]
    assert len(body) == 2 and all(len(b.split()) == 6 + 4 for b in body), body  # the paper's 6 + 4 EC columns
    # only --correlated-fraction: the backstop column, no EC column
    rc, out, _ = _run(capsys, *BASE, "--correlated-fraction", "0.3")
    assert rc == 0 and "JIT+periodic backstop" in out and "JIT+EC" not in out
    # EC without correlated failures is said to be pure overhead
    rc, out, _ = _run(capsys, *BASE, "--ec-every", "10", "--ec-snapshot-seconds", "0.1")
    assert rc == 0 and "pure overhead" in out and "off" in out  # best interval: snapshots off


@pytest.mark.parametrize("argv,msg", [
    (["--correlated-fraction", "1.5"], "--correlated-fraction must be a fraction in [0, 1]"),
    (["--correlated-fraction", "-2e-1"], "--correlated-fraction must be a fraction in [0, 1]"),
    (["--ec-undecodable-fraction", "2"], "--ec-undecodable-fraction must be a fraction"),
    (["--ec-every", "0"], "--ec-every must be a number of minibatches >= 1"),
    (["--ec-every", "5", "--ec-snapshot-seconds", "-1"], "--ec-snapshot-seconds must be >= 0"),
    (["--ec-overhead", "0.01"], "pass --ec-every N too"),
    (["--ec-every", "5", "--ec-overhead", "0.01", "--ec-snapshot-seconds", "1"], "pass one of them"),
])
def test_bad_ec_flags(capsys, argv, msg):
    rc, _out, err = _run(capsys, *BASE, *argv)
    assert rc == 2 and msg in err, err
