"""Workers' error files (TORCHELASTIC_ERROR_FILE) that a kill leaves empty or torn.

The flake it explains: under plain torchrun, rank 1 is killed, rank 0's collective fails
and jitckpt._bootstrap records rank 0's exception in its error file, and torchrun's agent,
having seen rank 1 die, SIGTERMs rank 0 (``close()``) and then reads every failed worker's
error file (``_capture_process_failures`` -> ``ProcessFailure.__post_init__`` ->
``json.load``). torch's ``ErrorHandler.record_exception`` opens the file with ``"w"``
(created, 0 bytes) and only then writes; a SIGTERM that lands in between ends the worker
(default action) with the file empty, and the agent dies of ``JSONDecodeError``."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

# The worker's script: it arms a profile hook that sends this process SIGTERM at the first
# call or return after the writer created anything in the error file's directory (the
# moment the agent's SIGTERM does the damage), then fails as a script does.
FAIL_AND_TERM = textwrap.dedent("""
    import os, signal, sys
    d = os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])
    before = set(os.listdir(d))

    def hook(frame, event, arg):
        if set(os.listdir(d)) - before:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGTERM)

    sys.setprofile(hook)
    raise RuntimeError("Connection reset by peer (a peer rank died)")
""")


def _start(tmp_path: Path, args: tuple, name: str = "worker"):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    logs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"))
    return start_processes(name=name, entrypoint=sys.executable, args={0: args},
                           envs={0: {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path)}},
                           logs_specs=logs)


def _wait(pc, timeout: float = 120.0):
    try:
        res = pc.wait(timeout, period=0.05)
        assert res is not None, "the worker did not end"
        return res
    finally:
        pc.close()


def test_a_sigterm_while_the_error_file_is_written_leaves_it_complete_or_absent(tmp_path):
    """The reproduction. The worker runs the way the bench's torchrun baseline runs it
    (``python -m jitckpt._bootstrap SCRIPT``) under torch's own SubprocessContext, the
    part of torchrun's agent that reads the error files. With torch's writer the file is
    left empty and ``pc.wait()`` raises ``JSONDecodeError``; jitckpt's writer leaves only
    its temp file behind, and the agent reports the SIGTERM."""
    script = tmp_path / "fail.py"
    script.write_text(FAIL_AND_TERM)
    pc = _start(tmp_path, ("-m", "jitckpt._bootstrap", str(script)))
    path = pc.error_files[0]
    res = _wait(pc)  # raised JSONDecodeError here before the writer was atomic
    (f,) = res.failures.values()
    assert f.exitcode == -signal.SIGTERM, f
    from jitckpt import error_file

    state = error_file.inspect(path)
    assert state.name == "absent", state  # killed after the temp file appeared: nothing under the real name
    left = os.listdir(os.path.dirname(path))
    assert len(left) == 1 and left[0].startswith(".error.json.") and left[0].endswith(".tmp"), left
    assert f.message == f"Signal 15 (SIGTERM) received by PID {f.pid}", f.message


# Runs in a process of its own (no torch, no threads: it forks): for k = 1, 2, ... a child
# writes the error file and SIGKILLs itself at its k-th profile event (every Python call
# and return, C calls included, inside error_file.write), until a child gets through.
# What each kill left under the real name is printed, one JSON line per k.
KILL_SWEEP = textwrap.dedent("""
    import json, os, shutil, signal, sys
    from jitckpt import error_file

    d, writer = sys.argv[1], sys.argv[2]
    if writer == "torch":  # torch's ErrorHandler.record_exception, what jitckpt used before
        from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

        def write(path, exc):
            os.environ["TORCHELASTIC_ERROR_FILE"] = path
            ErrorHandler().record_exception(exc)
    else:
        write = error_file.write
    path = os.path.join(d, "error.json")
    try:
        raise RuntimeError("a failure to record " + "x" * 20000)  # more than one write's worth
    except RuntimeError as e:
        exc = e
    for k in range(1, 100000):
        shutil.rmtree(d, ignore_errors=True)
        os.mkdir(d)
        pid = os.fork()
        if pid == 0:
            n = [0]

            def hook(frame, event, arg):
                n[0] += 1
                if n[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)

            sys.setprofile(hook)
            write(path, exc)
            sys.setprofile(None)
            os._exit(3)  # got through: k is past the last event
        _, status = os.waitpid(pid, 0)
        st = error_file.inspect(path)
        print(json.dumps({"k": k, "killed": os.WIFSIGNALED(status), "state": st.name,
                          "others": sorted(set(os.listdir(d)) - {"error.json"})}), flush=True)
        if not os.WIFSIGNALED(status):
            break
