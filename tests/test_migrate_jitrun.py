"""``jitrun --jit-migratable on``: every worker is PID 1 of its own PID
namespace, session leader, output in a file of its own under the jit dir, and
where each rank runs is recorded in ``<jit dir>/migrate/where.json``. The job
trains as without the flag (bit-identical to plain torchrun) and the JIT
recovery path still works (the wrapper forwards the agent's SIGTERM, so the
healthy rank saves)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import TRAIN, Job, assert_same_state, jitrun

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="PID namespaces need root")


def _where(job) -> dict:
    return json.loads((job.jit_dir / "migrate" / "where.json").read_text())["ranks"]


def test_migratable_job_runs_and_records_where_ranks_run(tmp_path, reference):
    job = jitrun(tmp_path, nproc=2, steps=12, extra=["--jit-migratable", "on"])
    assert job.returncode == 0, job.output[-4000:]
    assert_same_state(reference(2, 12), job.out)
    where = _where(job)
    assert sorted(where) == ["0", "1"], where
    for r, w in where.items():
        assert w["pid"] and w["pid"] != w["wrapper_pid"], w  # the namespace's PID 1, seen from the host
        out = job.jit_dir / "migrate" / "out" / f"rank{r}.a0.log"
        assert w["output"] == str(out) and out.exists(), w
    # the workers' output went to their files, not through the agent
    assert "step" in (job.jit_dir / "migrate" / "out" / "rank0.a0.log").read_text()
    assert job.of("migratable_workers"), job.events()
    assert json.loads((job.jit_dir / "migrate" / "control.json").read_text())["pausable"] is True


def test_migratable_job_still_recovers_through_jit_restart(tmp_path, reference):
    """A rank SIGKILLed from outside (what a crash does; the fault injector's self-kill
    is a no-op for a PID 1, see below) is recovered by the JIT path: the wrapper
    forwards the agent's SIGTERM so the healthy rank saves."""
    jit = tmp_path / "jit"
    cmd = [sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
           "--jit-timeout", "3", "--jit-dir", str(jit), "--jit-migratable", "on", str(TRAIN), "--steps", "40",
           "--out", str(tmp_path / "final.pt"), "--step-sleep", "0.1"]
    log = open(tmp_path / "jitrun.log", "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out0 = jit / "migrate" / "out" / "rank0.a0.log"  # rank 0 prints the steps
        deadline = time.monotonic() + 120
        while "step   10" not in (out0.read_text() if out0.exists() else ""):
            assert time.monotonic() < deadline and p.poll() is None, (tmp_path / "jitrun.log").read_text()[-3000:]
            time.sleep(0.05)
        victim = json.loads((jit / "migrate" / "where.json").read_text())["ranks"]["1"]["pid"]
        os.kill(victim, signal.SIGKILL)
        assert p.wait(timeout=180) == 0, (tmp_path / "jitrun.log").read_text()[-4000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        log.close()
    job = Job(0, "", jit, tmp_path / "final.pt")
    assert_same_state(reference(2, 40), job.out)
    rec = job.of("recovery")
    assert len(rec) == 1 and rec[0]["redone_minibatches"] <= 1, job.events()
    saved = job.of("checkpoint_saved")
    assert saved and all(e["rank"] != 1 for e in saved), saved  # rank 0 saved on the forwarded SIGTERM
    assert (jit / "migrate" / "out" / "rank0.a1.log").exists()


def test_self_sigkill_of_a_pid1_worker_is_ignored(tmp_path):
    """Why the test above kills from outside: a PID namespace's init ignores signals
    sent from inside its namespace unless it handles them, SIGKILL included (kernel
    rule), so JITCKPT_FAULT's kind=sigkill/sigstop do nothing to a migratable worker."""
    code = "import os,signal; os.kill(os.getpid(), signal.SIGKILL); print('alive', flush=True)"
    out = tmp_path / "out.log"
    rc = subprocess.run([sys.executable, "-m", "jitrun.migration.criu", "exec", str(out), "--", sys.executable,
                         "-c", code], timeout=60).returncode
    assert rc == 0 and out.read_text().strip() == "alive"


def test_wrapper_forwards_signals_and_exit_status(tmp_path):
    code = "import os,signal,time; signal.signal(signal.SIGTERM, lambda s,f: os._exit(7)); " \
           "print(os.getpid(), os.readlink('/proc/self'), flush=True); time.sleep(60)"
    out = tmp_path / "out-{RANK}.log"
    p = subprocess.Popen([sys.executable, "-m", "jitrun.migration.criu", "exec", str(out), "--", sys.executable,
                          "-c", code], env={**os.environ, "RANK": "5"}, start_new_session=True)
    try:
        log = tmp_path / "out-5.log"
        deadline = time.monotonic() + 30
        while not (log.exists() and log.read_text().strip()):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.02)
        ns_pid, host_pid = log.read_text().split()
        assert ns_pid == "1" and int(host_pid) != p.pid
        os.kill(p.pid, signal.SIGTERM)  # what torchrun's agent sends the wrapper
        assert p.wait(timeout=20) == 7
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_migrate_refuses_a_no_python_job_in_one_line(tmp_path):
    """A --no-python program has no jitckpt runtime and so no minibatch start to
    pause at: `jitrun migrate` says so at once (exit 2) instead of waiting out its
    timeout. Python jobs stay pausable."""
    jit = tmp_path / "jit"
    cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "1",
                         "--jit-migratable", "on", "--jit-dir", str(jit), "--no-python", "true"],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    control = json.loads((jit / "migrate" / "control.json").read_text())
    assert control["pausable"] is False, control
    cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "migrate", "--jit-dir", str(jit), "--rank", "0",
                         "--to", "10.0.0.9"], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert "--no-python" in cp.stderr and "Traceback" not in cp.stderr and len(cp.stderr.splitlines()) == 1, \
        cp.stderr
