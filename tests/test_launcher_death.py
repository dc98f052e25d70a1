"""The launcher's death ends its job: ``kill -9`` of jitrun (what the OOM killer
does) takes every process it started with it (the workers save their replica
on the way: jitckpt/parent_death.py), and running the same command again
resumes from that save, bit-identical to a run without the kill, with at most
one minibatch redone. Leftovers of the dead run are recognised and cleaned;
workers of a dead jitrun that still run make a relaunch refuse."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import TRAIN, assert_same_state, run_tree

from jitckpt.wire.config import EXIT_NOT_SAVED, EXIT_SAVED

STEPS = 40


def _cmd(tmp: Path) -> list[str]:
    # the bare launch form
    return [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--jit-dir", str(tmp / "jit"),
            str(TRAIN), "--steps", str(STEPS), "--step-sleep", "0.15", "--log-every", "1",
            "--out", str(tmp / "final.pt")]


def _wait_for_training(tmp: Path, log: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            ranks = json.loads((tmp / "jit" / "ranks.json").read_text())["ranks"]
        except (OSError, ValueError, KeyError):
            ranks = {}
        if len(ranks) == 2 and "step    5 loss" in log.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"the job never reached step 5 (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


def _reap(pids: list[int], until: float) -> dict[int, int]:
    """Exit statuses of ``pids`` (this process is their subreaper once their parents died), by ``until``."""
    codes: dict[int, int] = {}
    while len(codes) < len(pids) and time.monotonic() < until:
        for pid in pids:
            if pid in codes:
                continue
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # not re-parented to us yet
            if got == pid:
                codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    return codes


@pytest.mark.slow
def test_kill_9_of_the_launcher_ends_the_job_and_a_relaunch_resumes(tmp_path, reference, subreaper):
    log = tmp_path / "run1.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_cmd(tmp_path), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_for_training(tmp_path, log, proc)
        tree = psutil.Process(proc.pid).children(recursive=True)
        kinds = {p.pid: " ".join(p.cmdline()) for p in tree}
        workers = [pid for pid, c in kinds.items() if "jitrun[rank" in c]
        server = [pid for pid, c in kinds.items() if "multiprocessing.forkserver" in c]
        tracker = [pid for pid, c in kinds.items() if "multiprocessing.resource_tracker" in c]
        assert len(workers) == 2 and len(server) == 1 and len(tracker) == 1, kinds
        os.kill(proc.pid, signal.SIGKILL)
        killed_t = time.monotonic()
        assert proc.wait(10) == -signal.SIGKILL
        codes = _reap(list(kinds), killed_t + 2.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    alive = [p for p in kinds if p not in codes and psutil.pid_exists(p)]
    for p in alive:  # the test's own clean-up; the assertion below fails
        os.kill(p, signal.SIGKILL)
    _reap(alive, time.monotonic() + 5)
    assert not alive, f"alive 2 s after the launcher's kill -9: {[kinds[p] for p in alive]}"
    # the workers saved (75), or one that the other's exit caught inside its optimizer step could not (76)
    assert {codes[p] for p in workers} <= {EXIT_SAVED, EXIT_NOT_SAVED} and EXIT_SAVED in {codes[p] for p in workers}, \
        {kinds[p]: codes[p] for p in codes}
    assert codes[server[0]] == -signal.SIGKILL, codes
    assert codes[tracker[0]] == 0, codes
    out1 = log.read_text()
    assert "Traceback" not in out1, out1[-4000:]
    done = [int(s) for s in re.findall(r"\[rank 0\] step +(\d+) loss", out1)]
    assert done and done[-1] < STEPS - 1, out1[-2000:]

    # the same command again: the dead run's leftovers said and cleaned, resumed where it stopped
    cp = run_tree(_cmd(tmp_path), env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert cp.returncode == 0, cp.stdout[-5000:]
    assert "Traceback" not in cp.stdout, cp.stdout[-5000:]
    said = [ln for ln in cp.stdout.splitlines() if "did not end cleanly" in ln]
    assert len(said) == 1 and f"jitrun PID {proc.pid}" in said[0], cp.stdout[-3000:]
    evs = [json.loads(ln) for ln in (tmp_path / "jit" / "events.jsonl").read_text().splitlines()]
    starts = [i for i, e in enumerate(evs) if e["event"] == "job_start"]
    assert len(starts) == 2, evs  # one log, both runs, no torn line
    loaded = [e["loaded"] for e in evs[starts[1]:] if e["event"] == "loaded"]
    assert len(loaded) == 2 and len(set(loaded)) == 1, loaded
    loaded = set(loaded)
    step = loaded.pop()
    # minibatches 0..done[-1] were done before the kill: at most the last one is done again
    assert isinstance(step, int) and done[-1] <= step <= done[-1] + 1, (step, done[-1])
    assert_same_state(reference(2, STEPS), tmp_path / "final.pt")
    assert not (tmp_path / "jit" / "agents").exists() or not list((tmp_path / "jit" / "agents").iterdir())


def test_workers_of_a_dead_launcher_that_still_run_refuse_a_relaunch(tmp_path):
    """ranks.json names a live worker of this job on this host (its PID and start time) and no jitrun
    holds the dir: the job still runs, so the relaunch refuses in one line naming the PID."""
    jit = tmp_path / "jit"
    (tmp_path / "train.py").write_text("raise SystemExit('a worker started')\n")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        jit.mkdir(mode=0o700)
        started = psutil.Process(sleeper.pid).create_time()
        (jit / "ranks.json").write_text(json.dumps({"t": 0, "ranks": {"0": {
            "pid": sleeper.pid, "started": started, "node": "n", "host": os.uname().nodename, "attempt": 0}}}))
        cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "1", "--jit-dir", str(jit),
                             "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        sleeper.kill()
        assert sleeper.wait() == -signal.SIGKILL
    assert cp.returncode == 2, cp.stdout + cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in cp.stderr and not cp.stdout.strip(), cp.stdout + cp.stderr
    assert lines[0].startswith("jitrun: error: workers of an earlier run") and f"PIDs {sleeper.pid}" in lines[0]
    assert f"kill {sleeper.pid}" in lines[0]
    assert not (jit / "events.jsonl").exists() and not (jit / "job.json").exists()


def test_a_migratable_worker_never_takes_its_agent_for_dead(monkeypatch):
    """PID 1 of its own PID namespace sees no PID of the agent's: the liveness
    probe would say "gone" for a live agent, and the worker would stop reporting
    (no registration, no saves: every recovery of a --jit-migratable job lost)."""
    from jitckpt import parent_death

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setenv("JITCKPT_AGENT_PID", str(dead.pid))
    monkeypatch.delenv("JITCKPT_MIGRATABLE", raising=False)
    assert parent_death.agent_gone()
    monkeypatch.setenv("JITCKPT_MIGRATABLE", "1")
    assert not parent_death.agent_gone()
