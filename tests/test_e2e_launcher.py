"""jitrun as a launcher: drop-in behaviour, bad input, scheduler hooks, preemption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import ROOT, TRAIN, assert_same_state, jitrun, run_tree


def test_no_failure_matches_torchrun(tmp_path, reference):
    job = jitrun(tmp_path, nproc=2, steps=16)
    assert job.returncode == 0, job.output[-3000:]
    assert_same_state(reference(2, 16), job.out)
    names = [e["event"] for e in job.events()]
    assert names[0] == "job_start" and names[-1] == "job_end"
    assert "failure_detected" not in names and "restart" not in names
    assert not (job.jit_dir / "ckpt").exists()


def test_user_error_exit_code_propagates(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import sys\nsys.exit(3)\n")
    cp = run_tree([sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "1",
                   "--jit-dir", str(tmp_path / "jit"), str(script)])
    assert cp.returncode == 1
    assert "exitcode  : 3" in cp.stdout


def test_unwritable_jit_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cp = run_tree([sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "1",
                   "--jit-dir", str(blocker / "sub"), str(TRAIN)])
    assert cp.returncode == 2
    assert "not writable" in cp.stdout and "--jit-dir" in cp.stdout


def test_jit_dir_of_another_job(tmp_path):
    jit = tmp_path / "jit"
    job = jitrun(tmp_path, nproc=1, steps=2, jit_dir=jit, extra=["--rdzv-id", "job-a"])
    assert job.returncode == 0, job.output[-3000:]
    job = jitrun(tmp_path, nproc=1, steps=2, jit_dir=jit, extra=["--rdzv-id", "job-b"])
    assert job.returncode == 2
    assert "job-a" in job.output and "fresh --jit-dir" in job.output


def test_bad_scheduler_spec(tmp_path):
    job = jitrun(tmp_path, nproc=1, steps=2, extra=["--jit-scheduler", "slurmish"])
    assert job.returncode == 2 and "exec:" in job.output


def test_exec_scheduler_hook_gets_failure_and_sets_env(tmp_path, reference):
    log = tmp_path / "hook-input.json"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\ncat > {log}\necho '{{\"action\": \"restart\", \"env\": {{\"HOOK_MARK\": \"x1\"}}}}'\n")
    hook.chmod(0o700)
    job = jitrun(tmp_path, nproc=2, steps=12, extra=["--jit-scheduler", f"exec:{hook}"],
                 fault="rank=1,step=3,phase=backward,kind=sigkill")
    assert job.returncode == 0, job.output[-3000:]
    assert_same_state(reference(2, 12), job.out)
    got = json.loads(log.read_text())
    assert got["failed_ranks"] == [1] and got["restore_step"] == 3
    assert job.of("restart")[0]["placement"]["env"] == ["HOOK_MARK"]


def test_exec_scheduler_abort(tmp_path):
    hook = tmp_path / "hook.sh"
    hook.write_text("#!/bin/sh\ncat >/dev/null\necho '{\"action\": \"abort\"}'\n")
    hook.chmod(0o700)
    job = jitrun(tmp_path, nproc=2, steps=12, extra=["--jit-scheduler", f"exec:{hook}"],
                 fault="rank=1,step=3,phase=backward,kind=sigkill")
    assert job.returncode == 1
    assert job.of("job_abort")


def test_preempted_job_resumes_from_jit_checkpoint(tmp_path, reference):
    """SIGTERM to jitrun (a scheduler preemption): workers JIT-save; running the
    same command again resumes from that checkpoint and ends bit-identical."""
    jit = tmp_path / "jit"
    out = tmp_path / "final.pt"
    cmd = [sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2",
           "--jit-dir", str(jit), str(TRAIN), "--steps", "40", "--step-sleep", "0.1", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (jit / "events.jsonl").exists():
            time.sleep(0.1)
        # wait until training is under way (first log line of rank 0)
        line = ""
        while time.time() < deadline and "step   10" not in line:
            line = proc.stdout.readline()
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    steps = sorted(int(p.name.split("-")[1]) for p in (jit / "ckpt").iterdir())
    assert steps and 10 <= steps[-1] < 40, steps
    cp = run_tree(cmd)
    assert cp.returncode == 0, cp.stdout[-3000:]
    assert f"at step {steps[-1]}" in cp.stdout
    assert_same_state(reference(2, 40), out)


def test_plain_python_register_is_harmless(tmp_path):
    code = (
        "import jitckpt\n"
        "jitckpt.register(lambda d: None)\n"
        "assert jitckpt.get_checkpoint_path() is None\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITCKPT_")}
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert cp.returncode == 0 and cp.stdout.strip() == "ok", cp.stderr