""")


def _sweep(tmp_path: Path, writer: str) -> list[dict]:
    import subprocess

    script = tmp_path / "sweep.py"
    script.write_text(KILL_SWEEP)
    cp = subprocess.run([sys.executable, str(script), str(tmp_path / "d"), writer], capture_output=True,
                        text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert cp.returncode == 0, cp.stderr[-3000:]
    return [json.loads(line) for line in cp.stdout.splitlines()]


def test_torchs_writer_killed_mid_write_leaves_an_empty_or_torn_file(tmp_path):
    """The cause, shown on torch's own ErrorHandler (torch 2.13): the same sweep finds kill
    points after its open("w") that leave the file empty, and later ones that leave part of
    the JSON. If this starts failing, torch's writer became atomic upstream."""
    states = {r["state"] for r in _sweep(tmp_path, "torch") if r["killed"]}
    assert {"empty", "torn"} <= states, states


def test_a_kill_anywhere_in_the_write_leaves_the_file_complete_or_absent(tmp_path):
    """Every point of jitckpt's writer a kill can land on (between any two Python-level
    events): the real name holds nothing or the whole file, and a finished write leaves
    no temp file behind."""
    runs = _sweep(tmp_path, "jitckpt")
    killed = [r for r in runs if r["killed"]]
    assert len(killed) > 20 and not runs[-1]["killed"], runs[-3:]  # many kill points; the last run got through
    assert {r["state"] for r in killed} == {"absent", "complete"}, runs  # killed before and after the rename
    assert all(r["state"] in ("absent", "complete") for r in runs), [r for r in runs if r["state"] not in
                                                                     ("absent", "complete")]
    assert runs[-1]["state"] == "complete" and runs[-1]["others"] == [], runs[-1]


def test_what_the_writer_leaves_is_what_torch_reads(tmp_path):
    """torch's ProcessFailure reads jitckpt's file as it reads its own handler's."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    from jitckpt import error_file

    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    try:
        raise ValueError("bad value")
    except ValueError as e:
        error_file.write(str(ours), e)
        os.environ["TORCHELASTIC_ERROR_FILE"] = str(theirs)
        try:
            ErrorHandler().record_exception(e)
        finally:
            del os.environ["TORCHELASTIC_ERROR_FILE"]
    a, b = (json.loads(p.read_text()) for p in (ours, theirs))
    assert a["message"]["message"] == b["message"]["message"] == "ValueError: bad value"
    assert a["message"]["extraInfo"]["py_callstack"] == b["message"]["extraInfo"]["py_callstack"]
    assert abs(int(a["message"]["extraInfo"]["timestamp"]) - int(b["message"]["extraInfo"]["timestamp"])) <= 1
    f = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(ours))
    assert f.message == a["message"] and f.error_file == str(ours)
    assert (ours.stat().st_mode & 0o777) == 0o600 and set(os.listdir(tmp_path)) == {"ours.json", "theirs.json"}


# -- the agent's side: any error file, read without dying ---------------------------------------

# A worker that leaves CONTENT in its error file and SIGKILLs itself (a killed writer, or another program).
LEAVE_AND_DIE = textwrap.dedent("""
    import os, signal, sys
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "wb") as f:
        f.write(bytes.fromhex(sys.argv[1]))
    os.kill(os.getpid(), signal.SIGKILL)
