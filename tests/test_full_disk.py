"""Full disks and failing writes, on a real tmpfs the size of a few checkpoints.

The tmpfs is mounted over the test's jit dir inside a private mount namespace
(``unshare -m --propagation private``) that a ``sleep`` holds; every process of
a case runs in it (``nsenter``) and the test reads the files through
``/proc/<holder>/root``. Killing the holder unmounts it.

The job case: a rank is killed at minibatch 4 (its peer saves it), the
scheduler hook of the restart fills the disk to the last byte, the rank is
killed again at minibatch 10: the save is refused in one line naming the
directory, the bytes needed and free and the fix, and the job stops (exit 1,
no traceback) with the step-4 checkpoint intact; ``jitrun events`` reads the
log; with the disk freed the same command resumes from step 4 and ends
bit-identical to a run without failures.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT, TRAIN, assert_same_state

from jitckpt.wire import layout
from jitckpt.wire.config import EXIT_NOT_SAVED

WHY = (None if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("nsenter")
       else "needs root and util-linux unshare/nsenter (a tmpfs in a private mount namespace)")
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")
STEPS = 16


class Tmpfs:
    """A tmpfs over ``path``, seen only by processes run through ``run``."""

    def __init__(self, path: Path, size: str) -> None:
        path.mkdir(mode=0o700, exist_ok=True)
        self.path = path
        self.holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "3600"])
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{self.holder.pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
            assert time.monotonic() < deadline and self.holder.poll() is None, "unshare did not start"
            time.sleep(0.01)
        self.mount(size)

    def mount(self, size: str) -> None:
        subprocess.run(["nsenter", "-t", str(self.holder.pid), "-m", "mount", "-t", "tmpfs", "-o",
                        f"size={size},mode=0700", "tmpfs", str(self.path)], check=True)

    def read_only(self) -> None:
        subprocess.run(["nsenter", "-t", str(self.holder.pid), "-m", "mount", "-o", "remount,ro", str(self.path)],
                       check=True)

    def seen(self, rel: str = "") -> Path:
        """``path``/rel as the namespace sees it."""
        return Path(f"/proc/{self.holder.pid}/root{self.path}") / rel

    def run(self, cmd: list[str], *, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        full = ["nsenter", "-t", str(self.holder.pid), "-m", "--", *cmd]
        proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"timed out: {cmd}\n{out[-4000:]}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, None)

    def close(self) -> None:
        self.holder.kill()
        assert self.holder.wait() == -signal.SIGKILL


@pytest.fixture
def tmpfs(tmp_path):
    made: list[Tmpfs] = []

    def make(size: str, name: str = "jit") -> Tmpfs:
        t = Tmpfs(tmp_path / name, size)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


_FILL_HOOK = r"""import json, os, sys, time
info = json.load(sys.stdin)
root = sys.argv[1]
if info.get("restart_count") == 1:
    # every byte of the jit dir's disk: the restarted workers and the agent run on a full disk. The
    # event log first padded to its page's end (a tmpfs allocates by page): its next line fails whole
    log = os.path.join(root, "events.jsonl")
    pad = -os.path.getsize(log) % 4096
    pad += 4096 if pad < 64 else 0
    head = '{"event": "test_padding", "t": %.3f, "x": "' % time.time()
    with open(log, "a") as f:
        f.write(head + "x" * (pad - len(head) - 3) + '"}\n')
    with open(os.path.join(root, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
print(json.dumps({"action": "restart"}))
"""


def _one(out: str, needle: str) -> str:
    lines = [ln for ln in out.splitlines() if needle in ln]
    assert len(lines) == 1, (needle, out[-5000:])
    return lines[0]


@pytest.mark.slow
def test_full_jit_dir_at_the_save_stops_cleanly_and_the_last_checkpoint_restores(tmp_path, tmpfs, reference):
    fs = tmpfs("8M")
    hook = tmp_path / "fill.py"
    hook.write_text(_FILL_HOOK)
    exe = tmp_path / "hook"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {hook} {fs.path}\n")
    exe.chmod(0o700)
    cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--max-restarts", "3",
           "--jit-dir", str(fs.path), "--jit-timeout", "3", "--jit-scheduler", f"exec:{exe}",
           str(TRAIN), "--steps", str(STEPS), "--out", str(tmp_path / "final.pt")]
    fault = "rank=1,step=4,phase=backward,kind=sigkill;rank=1,step=10,phase=backward,kind=sigkill,attempt=1"
    cp = fs.run(cmd, env={"JITCKPT_FAULT": fault})
    out = cp.stdout
    assert cp.returncode == 1, out[-5000:]
    assert "Traceback" not in out and "Bus error" not in out, out[-5000:]
    worker = _one(out, "[jitckpt] rank 0: no space for the JIT checkpoint")
    stop = _one(out, "jitrun: the job stops, not restarting on a full disk")
    for line in (worker, stop):
        assert f"in {fs.path}:" in line and "needed 1." in line and "free 0 B" in line, line
        assert "pass --jit-dir on a larger disk" in line and "rerun the same command" in line, line
    assert "the newest complete checkpoint here, step 4, is kept" in stop
    # the agent and the restarted ranks on a full disk: said once each, nothing crashed
    _one(out, f"jitrun: warning: could not write {fs.path}/events.jsonl (No space left on device)")
    _one(out, f"jitrun: could not write {fs.path}/ranks.json: [Errno 28] No space left on device")
    assert {ln.split(":")[0] for ln in out.splitlines() if "no hang watch for this rank" in ln} == \
        {"[jitckpt] rank 0", "[jitckpt] rank 1"}, out[-5000:]
    # the ranks' exits (torchrun's failure report: the events of the full disk's time are not in the log):
    # rank 1 killed by the fault, rank 0 ended after its refused save (76), or by its agent once it said so
    codes = dict(re.findall(r"rank +: (\d) \(local_rank: \d\)\n +exitcode +: (-?\d+)", out))
    assert codes["1"] == "-9" and codes["0"] in (str(EXIT_NOT_SAVED), "-9"), (codes, out[-3000:])
    # nothing of the failed save left; step 4 intact and the only one
    assert not [p for p in fs.seen().rglob("*") if p.name.startswith((".tmp-", ".old-"))]
    good, bad = layout.scan(fs.seen(), layout.read_job_id(fs.seen()), layout.read_identity(fs.seen()))
    assert sorted((r.step, r.rank) for r in good) == [(4, 0)] and not bad, (good, bad)
    # the log: whole lines up to the disk filling, readable
    ev = subprocess.run([sys.executable, "-m", "jitrun.cli", "events", "--json", str(fs.seen())], capture_output=True,
                        text=True, timeout=60)
    assert ev.returncode == 0 and not ev.stderr, ev.stderr
    names = [json.loads(ln)["event"] for ln in ev.stdout.splitlines()]
    assert names[0] == "job_start" and "checkpoint_saved" in names and names[-1] == "test_padding", names
    # what came after is in the summary jitrun printed from memory
    assert "restart" not in names and " restart " in out and " job_abort " in out and " job_end " in out

    (fs.seen("filler")).unlink()
    cp = fs.run(cmd)
    assert cp.returncode == 0, cp.stdout[-5000:]
    assert "Traceback" not in cp.stdout and "did not end cleanly" not in cp.stdout, cp.stdout[-5000:]
    assert cp.stdout.count("resumed from ") == 2 and "/step-4/shard-0/rank-0/state.pt at step 4" in cp.stdout
    assert_same_state(reference(2, STEPS), tmp_path / "final.pt")


_PIECES = """\
import errno, json, os, sys, torch
from pathlib import Path
from jitckpt import save_space
from jitckpt.wire import contract
from jitckpt.hang import waits as collective_waits
from jitckpt.hang import status as rank_status
from jitrun.events import EventLog, load
root = Path(sys.argv[1])

# torch.save cut short by the full disk: NoSpace, nothing left, the blocks back
try:
    with save_space.staged(root, 3, "0", 0) as tmp:
        torch.save({"x": torch.zeros(200_000)}, os.path.join(tmp, "state.pt"))
except save_space.NoSpace as e:
    e.release()
    print("SAVE", json.dumps({"line": str(e), **e.fields()}))
assert not list((root / "ckpt" / "step-3" / "shard-0").iterdir())

# the disk full to the last byte, the event log's last page part-filled
log = EventLog(root / "events.jsonl")
for i in range(3):
    log.emit("before", i=i)
with open(root / "filler", "wb", buffering=0) as f:
    try:
        while True:
            f.write(b"\\0" * 4096)
    except OSError:
        pass

# a rank's status record: refused, never a mapping that a store into would SIGBUS
try:
    rank_status.StatusWriter(root, 0, 0)
    print("STATUS created")
except OSError as e:
    print("STATUS", errno.errorcode[e.errno])
print("WAITS", collective_waits.open_waits(root, 0, 0, contract.hang_rule()))
assert not [p for p in (root / "status").iterdir()]

# the event log: whole lines or none (the rest of its last page, then short writes, undone)
for i in range(200):
    log.emit("e", payload="x" * 50, i=i)
print("EVENTS kept", len(log.events), "written", len(load([root])))
"""


def test_pieces_on_a_full_tmpfs(tmpfs):
    """The mid-write failure of torch.save (the error says nothing of space), a status record and the
    event log on a disk full to the last byte: no crash, nothing torn, nothing left behind."""
    fs = tmpfs("256k")
    cp = fs.run([sys.executable, "-c", _PIECES, str(fs.path)])
    assert cp.returncode == 0, cp.stdout[-4000:]
    got = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in cp.stdout.splitlines()
           if ln.split(" ", 1)[0] in ("SAVE", "STATUS", "WAITS", "EVENTS")}
    save = json.loads(got["SAVE"])
    assert save["dir"] == str(fs.path) and save["free"] > 200_000 and save["needed"] >= 200_000, save
    assert "unexpected pos" in save["line"] and "needed more than" in save["line"], save
    assert got["STATUS"] == "ENOSPC" and got["WAITS"] == "None", got
    assert "[jitckpt] rank 0: no hang watch for this rank: cannot create its status record" in cp.stdout
    kept, written = (int(x) for x in got["EVENTS"].replace("kept ", "").split(" written "))
    assert kept == 203 and 3 < written < 203, got["EVENTS"]
    assert cp.stdout.count("jitrun: warning: could not write") == 1 and "torn" not in cp.stdout, cp.stdout[-3000:]


def test_a_torn_last_line_is_skipped_and_said(tmp_path):
    p = tmp_path / "events.jsonl"
    p.write_text('{"event": "job_start", "t": 1.0}\n{"event": "restart", "t": 2.0}\n{"event": "job_e')
    cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "events", "--json", str(p)], capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert [json.loads(ln)["event"] for ln in cp.stdout.splitlines()] == ["job_start", "restart"]
    assert cp.stderr.strip() == (f"jitrun events: warning: {p}:3: a torn line (a write cut short, e.g. by a full "
                                 "disk) skipped")
    from jitrun.events import EventLog

    EventLog(p).emit("job_end", t=3.0)  # a writer after a torn line starts a new one
    assert p.read_text().splitlines()[2:] == ['{"event": "job_e', '{"event": "job_end", "t": 3.0}']
    p.write_text('{"event": "job_start", "t": 1.0}\nnot json at all\n')
    cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "events", str(p)], capture_output=True, text=True,
                        timeout=60)
    assert cp.returncode == 2 and "not a JSON line" in cp.stderr, cp.stderr


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_jitrun_on_a_full_or_read_only_jit_dir_says_so_in_one_line(tmp_path, tmpfs, how):
    fs = tmpfs("64k")
    if how == "full":
        fs.run([sys.executable, "-c", textwrap.dedent(f"""\
            f = open({str(fs.path / 'filler')!r}, 'wb', buffering=0)
            try:
                while True: f.write(b'\\0' * 4096)
            except OSError: pass""")])
    else:
        fs.read_only()
    (tmp_path / "train.py").write_text("raise SystemExit('a worker started')\n")
    cp = fs.run([sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--jit-dir", str(fs.path / "jit"),
                 str(tmp_path / "train.py")])
    lines = cp.stdout.strip().splitlines()
    assert cp.returncode == 2 and len(lines) == 1 and "Traceback" not in cp.stdout, cp.stdout
    why = "No space left on device" if how == "full" else "Read-only file system"
    assert lines[0].startswith("jitrun: error: ") and why in lines[0] and "--jit-dir" in lines[0], lines[0]
