"""Unit tests for jitckpt.faults: JITCKPT_FAULT parsing and the Injector."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from jitckpt import faults
from jitckpt.faults import Fault, InjectedFault, Injector

# --- parse ---------------------------------------------------------------------


def test_parse_single_spec():
    (f,) = faults.parse("rank=1,step=3,phase=backward,kind=sigkill")
    assert (f.rank, f.step, f.phase, f.kind, f.attempt, f.fired) == (1, 3, "backward", "sigkill", 0, False)


def test_parse_multiple_specs_and_whitespace():
    fs = faults.parse(" rank=2, step=4 ,phase=forward,kind=sigkill ; rank=0,phase=save,kind=exit,attempt=1;")
    assert [(f.rank, f.step, f.phase, f.kind, f.attempt) for f in fs] == [
        (2, 4, "forward", "sigkill", 0),
        (0, 0, "save", "exit", 1),
    ]


def test_parse_defaults():
    (f,) = faults.parse("rank=0,phase=optimizer,kind=hang")
    assert f.step == 0 and f.attempt == 0


def test_parse_empty_is_no_faults():
    assert faults.parse("") == []
    assert faults.parse(" ; ") == []


@pytest.mark.parametrize("spec, needle", [
    ("rank=1,kind=exit", "needs rank=, phase= and kind="),
    ("phase=forward,kind=exit", "needs rank=, phase= and kind="),
    ("rank=1,phase=forward", "needs rank=, phase= and kind="),
    ("rank=1,phase=forward,kind=exit,when=now", "unknown keys ['when']"),
    ("rank=1,phase=sideways,kind=exit", "phase 'sideways' not one of"),
    ("rank=1,phase=forward,kind=explode", "kind 'explode' not one of"),
    ("rank=1,phase=forward,kind", "'kind' in 'rank=1,phase=forward,kind' is not key=value"),
])
def test_parse_errors_name_the_problem(spec, needle):
    with pytest.raises(ValueError) as ei:
        faults.parse(spec)
    assert "JITCKPT_FAULT" in str(ei.value)
    assert needle in str(ei.value)


def test_parse_error_in_second_spec_is_reported():
    with pytest.raises(ValueError, match="kind 'nope'"):
        faults.parse("rank=0,phase=forward,kind=exit;rank=1,phase=forward,kind=nope")


def test_parse_non_integer_rank_is_an_error():
    with pytest.raises(ValueError):
        faults.parse("rank=one,phase=forward,kind=exit")


# --- Injector --------------------------------------------------------------------

SPEC = ("rank=1,step=2,phase=forward,kind=exception;"
        "rank=0,step=2,phase=forward,kind=exception;"
        "rank=1,step=5,phase=backward,kind=exception,attempt=1")


def test_injector_filters_by_rank_and_attempt():
    inj = Injector(SPEC, rank=1, attempt=0)
    assert [(f.rank, f.step, f.phase, f.attempt) for f in inj.pending] == [(1, 2, "forward", 0)]
    inj = Injector(SPEC, rank=1, attempt=1)
    assert [(f.rank, f.step, f.phase, f.attempt) for f in inj.pending] == [(1, 5, "backward", 1)]
    assert Injector(SPEC, rank=2, attempt=0).pending == []
    assert Injector(SPEC, rank=0, attempt=1).pending == []


def test_injector_fires_at_its_step_and_phase_only_once():
    inj = Injector("rank=1,step=2,phase=forward,kind=exception", rank=1, attempt=0)
    inj.maybe_fire("forward", 1)  # wrong step
    inj.maybe_fire("backward", 2)  # wrong phase
    with pytest.raises(InjectedFault, match="rank 1 step 2 phase forward"):
        inj.maybe_fire("forward", 2)
    assert inj.pending[0].fired
    inj.maybe_fire("forward", 2)  # fires at most once per process
    assert inj.armed("forward", 2) is None


def test_other_rank_never_fires():
    inj = Injector("rank=1,step=0,phase=forward,kind=exception", rank=0, attempt=0)
    for step in range(3):
        inj.maybe_fire("forward", step)


def test_save_phase_ignores_step():
    inj = Injector("rank=0,step=3,phase=save,kind=exception", rank=0, attempt=0)
    assert inj.armed("save", 17) is not None
    with pytest.raises(InjectedFault):
        inj.maybe_fire("save", 17)
    inj.maybe_fire("save", 3)  # already fired


def test_announce_called_before_the_fault_executes():
    seen: list[Fault] = []
    inj = Injector("rank=0,step=1,phase=optimizer,kind=exception", rank=0, attempt=0, announce=seen.append)
    inj.maybe_fire("optimizer", 0)
    assert seen == []
    with pytest.raises(InjectedFault):
        inj.maybe_fire("optimizer", 1)
    # the exception is raised by execute(); the announcement had already happened
    assert len(seen) == 1 and seen[0].phase == "optimizer" and seen[0].kind == "exception"


def test_announce_sees_fault_before_execute(monkeypatch):
    order: list[str] = []
    monkeypatch.setattr(faults, "execute", lambda kind, where: order.append(f"execute {kind}"))
    inj = Injector("rank=0,phase=forward,kind=sigkill", rank=0, attempt=0,
                   announce=lambda f: order.append(f"announce {f.kind}"))
    inj.maybe_fire("forward", 0)
    assert order == ["announce sigkill", "execute sigkill"]


def test_injected_fault_is_a_runtime_error():
    # the runtime tells it apart from collective errors by type; keep it a RuntimeError
    assert issubclass(InjectedFault, RuntimeError)


# --- kinds that end the process: only in a child process -------------------------------


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_exit_kind_exits_13():
    p = _child("from jitckpt import faults; faults.execute('exit', 'x'); print('survived')")
    out, err = p.communicate(timeout=60)
    assert p.returncode == faults.EXIT_INJECTED == 13, err
    assert "survived" not in out


def test_sigkill_kind_kills_self():
    p = _child("from jitckpt import faults; faults.execute('sigkill', 'x'); print('survived')")
    out, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, err
    assert "survived" not in out


def _sigterm_blocked(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigBlk:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
def test_hang_holding_gil_ignores_sigterm():
    code = ("from jitckpt import faults; print('ready', flush=True); "
            "faults.hang_holding_gil(); print('returned', flush=True)")
    p = _child(code)
    try:
        assert p.stdout.readline().strip() == "ready"
        # SIGTERM's default action would kill the child before it reaches sigsuspend;
        # wait until the full mask of sigsuspend is in force (no timing involved).
        deadline = time.monotonic() + 60
        while not _sigterm_blocked(p.pid):
            assert p.poll() is None and time.monotonic() < deadline, "child never reached sigsuspend"
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=1.0)
        assert p.poll() is None
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        p.stdout.close()
        p.stderr.close()
    assert p.returncode == -signal.SIGKILL


# --- bitflip: silent corruption of the state ----------------------------------------------


def test_parse_bitflip_defaults_to_the_optimizer_phase():
    (f,) = faults.parse("rank=2,step=43,kind=bitflip")
    assert (f.rank, f.step, f.phase, f.kind, f.target, f.bit) == (2, 43, "optimizer", "bitflip", "param", 20)
    (g,) = faults.parse("rank=0,step=1,kind=bitflip,target=optim,bit=3")
    assert (g.target, g.bit) == ("optim", 3)


@pytest.mark.parametrize("spec, needle", [
    ("rank=1,kind=bitflip,phase=forward", "kind=bitflip fires after an optimizer step"),
    ("rank=1,kind=bitflip,target=grads", "target 'grads' not one of"),
    ("rank=1,kind=exit,phase=forward,target=param", "go with kind=bitflip only"),
    ("rank=1,kind=bitflip,bit=x", "bit='x'"),
    ("rank=1,kind=swap,phase=forward", "kind=stale or swap goes with phase=restore"),
])
def test_parse_bitflip_errors(spec, needle):
    with pytest.raises(ValueError, match="JITCKPT_FAULT") as ei:
        faults.parse(spec)
    assert needle in str(ei.value)


def _adam():
    import torch

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    return lin, opt


@pytest.mark.parametrize("target", ["param", "optim"])
def test_flip_bit_changes_exactly_one_bit(target):
    import torch

    lin, opt = _adam()
    t = lin.weight if target == "param" else opt.state[lin.weight]["exp_avg"]
    before = t.detach().clone()
    what = faults.flip_bit(opt, target, 20)
    assert ("exp_avg" in what) == (target == "optim")
    diff = before.view(-1).view(torch.uint8) ^ t.detach().view(-1).view(torch.uint8)
    assert [int(x) for x in diff.nonzero().view(-1)] == [2] and int(diff[2]) == 1 << 4


def test_maybe_flip_fires_once_after_its_step_and_never_at_a_phase():
    lin, opt = _adam()
    seen: list[Fault] = []
    inj = Injector("rank=0,step=3,kind=bitflip", rank=0, attempt=0, announce=seen.append)
    assert inj.armed("optimizer", 3) is None  # not a fault the phase hooks execute
    before = lin.weight.detach().clone()
    inj.maybe_flip(2, opt)
    assert seen == [] and bool((lin.weight == before).all())
    inj.maybe_flip(3, opt)
    inj.maybe_flip(3, opt)
    assert len(seen) == 1 and int((lin.weight != before).sum()) == 1