""")
COMPLETE = json.dumps({"message": {"message": "ValueError: x", "extraInfo": {"py_callstack": "tb",
                                                                             "timestamp": "1700000000"}}})
CONTENTS = {"empty": b"", "torn": COMPLETE[:25].encode(), "unreadable": b"\xff\xfe{}",
            "malformed": b'{"message": {"extraInfo": {}}}', "complete": COMPLETE.encode()}


@pytest.mark.parametrize("state", sorted(CONTENTS))
def test_torchs_own_poll_survives_any_error_file(tmp_path, monkeypatch, state):
    """torch's SubprocessContext, as LocalElasticAgent._monitor_workers runs it, with
    jitrun's reader installed: a worker that left an empty, torn, unreadable or foreign
    error file and was killed is reported from its exit code, the file's state named in
    the message and handed to the agent's timeline callback; a complete file is read."""
    from torch.distributed.elastic.multiprocessing import api as mp_api

    from jitrun import error_files

    monkeypatch.setattr(mp_api, "ProcessFailure", mp_api.ProcessFailure)  # undone after the test
    seen = []
    error_files.install(lambda lr, path, st: seen.append((lr, path, st.name)))
    script = tmp_path / "leave.py"
    script.write_text(LEAVE_AND_DIE)
    pc = _start(tmp_path, (str(script), CONTENTS[state].hex()))
    path = pc.error_files[0]
    (f,) = _wait(pc).failures.values()
    assert f.exitcode == -signal.SIGKILL and f.error_file_state == state, f
    if state == "complete":
        assert seen == [] and f.error_file == path and f.message["message"] == "ValueError: x", f
        assert f.timestamp == 1700000000
    else:
        assert seen == [(0, path, state)], seen
        assert f.error_file == "<N/A>" and f.message.startswith(f"Signal 9 (SIGKILL) received by PID {f.pid}")
        assert f"its error file {path} was {state}: " in f.message, f.message


def test_an_error_file_that_cannot_be_read_is_named_so(tmp_path, monkeypatch):
    """An I/O error on open (as root, permissions cannot make one: a stand-in for open)."""
    from jitckpt import error_file

    p = tmp_path / "error.json"
    p.write_text(COMPLETE)
    assert error_file.inspect(str(p)).name == "complete"

    def eio(*a, **k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(error_file, "open", eio, raising=False)
    st = error_file.inspect(str(p))
    assert (st.name, st.detail, st.usable) == ("unreadable", "OSError: Input/output error", False)
    assert error_file.inspect(str(tmp_path / "none.json")).name == "absent"
    assert error_file.inspect(str(tmp_path)).name == "absent"  # a directory: torch's isfile says no file


def test_failure_report_when_restarts_run_out_names_the_empty_file(tmp_path):
    """No restart left: jitrun's agent reads the killed rank's empty error file for
    torchrun's failure report; it reports the failure (exit 1) and names the file's state
    instead of dying of JSONDecodeError."""
    from conftest import jitrun

    job = jitrun(tmp_path, nproc=2, steps=8, max_restarts=0, fault="rank=1,step=3,phase=backward,kind=errfile")
    assert job.returncode == 1, job.output[-5000:]
    assert "JSONDecodeError" not in job.output and "Traceback" not in job.output.split("FAILED")[-1], \
        job.output[-5000:]
    (ev,) = job.of("error_file_unusable")
    assert (ev["rank"], ev["local_rank"], ev["state"], ev["detail"]) == (1, 1, "empty", "0 bytes"), ev
    assert f"jitrun: rank 1's error file {ev['path']} is empty (0 bytes)" in job.output
    assert f"its error file {ev['path']} was empty: 0 bytes; the worker ended while writing it" in job.output
    assert [e["exitcode"] for e in job.of("worker_exit") if e["rank"] == 1] == [-signal.SIGKILL]
    assert job.of("checkpoint_saved")  # the survivor still saved for a resubmission


def test_jitrun_recovers_from_a_rank_that_left_an_empty_error_file(tmp_path, reference):
    """The acceptance case: rank 1 leaves an empty error file and is killed; jitrun
    recovers exactly (bit for bit with a failure-free torchrun run), exit 0, and the
    timeline names the file's state."""
    from conftest import assert_same_state, jitrun

    job = jitrun(tmp_path, nproc=2, steps=16, fault="rank=1,step=6,phase=backward,kind=errfile")
    assert job.returncode == 0, job.output[-5000:]
    assert_same_state(reference(2, 16), job.out)
    (rec,) = job.of("recovery")
    assert rec["restore_step"] == 6 and rec["redone_minibatches"] <= 1, rec
    assert [e["rank"] for e in job.of("checkpoint_saved")] == [0]
    (ev,) = job.of("error_file_unusable")
    assert (ev["rank"], ev["state"]) == (1, "empty") and ev["path"].endswith("/1/error.json"), ev
    assert [e["exitcode"] for e in job.of("worker_exit") if e["rank"] == 1] == [-signal.SIGKILL]
