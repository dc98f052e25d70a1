"""Preemption under the bare launch (``jitrun --nproc-per-node 2 train.py``, started in a
session of its own as a batch system starts it): SIGTERM or SIGINT for the job, the way
schedulers and terminals deliver it (every process of the job: Slurm's ``scancel``, a pod
deletion, a spot notice, Ctrl-C), to jitrun alone (``--signal=B:TERM@N``) or to the workers
alone, at a minibatch start, in forward, in backward and during an EC snapshot.

Each run must exit 75 with the one line ``jitrun: preempted (SIG) at step S; saved; relaunch
the same command to resume`` and no traceback, every worker must have exited after its save,
and the relaunch (the same command) must resume at S, the step the ranks had reached (only the
minibatch in flight is redone), and end bit-identical to a failure-free plain-torchrun run.
The signals come from injected faults (jitckpt/faults.py: pgterm, pgint, leaderterm) or from
the test, by PID. Also: a second signal, and a grace period that runs out, end the save at
once; a script that catches SIGTERM itself and returns still leaves its checkpoint.
"""

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
from conftest import TRAIN, Job, assert_same_state, jitrun, run_reference, run_tree

from jitckpt.wire import layout
from jitrun.preempt import EXIT_PREEMPTED, Preemption, torch_signals

STEPS = 16
AT = 6  # the minibatch the signal comes in (or after whose optimizer step)
NOISE = ("Traceback", "KeyboardInterrupt", "SignalException", "FAILED", "Root Cause", "death signal")


def _line(sig: str, step: int, who: str = "") -> str:
    return f"jitrun: preempted ({sig}{who}) at step {step}; saved; relaunch the same command to resume"


def check_preempted(job: Job, sig: str, steps: set[int], who: str = "", codes: tuple[int, ...] = (75,)) -> int:
    """The preempted run: exit 75, one line, no traceback, every worker saved and exited;
    returns the step saved (one of ``steps``), which no rank had gone past."""
    out = job.output
    assert job.returncode == EXIT_PREEMPTED, out[-5000:]
    said = [ln for ln in out.splitlines() if ln.startswith("jitrun: preempted")]
    assert len(said) == 1, out[-5000:]
    pre = job.of("preempted")
    assert len(pre) == 1 and pre[0]["saved"] and not pre[0]["killed"], pre
    step = pre[0]["step"]
    assert step in steps and said[0] == _line(sig, step, who), (said, steps)
    assert pre[0]["progress"] <= step, pre  # no minibatch the ranks had finished is lost
    for noise in NOISE:
        assert noise not in out, (noise, out[-5000:])
    exits = {e["rank"]: e["exitcode"] for e in job.of("worker_exit")}
    assert sorted(exits) == [0, 1] and all(c in codes for c in exits.values()), exits
    # a rank whose watcher ran after its main thread finished that minibatch's optimizer step
    # saves the next minibatch start: the newest step with every shard (one replica) is restored
    saved = job.of("checkpoint_saved")
    assert saved and step in {e["step"] for e in saved} <= {step - 1, step}, saved
    assert not job.of("restart"), "a preemption is not restarted"
    end = job.of("job_end")
    assert [e["exitcode"] for e in end] == [EXIT_PREEMPTED], end
    return step


def check_relaunch(job: Job, step: int, reference: Path) -> None:
    """The same command again: it resumes from the preemption's checkpoint and ends bit-identical."""
    assert job.returncode == 0, job.output[-5000:]
    resumed = re.findall(r"\[rank (\d)\] resumed from (\S+) at step (\d+)", job.output)
    assert sorted(r for r, _, _ in resumed) == ["0", "1"], job.output[-3000:]
    assert {int(s) for _, _, s in resumed} == {step}, resumed
    assert all(f"/step-{step}/" in p for _, p, _ in resumed), resumed
    assert_same_state(reference, job.out)


@pytest.mark.parametrize("phase,steps", [
    ("post-step", {AT + 1}),  # after minibatch AT's optimizer step: saved at the start of AT + 1
    ("forward", {AT, AT + 1}),  # AT + 1: the other rank finished minibatch AT first (see check_preempted)
    ("backward", {AT, AT + 1}),
])
def test_group_sigterm(tmp_path, reference, phase, steps):
    """SIGTERM to every process of the job (scancel, a pod deletion, a spot notice)."""
    job = jitrun(tmp_path, steps=STEPS, fault=f"rank=0,step={AT},phase={phase},kind=pgterm")
    step = check_preempted(job, "SIGTERM", steps)
    check_relaunch(jitrun(tmp_path, steps=STEPS), step, reference(2, STEPS))


