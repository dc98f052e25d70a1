"""jitrun's answer to bad input: one line on stderr saying what is wrong and
how to fix it, exit code 2, no traceback, nothing created on disk (no jit dir,
no ./jitckpt_runs) and no worker started. Also the failure report's entrypoint
name and the scheduler-abort line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jitrun import cli, launch
from jitrun.devices import scheduler


def jitrun(tmp_path: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("JITCKPT_")}
    return subprocess.run([sys.executable, "-m", "jitrun.cli", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={**full_env, **(env or {})})


def assert_rejected(proc: subprocess.CompletedProcess, tmp_path: Path, *needles: str) -> str:
    err = proc.stderr
    assert proc.returncode == 2, proc.stdout + err
    assert "Traceback" not in err and not proc.stdout.strip(), proc.stdout + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("jitrun: error: "), err
    for n in needles:
        assert n in lines[0], err
    assert not (tmp_path / "jitckpt_runs").exists()
    assert not (tmp_path / "jd").exists()
    return lines[0]


@pytest.fixture
def script(tmp_path: Path) -> str:
    (tmp_path / "train.py").write_text("raise SystemExit('a worker started')\n")
    return "train.py"


@pytest.mark.parametrize("flag,value", [
    ("--jit-timeout", "nan"), ("--jit-timeout", "inf"), ("--jit-timeout", "0"), ("--jit-timeout", "-1"),
    ("--jit-save-timeout", "-5"), ("--jit-save-timeout", "nan"),
    ("--jit-preempt-grace", "0"), ("--jit-preempt-grace", "nan"),
])
def test_bad_timeouts(tmp_path, script, flag, value):
    proc = jitrun(tmp_path, "--standalone", "--nproc-per-node", "2", flag, value,
                  "--jit-dir", str(tmp_path / "jd"), script)
    line = assert_rejected(proc, tmp_path, flag, "seconds > 0")
    assert f"{flag} {value}:" in line


def test_bad_timeout_in_environment(tmp_path, script):
    proc = jitrun(tmp_path, "--standalone", script, env={"JITCKPT_TIMEOUT": "nan"})
    assert_rejected(proc, tmp_path, "JITCKPT_TIMEOUT='nan'", "--jit-timeout")


def test_missing_script(tmp_path):
    proc = jitrun(tmp_path, "--standalone", "--nproc-per-node", "2", "missing.py")
    assert_rejected(proc, tmp_path, "training script 'missing.py' not found", str(tmp_path), "-m MODULE")


def test_no_python_program_not_on_path(tmp_path):
    proc = jitrun(tmp_path, "--standalone", "--no-python", "jitrun-no-such-program-xyz")
    assert_rejected(proc, tmp_path, "--no-python", "'jitrun-no-such-program-xyz' not found on PATH")


def test_argparse_error_is_one_line(tmp_path, script):
    proc = jitrun(tmp_path, "--jit-timeout", "soon", script)
    assert_rejected(proc, tmp_path, "--jit-timeout", "'soon'", "jitrun --help")


def test_bad_nproc(tmp_path, script):
    proc = jitrun(tmp_path, "--standalone", "--nproc-per-node", "many", script)
    assert_rejected(proc, tmp_path, "--nproc-per-node many", "auto, cpu")


def test_jit_dir_of_another_job(tmp_path, script):
    jd = tmp_path / "other"
    jd.mkdir()
    (jd / "job.json").write_text(json.dumps({"job_id": "job-old"}))
    proc = jitrun(tmp_path, "--standalone", "--jit-dir", str(jd), script)
    line = assert_rejected(proc, tmp_path, "belongs to job 'job-old' (its job.json)", "--jit-dir",
                           "--rdzv-id job-old")
    assert "checkpoint" not in line  # it holds none
    assert sorted(p.name for p in jd.iterdir()) == ["job.json"]


@pytest.mark.parametrize("value", ["", "   ", "\t"])
@pytest.mark.parametrize("flag", ["--jit-dir", "--log-dir"])
def test_empty_path_options(tmp_path, script, flag, value):
    """``--jit-dir ""`` used to exit 0 after silently using ./jitckpt_runs/<id>."""
    proc = jitrun(tmp_path, "--nproc-per-node", "2", flag, value, script)
    assert_rejected(proc, tmp_path, f"{flag} {value!r}: an empty path", "pass a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_empty_training_script(tmp_path):
    proc = jitrun(tmp_path, "--nproc-per-node", "2", " ")
    assert_rejected(proc, tmp_path, "training script ' ': an empty path", "script's path")


@pytest.mark.parametrize("argv", [["events", ""], ["events", "--jit-dir", " "], ["clean", "--jit-dir", ""],
                                  ["migrate", "--jit-dir", " ", "--rank", "0", "--to", "x"]])
def test_subcommands_refuse_an_empty_path(tmp_path, argv):
    (tmp_path / "events.jsonl").write_text('{"event": "job_start", "t": 1}\n')  # what Path("") would read
    (tmp_path / ".tmp-rank-0-1").mkdir()  # and what `clean` would remove
    proc = jitrun(tmp_path, *argv)
    assert proc.returncode == 2 and not proc.stdout.strip() and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jitrun {argv[0]}: error: ") and "empty path" in lines[0], lines
    assert (tmp_path / ".tmp-rank-0-1").exists()


def test_help_is_jitruns_own(tmp_path):
    proc = jitrun(tmp_path, "--help")
    assert proc.returncode == 0
    out = proc.stdout
    assert "Torch Distributed Elastic Training Launcher" not in out
    assert "jitrun plan" in out and "jitrun events" in out and "merge the event logs" in out
    assert "--jit-timeout" in out and "--nproc-per-node" in out
    assert not (tmp_path / "jitckpt_runs").exists()


# -- the checks themselves, in process (fast) -------------------------------------


def args_of(*argv: str):
    return cli._parser().parse_args(list(argv))


def test_check_args_accepts_good_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("JITCKPT_TIMEOUT", raising=False)
    monkeypatch.setenv("JITCKPT_TOKEN", "0123456789abcdef0123456789abcdef")  # --nnodes 1:2 needs one
    (tmp_path / "train.py").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__main__.py").write_text("")
    for argv in (["train.py"], ["--jit-timeout", "0.5", "--jit-save-timeout", "30", "train.py"],
                 ["-m", "some.module.not.checked"], ["--module", "x"], ["pkg"],
                 ["--no-python", "true"], ["--no-python", sys.executable],
                 ["--nproc-per-node", "auto", "--nnodes", "1:2", "train.py"]):
        assert cli.check_args(args_of(*argv)) is None, argv


def test_check_args_rejects(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("JITCKPT_TIMEOUT", raising=False)
    monkeypatch.delenv("JITCKPT_TOKEN", raising=False)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "empty").mkdir()
    cases = {
        ("--no-python", "-m", "x"): "exclude each other",
        ("--no-python", "./train.py"): "not executable",  # exists, but not executable
        ("empty",): "directory without __main__.py",
        ("--run-path", "missing.py"): "not found",
        ("--nnodes", "3:2", "train.py"): "MIN:MAX",
        ("--nnodes", "x", "train.py"): "MIN:MAX",
        ("--nproc-per-node", "0", "train.py"): "at least 1",
        ("--jit-save-timeout", "inf", "train.py"): "--jit-save-timeout inf: expected a finite number",
        ("--jit-save-timeout", "0", "train.py"): "--jit-save-timeout 0: expected a finite number",
        ("--jit-timeout=-inf", "train.py"): "--jit-timeout -inf: expected a finite number",
        ("--nnodes", "2", "train.py"): "needs JITCKPT_TOKEN",
    }
    for argv, needle in cases.items():
        err = cli.check_args(args_of(*argv))
        assert err is not None and needle in err, (argv, err)
        assert "\n" not in err


# -- failure report and launch errors ----------------------------------------------


@pytest.mark.parametrize("cmd_args,name", [
    (["-u", "-m", "jitckpt._bootstrap", "/x/train.py", "--steps", "3"], "/x/train.py"),
    (["-u", "-m", "jitckpt._bootstrap", "-m", "pkg.train", "--lr", "1"], "pkg.train"),
    (["-u", "-m", "jitckpt._bootstrap", "train.py", "--local-rank=0"], "train.py"),
])
def test_entrypoint_name_is_the_users_program(cmd_args, name):
    assert launch.entrypoint_name(sys.executable, cmd_args) == name
    assert launch.entrypoint_name("/other/python3", cmd_args) == name  # PYTHON_EXEC


def test_entrypoint_name_warm_start_and_plain():
    from jitrun import warm

    assert launch.entrypoint_name(warm.worker_main, ["train.py", "--a"]) == "train.py"
    assert launch.entrypoint_name(warm.worker_main, ["-m", "pkg.train"]) == "pkg.train"
    assert launch.entrypoint_name("/bin/prog", ["--x"]) == "/bin/prog"  # --no-python
    assert launch.entrypoint_name(sys.executable, ["-u", "train.py"]) == "train.py"


def test_failure_report_names_the_script():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="")
    name = launch.entrypoint_name(sys.executable, ["-u", "-m", "jitckpt._bootstrap", "train.py"])
    msg = ChildFailedError(name=name, failures={0: failure}).format_msg()
    assert "train.py FAILED" in msg and "_bootstrap" not in msg


def test_scheduler_abort_is_one_clean_line():
    for e in (scheduler.JobAborted("jitrun: scheduler hook asked to abort the job"),
              RuntimeError("jitrun: scheduler hook asked to abort the job")):
        line = launch.error_line(e, "exec:/opt/hook")
        assert line.startswith("jitrun: the scheduler hook (exec:/opt/hook) asked to abort the job")
        assert "RuntimeError" not in line and "jitrun: jitrun" not in line and "\n" not in line
    assert launch.error_line(RuntimeError("jitrun: something else")) == "jitrun: something else"
    assert launch.error_line(ValueError("bad")) == "jitrun: ValueError: bad"
