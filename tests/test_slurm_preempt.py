"""A jitrun job preempted by a real Slurm (tests/slurm_cluster.py), then resubmitted.

The batch script is the one docs/recovery.md shows: ``exec jitrun --nproc-per-node 2
train.py`` (the bare form; ``exec`` makes jitrun the batch step's shell, which is what
``--signal=B:TERM@N`` signals). Two ways Slurm preempts it:

* ``scancel JOB``: slurmstepd sends SIGCONT and SIGTERM to every process of the job,
  SIGKILL after KillWait (30 s here, Slurm's default);
* ``scancel --batch --signal=TERM JOB``: SIGTERM to the batch shell alone, which is what
  ``#SBATCH --signal=B:TERM@N`` sends N seconds before the time limit (Slurm sends that
  one up to a minute early, too loose for a test: the same delivery, on demand).

Either way the workers save, jitrun exits 75 after its one line and no traceback, and
``sbatch`` of the same script resumes at the saved step and ends bit-identical to a
failure-free plain-torchrun run.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster
from conftest import TRAIN, assert_same_state

from jitrun.preempt import EXIT_PREEMPTED

pytestmark = pytest.mark.slow

STEPS = 40
JITRUN = Path(sys.executable).with_name("jitrun")  # the console script a user types
NOISE = ("Traceback", "KeyboardInterrupt", "SignalException", "FAILED")


@pytest.fixture(scope="module")
def cluster():
    """One Slurm node, with Slurm's default KillWait (30 s): the time a cancelled job has."""
    try:
        with slurm_cluster.start(nodes=1, prefix="p", kill_wait=30) as c:
            yield c
    except slurm_cluster.Unavailable as e:
        pytest.skip(str(e))


BATCH = """#!/bin/bash
#SBATCH --job-name=jitrun-preempt
#SBATCH --nodes=1
#SBATCH --output={out}/slurm-%j.out
#SBATCH --signal=B:TERM@60
exec {jitrun} --nproc-per-node 2 --jit-dir {jit} {train} --steps {steps} --step-sleep 0.1 --out {final}
"""


def _submit(cluster, script: Path) -> str:
    cp = cluster.run("sbatch", "--parsable", str(script), timeout=60)
    job = cp.stdout.strip().split(";")[0]
    assert job.isdigit(), cp.stdout + cp.stderr
    return job


def _log(tmp: Path, job: str) -> str:
    p = tmp / f"slurm-{job}.out"
    return p.read_text(errors="replace") if p.exists() else ""


def _wait(ok, timeout: float, what: str, diag) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout:.0f}s\n{diag()}")
        time.sleep(0.2)


def _gone(cluster, job: str) -> bool:
    return not cluster.run("squeue", "--noheader", "--jobs", job, "--format", "%i", check=False).stdout.strip()


def _events(jit: Path) -> list[dict]:
    p = jit / "events.jsonl"
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()] if p.exists() else []


def _run_of(evs: list[dict], n: int) -> list[dict]:
    """The records of the n-th jitrun run (0-based) in a jit dir's timeline."""
    starts = [i for i, e in enumerate(evs) if e["event"] == "job_start"] + [len(evs)]
    return evs[starts[n]:starts[n + 1]]


@pytest.mark.parametrize("how", ["scancel", "batch-signal"])
def test_preempted_then_resubmitted(cluster, tmp_path, reference, how):
    cluster.reset()
    jit, final = tmp_path / "jit", tmp_path / "final.pt"
    script = tmp_path / "job.sh"
    script.write_text(BATCH.format(out=tmp_path, jitrun=JITRUN, jit=jit, train=TRAIN, steps=STEPS, final=final))
    jobs: list[str] = []

    def diag() -> str:
        return "\n".join(f"--- job {j}\n{_log(tmp_path, j)[-5000:]}" for j in jobs) + "\n" + cluster.logs()

    try:
        jobs.append(_submit(cluster, script))
        first = jobs[0]
        _wait(lambda: "[rank 0] step   10" in _log(tmp_path, first) or _gone(cluster, first), 180,
              "training under way", diag)
        assert not _gone(cluster, first), diag()
        if how == "scancel":
            cluster.run("scancel", first)
        else:
            cluster.run("scancel", "--batch", "--signal=TERM", first)
        t = time.monotonic()
        _wait(lambda: any(e["event"] == "job_end" for e in _events(jit)), 60, "jitrun's end", diag)
        assert time.monotonic() - t < 30, "within Slurm's KillWait"
        evs = _run_of(_events(jit), 0)
        assert [e["exitcode"] for e in evs if e["event"] == "job_end"] == [EXIT_PREEMPTED], diag()
        _wait(lambda: _gone(cluster, first), 60, "the first job's end", diag)
        log = _log(tmp_path, first)
        said = [ln for ln in log.splitlines() if ln.startswith("jitrun: preempted")]
        pre = [e for e in evs if e["event"] == "preempted"]
        assert len(pre) == 1 and pre[0]["saved"], diag()
        step = pre[0]["step"]
        assert said == [f"jitrun: preempted (SIGTERM) at step {step}; saved; relaunch the same command to resume"], \
            diag()
        assert pre[0]["source"] == "launcher" and 10 <= step < STEPS and pre[0]["progress"] <= step, pre
        for noise in NOISE:
            assert noise not in log, (noise, diag())
        exits = {e["rank"]: e["exitcode"] for e in evs if e["event"] == "worker_exit"}
        assert exits == {0: 75, 1: 75}, exits
        if how == "batch-signal":  # the batch step's exit code is jitrun's
            assert "ExitCode=75:0" in cluster.run("scontrol", "show", "job", first).stdout, diag()

        jobs.append(_submit(cluster, script))  # the same script again
        second = jobs[1]
        _wait(lambda: _gone(cluster, second), 240, "the resubmitted job's end", diag)
        again = _run_of(_events(jit), 1)
        assert [e["exitcode"] for e in again if e["event"] == "job_end"] == [0], diag()
        resumed = re.findall(r"\[rank (\d)\] resumed from \S+ at step (\d+)", _log(tmp_path, second))
        assert sorted(resumed) == [("0", str(step)), ("1", str(step))], diag()
        assert_same_state(reference(2, STEPS), final)
    finally:
        for j in jobs:
            cluster.run("scancel", j, check=False)
        cluster.reset()