def test_group_sigterm_during_ec_snapshot(tmp_path, reference):
    """The signal comes while an EC snapshot (--jit-ec-every 3) of step 6 is on its way."""
    shm = tmp_path / "shm"  # stands for /dev/shm (jitrun reads the same variable); removed with tmp_path
    shm.mkdir(mode=0o700)
    # time for the step-3 version to be placed before step 6's is due (else step 6's is skipped)
    ec = {"extra": ["--jit-ec-every", "3"], "env": {"JITCKPT_EC_SHM": str(shm)}, "train_args": ["--step-sleep", "0.3"]}
    job = jitrun(tmp_path, steps=STEPS, fault=f"rank=1,step={AT},phase=snapshot,kind=pgterm", **ec)
    fired = [e for e in job.of("fault_injected") if e.get("phase") == "snapshot"]
    assert fired, job.output[-3000:]  # the snapshot of step 6 was taken
    step = check_preempted(job, "SIGTERM", {AT, AT + 1})
    check_relaunch(jitrun(tmp_path, steps=STEPS, **ec), step, reference(2, STEPS))


def test_group_sigint(tmp_path, reference):
    """Ctrl-C in the job's terminal: SIGINT to the foreground process group."""
    job = jitrun(tmp_path, steps=STEPS, fault=f"rank=1,step={AT},phase=backward,kind=pgint")
    step = check_preempted(job, "SIGINT", {AT, AT + 1})
    check_relaunch(jitrun(tmp_path, steps=STEPS), step, reference(2, STEPS))


def test_sigterm_to_the_launcher_alone(tmp_path, reference):
    """SIGTERM to jitrun only (Slurm's --signal=B:TERM@N with jitrun as the batch step's
    shell): jitrun asks the workers; they save wherever they then are."""
    slow = ["--step-sleep", "0.1"]  # the workers run on while jitrun asks them: not to the end
    job = jitrun(tmp_path, steps=STEPS, fault=f"rank=0,step={AT},phase=forward,kind=leaderterm", train_args=slow)
    step = check_preempted(job, "SIGTERM", set(range(AT, STEPS)))
    check_relaunch(jitrun(tmp_path, steps=STEPS, train_args=slow), step, reference(2, STEPS))


def _workers(leader: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (p.info["cmdline"] or [""])[0].startswith("jitrun[rank") and os.getpgid(p.pid) == leader:
                out.append(p)
        except (psutil.Error, ProcessLookupError):
            continue
    return out


def _start(tmp: Path, train_args: list[str], extra: list[str] = (), env: dict | None = None
           ) -> tuple[subprocess.Popen, list[str]]:
    cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--max-restarts", "3",
           "--jit-dir", str(tmp / "jit"), *extra, str(TRAIN), "--steps", str(STEPS), "--out", str(tmp / "final.pt"),
           *train_args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         env={**os.environ, **(env or {})})
    return p, cmd


def _until(p: subprocess.Popen, text: str, timeout: float = 120) -> str:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        seen.append(line)
        if text in line or (not line and p.poll() is not None):
            return "".join(seen)
    return "".join(seen)


def _finish(p: subprocess.Popen, head: str, tmp: Path, timeout: float = 120) -> Job:
    try:
        rest, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    return Job(p.returncode, head + rest, tmp / "jit", tmp / "final.pt")


def test_sigterm_to_the_workers_alone(tmp_path, reference):
    """SIGTERM to both workers, not to jitrun: still a preemption (one worker's alone is that
    rank's failure, recovered: tests/test_fault_matrix.py)."""
    p, cmd = _start(tmp_path, ["--log-every", "1", "--step-sleep", "0.05"])
    try:
        head = _until(p, "[rank 0] step    4")
        workers = _workers(p.pid)
        assert len(workers) == 2, head[-3000:]
        for w in workers:
            w.send_signal(signal.SIGTERM)
    finally:
        job = _finish(p, locals().get("head", ""), tmp_path)
    step = check_preempted(job, "SIGTERM", set(range(4, STEPS + 1)), who=", to the workers")
    assert job.of("preempted")[0]["source"] == "workers"
    cp = run_tree(cmd)
    check_relaunch(Job(cp.returncode, cp.stdout, job.jit_dir, job.out), step, reference(2, STEPS))


