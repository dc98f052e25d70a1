"""The fault matrix against a training script of its own (tests/fault_train.py:
DataLoader with a shuffling DistributedSampler, epochs, a metric all-reduce at
the start of each minibatch, a barrier after the loop): kinds x phases, first
and last step, double faults, a failure inside the save, a corrupted newest
checkpoint. Every case must end bit-identical to a failure-free plain-torchrun
run with at most one minibatch redone per failure (the corrupted-newest case:
restored from the newest valid checkpoint), and the events must agree with
what the ranks logged. No --jit-timeout is given: a stopped or hung rank is
found by the hang bound learned from the job's own timing."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import assert_same_state, assert_verified_fingerprint, run_reference, run_tree

SCRIPT = Path(__file__).with_name("fault_train.py")
STEPS = 18  # 3 epochs x 6 minibatches with 2 ranks
MID = 7  # the second minibatch of epoch 1


def _events(jit: Path) -> list[dict]:
    p = jit / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _run(tmp: Path, fault: str = "", extra: list[str] = (), nproc: int = 2) -> tuple[int, str, list[dict], Path]:
    jit, out = tmp / "jit", tmp / "final.pt"
    cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", str(nproc),
           "--max-restarts", "3", "--jit-dir", str(jit), *extra,  # no --jit-timeout: hangs by the learned bound
           str(SCRIPT), "--out", str(out)]
    cp = run_tree(cmd, env={"JITCKPT_FAULT": fault} if fault else {}, timeout=240)
    return cp.returncode, cp.stdout, _events(jit), out


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fm") / "ref.pt"
    cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(SCRIPT), "--out", str(out)])
    assert cp.returncode == 0, cp.stdout[-3000:]
    return out


def _check(code: int, out_text: str, evs: list[dict], out: Path, ref: Path, failures: int = 1,
           max_redone: int = 1) -> None:
    assert code == 0, out_text[-5000:]
    assert_same_state(ref, out)
    recs = [e for e in evs if e["event"] == "recovery"]
    for r in recs:
        assert_verified_fingerprint(r)
    done = [e for e in evs if e["event"] == "finished_despite_failure"]
    assert len(recs) + len(done) == failures, (recs, done, out_text[-3000:])
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", out_text)]
    for r in recs:
        assert r["redone_minibatches"] is not None and r["redone_minibatches"] <= max_redone, r
        # the timeline's restore step is what the ranks said they loaded
        assert r["restore_step"] in resumed, (r, resumed)


KINDS = ["sigkill", "sigterm", "sigint", "sigstop", "sigsegv", "abort", "hang", "exception", "exit"]
CASES = sorted({(k, p) for k in KINDS for p in ("forward", "optimizer")}
               | {(k, p) for k in ("sigkill", "sigterm") for p in ("forward", "backward", "allreduce", "optimizer")})


@pytest.mark.slow
@pytest.mark.parametrize("kind,phase", CASES)
def test_matrix(tmp_path, ref, kind, phase):
    _check(*_run(tmp_path, f"rank=1,step={MID},phase={phase},kind={kind}"), ref)


def test_matrix_short(tmp_path, ref):
    """The short form, outside the slow marker."""
    _check(*_run(tmp_path, f"rank=1,step={MID},phase=backward,kind=sigkill"), ref)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["forward", "optimizer"])
@pytest.mark.parametrize("step", [0, STEPS - 1])
def test_first_and_last_step(tmp_path, ref, step, phase):
    _check(*_run(tmp_path, f"rank=0,step={step},phase={phase},kind=sigkill"), ref)


@pytest.mark.slow
def test_double_fault(tmp_path, ref):
    fault = f"rank=1,step=3,phase=backward,kind=sigkill;rank=0,step={MID + 4},phase=optimizer,kind=sigstop,attempt=1"
    _check(*_run(tmp_path, fault), ref, failures=2)


@pytest.mark.slow
def test_both_ranks_killed_at_once_says_what_it_knows(tmp_path, ref):
    """No healthy replica: restart from the newest older checkpoint (here an
    earlier failure's), and the timeline says how many minibatches that redoes:
    the killed ranks said their step before they died, no survivor did."""
    fault = "rank=1,step=3,phase=backward,kind=sigkill;rank=0,step=9,phase=forward,kind=sigkill,attempt=1;" \
            "rank=1,step=9,phase=forward,kind=sigkill,attempt=1"
    code, text, evs, out = _run(tmp_path, fault)
    assert code == 0, text[-4000:]
    assert_same_state(ref, out)
    second = [e for e in evs if e["event"] == "recovery"][-1]
    assert_verified_fingerprint(second)
    assert second["restore_step"] == 3, second
    assert second["redone_minibatches"] == 7 and second["progress_step"] == 9, second  # 9 + 1 - 3


@pytest.mark.slow
def test_failure_inside_the_save(tmp_path, ref):
    """Rank 2 killed; rank 0 dies inside its own JIT save: rank 1's replica is used."""
    code, text, evs, out = _run(tmp_path, "rank=2,step=4,phase=backward,kind=sigkill;rank=0,phase=save,kind=exit",
                                nproc=3)
    assert code == 0, text[-4000:]
    assert [e["rank"] for e in evs if e["event"] == "checkpoint_saved"] == [1]


@pytest.mark.slow
def test_corrupted_newest_checkpoint_falls_back_to_newest_valid(tmp_path, ref):
    """After the second failure the scheduler hook corrupts every replica of
    the chosen step: the ranks fall back to the first failure's step, say so,
    agree on it (consistency check), and finish bit-identical."""
    hook = tmp_path / "corrupt.py"
    hook.write_text(
        "import json, sys, pathlib\n"
        "info = json.load(sys.stdin)\n"
        "if info['restart_count'] == 2:  # the second failure\n"
        f"    root = pathlib.Path({str(tmp_path / 'jit')!r}) / 'ckpt' / f\"step-{{info['restore_step']}}\"\n"
        "    for p in root.glob('shard-*/rank-*/state.pt'):\n"
        "        b = bytearray(p.read_bytes()); b[len(b) // 2] ^= 0xFF; p.write_bytes(bytes(b))\n"
        "print(json.dumps({'action': 'restart'}))\n")
    exe = tmp_path / "hook"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {hook}\n")
    exe.chmod(0o700)
    fault = "rank=1,step=3,phase=backward,kind=sigkill;rank=1,step=10,phase=backward,kind=sigkill,attempt=1"
    code, text, evs, out = _run(tmp_path, fault, extra=["--jit-scheduler", f"exec:{exe}"])
    assert code == 0, text[-4000:]
    assert_same_state(ref, out)
    assert "no valid replica of the chosen step 10" in text and "falling back to step 3" in text
    fallbacks = [e for e in evs if e["event"] == "restore_fallback"]
    assert fallbacks and all(e["chosen"] == 10 and e["used"] == 3 for e in fallbacks), fallbacks
    recs = [e for e in evs if e["event"] == "recovery"]
    assert [e["restore_step"] for e in recs] == [3, 3]
    for r in recs:
        assert_verified_fingerprint(r)
