"""CRIU dump/restore of real processes (the foundation under migration).

Each worker runs as PID 1 of its own PID namespace (jitrun.migration.criu.migratable_command),
is dumped (killing it), restored, and must continue its deterministic sequence bit
for bit: a pure-Python worker holding an established TCP connection, and a torch
CPU worker doing matmuls. Also: corrupt images are refused before criu runs, a
missing criu gives the provisioning hint, and a dump taken on one netns node of the
harness restores on another.

Needs root and a working criu (`make criu`; built here once if missing); skips
with the reason otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from netns import CRIU_RESTORE_ON_NODE, Cluster, MigratableProcs, copy_dir, wait_for_line

from jitckpt.wire import contract
from jitrun.migration import criu

ROOT = Path(__file__).resolve().parent.parent
STEPS = 150  # 20 ms each: the dump must land mid-run even on a loaded machine

# Deterministic sequence with a live TCP connection: every value goes through the
# socket and back, so in-flight data and the connection must survive the migration.
PY_WORKER = textwrap.dedent('''
    import os, socket, struct, sys, time
    out, steps = sys.argv[1], int(sys.argv[2])
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
    c = socket.create_connection(srv.getsockname()); a, _ = srv.accept()
    x = 0x9E3779B97F4A7C15
    for i in range(steps):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        c.sendall(struct.pack("<Q", x))
        buf = b""
        while len(buf) < 8:
            buf += a.recv(8 - len(buf))
        (y,) = struct.unpack("<Q", buf)
        # open/append/close per step: no file stays open across a dump
        with open(out, "a") as f:
            f.write(f"{i} {y:016x} pid={os.getpid()}\\n")
        time.sleep(0.02)
    with open(out, "a") as f:
        f.write("done\\n")
''')

TORCH_WORKER = textwrap.dedent('''
    import hashlib, os, sys, time
    import torch
    torch.set_num_threads(1)
    out, steps = sys.argv[1], int(sys.argv[2])
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(256, 256, generator=g) / 16
    x = torch.randn(256, 64, generator=g)
    for i in range(steps):
        x = torch.tanh(w @ x + 0.01 * i)
        h = hashlib.sha256(x.numpy().tobytes()).hexdigest()
        with open(out, "a") as f:
            f.write(f"{i} {h}\\n")
        time.sleep(0.02)
    with open(out, "a") as f:
        f.write("done\\n")
''')


def _expected_py(steps: int) -> list[str]:
    x, lines = 0x9E3779B97F4A7C15, []
    for i in range(steps):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        lines.append(f"{i} {x:016x} pid=1")
    return [*lines, "done"]


@pytest.fixture
def procs():
    ps = MigratableProcs()
    yield ps
    ps.cleanup()


def _lines(p: Path) -> list[str]:
    return p.read_text().splitlines() if p.exists() else []


def _wait_lines(p: Path, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(_lines(p)) < n:
        assert time.monotonic() < deadline, f"{p}: {len(_lines(p))} lines after {timeout}s, want {n}"
        time.sleep(0.02)


def _wait_exit(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    raise AssertionError(f"restored PID {pid} still running after {timeout}s")


def _migrate_and_finish(procs: MigratableProcs, worker: str, tmp: Path, warm_lines: int, start_timeout: float
                        ) -> tuple[list[str], criu.DumpResult, float]:
    script = tmp / "worker.py"
    script.write_text(worker)
    out = tmp / "out.txt"
    outer, pid = procs.start([sys.executable, str(script), str(out), str(STEPS)])
    _wait_lines(out, warm_lines, start_timeout)
    res = criu.dump(pid, tmp / "images")
    # without leave_running the tree is gone: unshare reports its PID 1 killed
    outer.wait(timeout=10)
    at_dump = len(_lines(out))
    assert 0 < at_dump < STEPS, "the dump must land mid-run"
    time.sleep(0.3)
    assert len(_lines(out)) == at_dump, "the dumped worker kept running"
    t0 = time.monotonic()
    criu.verify(tmp / "images")
    t1 = time.monotonic()
    new = criu.restore(tmp / "images", verify_first=False)
    restore_s = time.monotonic() - t1
    print(f"verify {t1 - t0:.3f}s", end=", ")
    procs.pids.append(new)
    assert _wait_exit(new, 120) == 0
    return _lines(out), res, restore_s


def test_python_tcp_worker_continues_bit_identically(criu_bin, procs, subreaper, tmp_path):
    lines, res, restore_s = _migrate_and_finish(procs, PY_WORKER, tmp_path, warm_lines=10, start_timeout=20)
    assert lines == _expected_py(STEPS)  # no step lost or repeated, same values, still PID 1
    manifest = json.loads(res.manifest.read_text())
    assert manifest["files"] and all(len(f["crc32c"]) == 8 for f in manifest["files"].values())
    print(f"python worker: dump {res.seconds:.3f}s ({res.image_bytes / 1e6:.1f} MB), restore {restore_s:.3f}s")


def test_torch_worker_continues_bit_identically(criu_bin, procs, subreaper, tmp_path):
    pytest.importorskip("torch")
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "worker.py").write_text(TORCH_WORKER)
    subprocess.run([sys.executable, str(ref / "worker.py"), str(ref / "out.txt"), str(STEPS)],
                   check=True, timeout=180)
    mig = tmp_path / "mig"
    mig.mkdir()
    lines, res, restore_s = _migrate_and_finish(procs, TORCH_WORKER, mig, warm_lines=5, start_timeout=120)
    assert lines == _lines(ref / "out.txt")
    assert lines[-1] == "done" and len(lines) == STEPS + 1
    print(f"torch worker: dump {res.seconds:.3f}s ({res.image_bytes / 1e6:.1f} MB), restore {restore_s:.3f}s")


DEATHSIG_WORKER = textwrap.dedent('''
    import ctypes, signal, sys, time
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG, as the exec wrapper sets it
    out, steps = sys.argv[1], int(sys.argv[2])
    for i in range(steps):
        with open(out, "a") as f:
            f.write(f"{i}\\n")
        time.sleep(0.02)
    with open(out, "a") as f:
        f.write("done\\n")
''')


def test_a_root_with_a_parent_death_signal_survives_the_restore_helper(criu_bin, procs, subreaper, tmp_path):
    """A worker whose main thread has a parent-death signal (jitrun's migratable wrapper
    sets SIGKILL; a lost device's park clears only the parking thread's): restored
    detached, its parent is criu, which exits right after, so it is killed at once;
    the restore helper jitrun uses restores it as its own child and it finishes."""
    script = tmp_path / "worker.py"
    script.write_text(DEATHSIG_WORKER)
    results = {}
    for how in ("detached", "helper"):
        out = tmp_path / f"out-{how}.txt"
        outer, pid = procs.start([sys.executable, str(script), str(out), str(STEPS)])
        _wait_lines(out, 5, 60)
        criu.dump(pid, tmp_path / f"img-{how}")
        outer.wait(timeout=10)
        if how == "detached":
            new = criu.restore(tmp_path / f"img-{how}")
            procs.pids.append(new)
            results[how] = _wait_exit(new, 60)
            continue
        helper = subprocess.Popen(criu.restore_and_wait_command(tmp_path / f"img-{how}"), stdout=subprocess.PIPE,
                                  text=True, start_new_session=True)
        line = helper.stdout.readline().split()
        assert line[:1] == ["RESTORED"], line
        procs.pids.append(int(line[1]))
        results[how] = helper.wait(timeout=60)
        assert _lines(out)[-1] == "done" and len(_lines(out)) == STEPS + 1
    assert results == {"detached": -9, "helper": 0}, results


def test_corrupt_images_are_refused_before_restore(criu_bin, procs, tmp_path):
    (tmp_path / "worker.py").write_text(PY_WORKER)
    out = tmp_path / "out.txt"
    _, pid = procs.start([sys.executable, str(tmp_path / "worker.py"), str(out), "100000"])
    _wait_lines(out, 3, 20)
    images = tmp_path / "images"
    criu.dump(pid, images, leave_running=True)
    criu.verify(images)  # intact
    pages = sorted(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)[-1]
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    pages.write_bytes(bytes(data))
    with pytest.raises(criu.ImageCorrupt, match=rf"{pages.name}: crc32c differs.*copy them again"):
        criu.verify(images)
    # a manifest written where ISA-L is missing names sha256: still verified
    good = bytearray(data)
    good[len(good) // 2] ^= 0x01
    pages.write_bytes(bytes(good))
    m = json.loads((images / criu.MANIFEST).read_text())
    for name, f in m["files"].items():
        f.pop("crc32c")
        f["sha256"] = hashlib.sha256((images / name).read_bytes()).hexdigest()
    (images / criu.MANIFEST).write_text(json.dumps(m))
    criu.verify(images)
    pages.write_bytes(bytes(data))
    with pytest.raises(criu.ImageCorrupt, match=rf"{pages.name}: sha256 differs"):
        criu.verify(images)
    with pytest.raises(criu.ImageCorrupt):
        criu.restore(images)
    assert not (images / criu.RESTORE_LOG).exists(), "criu must not even start on corrupt images"
    # a missing image file and a stray one are refused as well
    pages.unlink()
    (images / "stray.img").write_bytes(b"x")
    with pytest.raises(criu.ImageCorrupt, match=r"missing.*stray.img: not in the manifest"):
        criu.verify(images)
    (images / criu.MANIFEST).unlink()
    with pytest.raises(criu.ImageCorrupt, match="missing: not a jitckpt CRIU dump"):
        criu.verify(images)


def test_failed_dump_shows_the_log_tail_and_what_to_do(criu_bin, procs, tmp_path):
    # a PID that cannot exist (above pid_max)
    with pytest.raises(criu.CriuError, match=r"criu dump of PID 99999999 .*failed.*criu-dump.log ends:\n"):
        criu.dump(99999999, tmp_path / "images")
    # the usual mistake: dumping unshare instead of the namespace's PID 1
    outer, _ = procs.start(["sleep", "60"])
    with pytest.raises(criu.CriuError, match=r"(?s)nested pid namespace.*what to do: .*ns_init_pid"):
        criu.dump(outer.pid, tmp_path / "images2", leave_running=True)


def test_missing_criu_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv(contract.CRIU.name, str(tmp_path / "no-such-criu"))
    with pytest.raises(criu.CriuNotFound, match=r"JITCKPT_CRIU=.*no-such-criu is not an executable.*make criu"):
        criu.find_criu()
    with pytest.raises(criu.CriuNotFound):
        criu.dump(1, tmp_path / "images")
    monkeypatch.delenv(contract.CRIU.name)
    monkeypatch.setattr(criu, "_REPO", tmp_path)  # no build/criu/criu
    monkeypatch.setenv("JITCKPT_CRIU_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", "/nonexistent")
    if any(Path(d, "criu").exists() for d in ("/usr/sbin", "/sbin")):
        pytest.skip("a system criu is installed in /usr/sbin or /sbin")
    with pytest.raises(criu.CriuNotFound, match=r"criu not found \(looked in .*\); run `make criu`"):
        criu.find_criu()


# Runs on a node: start the worker, dump it into the node's private dir, wait.
NODE_DUMP = textwrap.dedent('''
    import os, subprocess, sys, time
    from jitrun.migration import criu
    worker, out, images = sys.argv[1:4]
    p = subprocess.Popen(criu.migratable_command([sys.executable, worker, out, "{steps}"]),
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid = criu.ns_init_pid(p.pid)
    while not os.path.exists(out) or len(open(out).read().splitlines()) < 10:
        time.sleep(0.02)
    res = criu.dump(pid, images)
    p.wait()
    print(f"DUMPED {{res.seconds:.3f}} {{res.image_bytes}}", flush=True)
    time.sleep(600)  # keep this mount namespace (and the images on its tmpfs) for the copy
''')


def test_dump_on_one_node_restores_on_another(criu_bin, tmp_path):
    why = Cluster.unavailable()
    if why:
        pytest.skip(why)
    with Cluster(2, tag="cr") as c:
        share = c.dir  # host dir both nodes see (the worker's output, as collected logs would be)
        worker = share / "worker.py"
        worker.write_text(PY_WORKER)
        (share / "dump.py").write_text(NODE_DUMP.format(steps=STEPS))
        (share / "restore.py").write_text(CRIU_RESTORE_ON_NODE)
        out = share / "out.txt"
        priv0, priv1 = str(tmp_path / "node0"), str(tmp_path / "node1")
        env = {"PYTHONPATH": str(ROOT), contract.CRIU.name: criu_bin}
        dumper = c.nodes[0].run([sys.executable, str(share / "dump.py"), str(worker), str(out), priv0 + "/images"],
                                name="dump", env=env, private_dirs=(priv0,))
        restorer = c.nodes[1].run([sys.executable, str(share / "restore.py"), priv1 + "/images"],
                                  name="restore", env=env, private_dirs=(priv1,))
        dumped = wait_for_line(dumper, "DUMPED", 60)
        # both nodes' dirs are private tmpfs: the host (and the other node) sees neither
        assert not Path(priv0, "images").exists() and not Path(priv1, "images").exists()
        copy_dir(dumper, priv0 + "/images", restorer, priv1 + "/images")
        restorer.host_path(priv1 + "/images/copied").touch()
        restored = wait_for_line(restorer, "RESTORED", 60)
        assert wait_for_line(restorer, "EXIT", 60) == "EXIT 0", restorer.output()
        assert _lines(out) == _expected_py(STEPS)
        print(f"node0 -> node1: {dumped}, {restored}")


def test_provisioning_is_idempotent_and_cheap_when_cached(criu_bin):
    t0 = time.monotonic()
    cp = subprocess.run([str(ROOT / "scripts" / "build_criu.sh")], capture_output=True, text=True, timeout=600)
    assert cp.returncode == 0, cp.stderr
    assert time.monotonic() - t0 < 10, "a provisioned CRIU must not be rebuilt"
    link = ROOT / "build" / "criu" / "criu"
    assert link.is_symlink() and os.access(link, os.X_OK)


def test_a_wrapper_that_already_exited_is_not_waited_for():
    """A migratable worker that finished before the agent looked for its namespace's PID 1
    leaves its wrapper a zombie the agent (busy looking) has not reaped: that is an answer
    at once, not a wait for the whole timeout (it held a restart for 60 s)."""
    p = subprocess.Popen(["true"])
    try:
        while psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(criu.CriuError, match="exited before its worker was seen"):
            criu.ns_init_pid(p.pid, timeout=30)
        assert time.monotonic() - t0 < 5
    finally:
        p.wait()