def _saving(jit: Path, n: int = 2, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = [json.loads(ln) for ln in (jit / "events.jsonl").read_text().splitlines()] \
            if (jit / "events.jsonl").exists() else []
        if sum(e["event"] == "save_started" for e in evs) >= n:
            return
        time.sleep(0.05)
    pytest.fail("the workers never started saving")


def _check_not_saved(job: Job, why: str) -> None:
    assert job.returncode == EXIT_PREEMPTED, job.output[-5000:]
    said = [ln for ln in job.output.splitlines() if ln.startswith("jitrun: preempted")]
    assert said == [f"jitrun: preempted (SIGTERM) at step {AT}; NOT saved ({why}); relaunching the same command "
                    "starts from step 0"], job.output[-3000:]
    for noise in NOISE:
        assert noise not in job.output, noise
    exits = {e["rank"]: e["exitcode"] for e in job.of("worker_exit")}
    assert exits == {0: -signal.SIGKILL, 1: -signal.SIGKILL}, exits
    replicas, _ = layout.scan(job.jit_dir)
    assert not replicas, replicas  # a save cut short is never published


def test_second_signal_ends_the_save_at_once(tmp_path):
    fault = {"JITCKPT_FAULT": f"rank=0,step={AT},phase=forward,kind=pgterm"}
    p, _ = _start(tmp_path, ["--save-sleep", "60"], env=fault)
    try:
        _saving(tmp_path / "jit")
        t = time.monotonic()
        os.killpg(p.pid, signal.SIGTERM)
    finally:
        job = _finish(p, "", tmp_path)
    assert time.monotonic() - t < 10, "the second signal ended the job at once"
    _check_not_saved(job, "a second signal ended the save")
    assert job.of("ranks_killed")[0]["why"] == "second signal"


def test_grace_period_ends_a_slow_save(tmp_path):
    job = jitrun(tmp_path, steps=STEPS, extra=["--jit-preempt-grace", "2"], train_args=["--save-sleep", "60"],
                 fault=f"rank=0,step={AT},phase=forward,kind=pgterm")
    _check_not_saved(job, "the save did not end within the grace period, --jit-preempt-grace 2 s")
    pre = job.of("preempted")[0]
    assert 2.0 <= pre["seconds"] < 8.0, pre


def test_script_that_catches_sigterm_itself(tmp_path):
    """The script's own handler stops its loop after the minibatch and returns (HF Trainer's
    and Lightning's way): the JIT checkpoint is taken at its end, after that optimizer step."""
    out = tmp_path / "ref.pt"
    args = ["--steps", str(STEPS), "--resumable", "--catch-stop"]
    cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(TRAIN), *args, "--out", str(out)])
    assert cp.returncode == 0, cp.stdout[-3000:]
    train = ["--resumable", "--catch-stop"]
    job = jitrun(tmp_path, steps=STEPS, train_args=train, fault=f"rank=0,step={AT},phase=post-step,kind=pgterm")
    # a rank its own handler stopped saved at the script's end and exited 0; one the signal
    # found already in the next minibatch's forward saved there and exited 75
    step = check_preempted(job, "SIGTERM", {AT + 1}, codes=(0, 75))
    stopped = re.findall(r"\[rank (\d)\] stop signal: leaving after minibatch (\d+)", job.output)
    exits = {e["rank"]: e["exitcode"] for e in job.of("worker_exit")}
    assert {int(r) for r, _ in stopped} == {r for r, c in exits.items() if c == 0} and stopped, job.output[-3000:]
    again = jitrun(tmp_path, steps=STEPS, train_args=train)
    assert again.returncode == 0, again.output[-4000:]
    evs = again.events()  # the jit dir's timeline: both runs
    start = max(i for i, e in enumerate(evs) if e["event"] == "job_start")
    assert {e["loaded"] for e in evs[start:] if e["event"] == "loaded"} == {step}, evs[start:]
    assert_same_state(out, again.out)


def _catches(pid: int, sig: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            mask = next(int(ln.split()[1], 16) for ln in fh if ln.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask & (1 << (sig - 1)))


def test_sigterm_before_the_workers_start(tmp_path):
    """jitrun takes SIGTERM over before it imports torch: a job stopped that early says so."""
    p, _ = _start(tmp_path, [])
    try:
        deadline = time.monotonic() + 60
        while not _catches(p.pid, signal.SIGTERM) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGTERM)
    finally:
        job = _finish(p, "", tmp_path)
    assert job.returncode == EXIT_PREEMPTED, job.output[-3000:]
    assert [ln for ln in job.output.splitlines() if ln.startswith("jitrun:")] == [
        "jitrun: preempted (SIGTERM) before the job's workers started; nothing to save; relaunch the same command "
        "to run it"], job.output[-3000:]
    assert not job.of("worker_exit") and not _workers(p.pid)


def test_torch_keeps_the_other_signals():
    assert torch_signals("SIGTERM,SIGINT,SIGHUP,SIGQUIT") == "SIGHUP,SIGQUIT"
    assert torch_signals(" SIGINT , SIGTERM ") == "SIGHUP"  # never empty: torch logs a traceback for ""


def test_a_preemption_by_the_workers_needs_every_rank_unasked():
    pre = Preemption()
    assert not pre.by_workers({0: ("sigterm", 10.0)}, {0, 1}, {})  # one rank's signal: its failure
    # rank 1 reported after the agent asked it (a failure episode's request): not from elsewhere
    assert not pre.by_workers({0: ("sigterm", 10.0), 1: ("sigterm", 12.0)}, {0, 1}, {1: 11.0})
    assert not pre.requested
    assert pre.by_workers({0: ("sigint", 10.0), 1: ("sigint", 10.1)}, {0, 1}, {1: 11.0})
    assert pre.requested and pre.source == "workers" and pre.name == "SIGINT"
