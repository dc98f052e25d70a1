"""Warm start (the default) and the event-driven restart path.

* the fork server holds no thread, so a fork inherits no lock held by a
  thread that does not exist in the child;
* a worker ends in jitckpt._bootstrap._exit: exit codes as the interpreter
  gives them, files the script left open flushed, destroyed process groups
  never destructed (the ProcessGroupGloo destructor deadlock);
* the agent wakes on a worker exit or report, not on a period;
* torch's rendezvous is patched to name its events without inspect.stack();
* the stress test (scripts/stress_warm.py) in its short form.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import ROOT

PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
for k in ("JITCKPT_DIR", "JITCKPT_TOKEN", "JITCKPT_FAULT"):
    ENV.pop(k, None)


def test_fork_server_has_no_thread():
    code = textwrap.dedent("""
        import multiprocessing.forkserver as fs, os
        from jitrun import warm
        warm.start_server()
        pid = fs._forkserver._forkserver_pid
        print(len(os.listdir(f"/proc/{pid}/task")))
    """)
    cp = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "1", f"fork server threads: {cp.stdout!r}"


def _boot(tmp: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp / "s.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([PY, "-m", "jitckpt._bootstrap", str(script)], capture_output=True, text=True,
                          env=ENV, timeout=120, cwd=tmp)


@pytest.mark.parametrize("body,code,err", [
    ("pass", 0, None),
    ("import sys; sys.exit(3)", 3, None),
    ("import sys; sys.exit('bad config: x')", 1, "bad config: x"),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
])
def test_exit_codes_as_the_interpreter(tmp_path, body, code, err):
    cp = _boot(tmp_path, body)
    assert cp.returncode == code, cp.stderr
    if err:
        assert err in cp.stderr


def test_keyboard_interrupt_ends_by_sigint(tmp_path):
    cp = _boot(tmp_path, "raise KeyboardInterrupt")
    assert cp.returncode == -signal.SIGINT, cp.stderr
    assert "KeyboardInterrupt" in cp.stderr


def test_open_files_flushed_and_atexit_run(tmp_path):
    cp = _boot(tmp_path, """
        import atexit
        log = open("log.txt", "w")          # never closed, as scripts do
        log.write("line 1\\n")
        raw = open("data.bin", "wb")
        raw.write(b"x" * 10)
        atexit.register(lambda: open("atexit.txt", "w").write("ran"))
    """)
    assert cp.returncode == 0, cp.stderr
    assert (tmp_path / "log.txt").read_text() == "line 1\n"
    assert (tmp_path / "data.bin").read_bytes() == b"x" * 10
    assert (tmp_path / "atexit.txt").read_text() == "ran"


def test_destroyed_groups_are_kept_until_the_end(tmp_path):
    """The script's DDP model outlives destroy_process_group(); the group is
    never destructed (a weakref to it stays alive until the process ends)."""
    cp = _boot(tmp_path, """
        import os, weakref
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 500))
        dist.init_process_group("gloo", rank=0, world_size=1)
        def main():
            m = DDP(torch.nn.Linear(4, 4))
            m(torch.ones(2, 4)).sum().backward()
            pg = dist.group.WORLD
            dist.destroy_process_group()
            return weakref.ref(pg)
        ref = main()   # the DDP reducer, the last user of the group, is gone here
        import gc; gc.collect()
        print("group alive:", ref() is not None)
    """)
    assert cp.returncode == 0, cp.stderr
    assert "group alive: True" in cp.stdout


def test_exit_phase_fault_fires_after_the_script(tmp_path):
    env = {**ENV, "JITCKPT_FAULT": "rank=0,phase=exit,kind=exit"}
    script = tmp_path / "s.py"
    script.write_text("open('ran.txt', 'w').write('yes')\n")
    cp = subprocess.run([PY, "-m", "jitckpt._bootstrap", str(script)], capture_output=True, text=True,
                        env=env, timeout=120, cwd=tmp_path)
    assert cp.returncode == 13, cp.stderr  # faults.EXIT_INJECTED
    assert (tmp_path / "ran.txt").read_text() == "yes"


# -- waking up ------------------------------------------------------------------


def test_wakeup_on_process_exit():
    from jitrun.wakeup import Wakeup

    w = Wakeup()
    try:
        p = subprocess.Popen([PY, "-c", "import time; time.sleep(0.3)"])
        t0 = time.monotonic()
        w.wait([p.pid], 30.0)
        waited = time.monotonic() - t0
        assert p.wait(timeout=5) == 0
        assert waited < 10.0, f"woke after {waited:.2f}s, not at the exit"
        # nothing happening: the timeout bounds the wait
        t0 = time.monotonic()
        w.wait([], 0.2)
        assert 0.15 < time.monotonic() - t0 < 5.0
    finally:
        w.close()


def test_wakeup_on_report():
    import torch.distributed as dist

    from jitckpt.wire.report import Reporter
    from jitrun.wakeup import Wakeup

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    w = Wakeup()
    try:
        w.watch(("127.0.0.1", server.port), "tok")
        time.sleep(0.3)  # the waiter is connected and waiting for slot 1
        rep = Reporter(dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False),
                       "tok", rank=0)
        threading.Timer(0.3, rep.send, args=("started",)).start()
        t0 = time.monotonic()
        w.wait([], 30.0)
        waited = time.monotonic() - t0
        assert waited < 10.0, f"woke after {waited:.2f}s, not at the report"
    finally:
        w.close()


def test_rendezvous_names_events_without_inspect():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from jitrun import rdzv

    rdzv._speed_up()

    def some_method():
        return dr.get_method_name()

    def caller():
        return some_method()

    # depth 2 = the caller of the function that asks, as torch's original
    assert caller() == "caller"
    t0 = time.monotonic()
    dr._delay(seconds=1)
    dr._delay(seconds=(0, 0.3))
    assert time.monotonic() - t0 < 0.5


@pytest.mark.slow
def test_stress_restarts_short_form():
    """scripts/stress_warm.py --jobs 1 --restarts 12: faults in every phase
    and at exit, bit-identical, at most one minibatch redone per recovery,
    no hang. The long form (300 restarts) is `make stress`."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import stress_warm

    assert stress_warm.main(["--jobs", "1", "--restarts", "12"]) == 0
