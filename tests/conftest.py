"""Shared helpers: running jitrun / torchrun jobs as real process trees."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "scripts" / "demo_train.py"
sys.path.insert(0, str(ROOT / "scripts"))


# /dev/shm entries the suite must never leave behind: multiprocessing's named
# semaphores (a killed process tree whose resource tracker died with it) and
# the stand-in's NCCL segments. One counts as leaked when it appeared during
# the session and no process maps it (a concurrent run's live ones are mapped).
_SHM = Path("/dev/shm")
_SHM_PREFIXES = ("sem.mp-", "jitsim-")
_shm_at_start: set[str] = set()


def _shm_entries() -> set[str]:
    try:
        return {p.name for p in _SHM.iterdir() if p.name.startswith(_SHM_PREFIXES)}
    except OSError:
        return set()


def _shm_mapped() -> set[str]:
    names: set[str] = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for line in (d / "maps").read_text().splitlines():
                i = line.find("/dev/shm/")
                if i >= 0:
                    names.add(line[i + 9:].split()[0])
        except OSError:
            continue
    return names


# TMPDIR of every process the suite starts: torchrun's agent makes a log dir
# (/tmp/torchelastic_*) per run and never removes it, multiprocessing a pymp-*
# dir per process tree it loses to a kill, the benchmarks their work dirs; a CI
# run left ~340 of them. They land here, one dir per session (named for its
# PID, so concurrent runs stay apart), removed when the session ends. This
# process keeps the system default (tempfile caches it before TMPDIR changes):
# pytest's tmp_path dirs stay where failures can be read after the run.
_CHILD_TMP: Path | None = None


def pytest_report_header(config: pytest.Config) -> str:
    """Which torch build the run has: pip resolves either (README, Set-up)."""
    try:
        import torch
    except ImportError:
        return "torch: not installed"
    cuda = torch.version.cuda
    return f"torch {torch.__version__} ({f'CUDA {cuda} build' if cuda else 'CPU build'})"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Modules with long tests first (a stable sort; a module stays in one
    piece, so its module-scoped fixtures are set up once): under xdist the
    last tests handed out are then short ones, not a multi-node test running
    alone at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)


def pytest_sessionstart(session: pytest.Session) -> None:
    global _CHILD_TMP
    _shm_at_start.update(_shm_entries())
    tempfile.gettempdir()  # fixes this process's default before TMPDIR changes
    _CHILD_TMP = Path(tempfile.mkdtemp(prefix=f"jitckpt-tests-{os.getpid()}-"))
    os.environ["TMPDIR"] = str(_CHILD_TMP)
    _others_seen.update(_other_sessions())


_others_seen: set[int] = set()


def _other_sessions() -> set[int]:
    """PIDs of other live test sessions of this suite (their TMPDIRs sit next to
    ours), not counting this run's own xdist controller and workers."""
    import psutil

    me, parent = os.getpid(), os.getppid()
    out = set()
    for d in _CHILD_TMP.parent.glob("jitckpt-tests-*-*") if _CHILD_TMP is not None else ():
        try:
            pid = int(d.name.split("-")[2])
            ppid = psutil.Process(pid).ppid()
        except (ValueError, IndexError, psutil.Error):
            continue
        ours = pid in (me, parent) or ppid == me or ("PYTEST_XDIST_WORKER" in os.environ and ppid == parent)
        if not ours:
            out.add(pid)
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import time

    _others_seen.update(_other_sessions())
    if _CHILD_TMP is not None:
        shutil.rmtree(_CHILD_TMP, ignore_errors=True)
    leaked = _shm_entries() - _shm_at_start - _shm_mapped()
    # A concurrent run's job that just died leaves its semaphores to its resource
    # tracker for a moment: only what is still there seconds later is a leak.
    deadline = time.monotonic() + 5
    while leaked and time.monotonic() < deadline:
        time.sleep(0.5)
        leaked &= _shm_entries() - _shm_mapped()
    leaked = sorted(leaked)
    if leaked and _others_seen:
        # their jobs' semaphores are named like ours: what appeared cannot be told apart
        print(f"\n/dev/shm gained {leaked} during this test session, while other test sessions ran "
              f"(PIDs {sorted(_others_seen)}): not counted as this session's leak", file=sys.stderr)
    elif leaked:
        print(f"\nLEAKED in /dev/shm during this test session (created by it, mapped by no process): "
              f"{leaked}; a test killed a process tree without cleaning up after it", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@dataclass
class Job:
    returncode: int
    output: str
    jit_dir: Path
    out: Path

    def events(self) -> list[dict]:
        p = self.jit_dir / "events.jsonl"
        evs = [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
        for e in evs:
            if e["event"] == "recovery":
                assert_verified_fingerprint(e)
        return evs

    def of(self, name: str) -> list[dict]:
        return [e for e in self.events() if e["event"] == name]


def run_tree(cmd: list[str], env: dict | None = None, timeout: float = 180, cwd: Path | None = None
             ) -> subprocess.CompletedProcess:
    """Run cmd in its own session; on timeout kill that session (our processes only)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True, cwd=cwd)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


# torch 2.13 + gloo: a process that leaves with its process group alive can die at interpreter
# exit with "terminate called without an active exception" (SIGABRT): gloo's worker threads still
# hold work objects with Python references, freed during finalization when the GIL can no longer be
# taken (pytorch/pytorch#190489; the atexit fix in pytorch/pytorch#179291 was abandoned). CI saw it
# in plain torchrun baselines (Lightning, Accelerate), with no jitckpt thread in the process.
UPSTREAM_EXIT_ABORT = "terminate called without an active exception"


def died_of_upstream_exit_abort(returncode: int | None, output: str) -> bool:
    """Whether a plain-torchrun baseline failed of the abort above (None: still running, killed)."""
    return returncode not in (0, None) and UPSTREAM_EXIT_ABORT in output and "SIGABRT" in output


def run_reference(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """A failure-free baseline under plain torchrun (not the system under test): run again, once,
    when it died of the upstream exit abort above, and say so; anything else is returned as is."""
    cp = run_tree(cmd, **kw)
    if died_of_upstream_exit_abort(cp.returncode, cp.stdout):
        print(f"reference run hit the upstream gloo exit abort (pytorch#190489); running it again: {cmd[3:6]}")
        cp = run_tree(cmd, **kw)
    return cp


def jitrun(tmp: Path, *, nproc: int = 2, steps: int = 16, fault: str = "", timeout_s: float | str | None = 3,
           max_restarts: int = 3, extra: list[str] | None = None, train_args: list[str] | None = None,
           env: dict | None = None, jit_dir: Path | None = None) -> Job:
    jit_dir = jit_dir or tmp / "jit"
    out = tmp / "final.pt"
    # the launch line users type (no rendezvous flags); tests/test_launch_forms.py covers the others
    cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), "--jit-dir", str(jit_dir),
           *(["--jit-timeout", str(timeout_s)] if timeout_s is not None else []),  # None: learned
           *(extra or []), str(TRAIN), "--steps", str(steps), "--out", str(out), *(train_args or [])]
    e = {"JITCKPT_FAULT": fault} if fault else {}
    cp = run_tree(cmd, env={**e, **(env or {})})
    return Job(cp.returncode, cp.stdout, jit_dir, out)


def torchrun_reference(tmp: Path, nproc: int, steps: int) -> Path:
    out = tmp / f"reference-{nproc}-{steps}.pt"
    cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(nproc), str(TRAIN), "--steps", str(steps), "--out", str(out)])
    assert cp.returncode == 0, cp.stdout[-3000:]
    return out


def _run_wide_dir(tmp_path_factory, name: str) -> Path:
    """A directory of this test run shared by its xdist workers (the parent of
    their base temp dirs, named for the run), or the session's own without xdist."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:
        return tmp_path_factory.mktemp(name)
    d = tmp_path_factory.getbasetemp().parent / f"{name}-{uid}"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Final states of failure-free plain-torchrun runs, computed once per
    (nproc, steps) per test run: the first xdist worker to need one computes it
    under a lock, the others wait for it and read the same file."""
    import fcntl

    cache: dict[tuple[int, int], Path] = {}
    base = _run_wide_dir(tmp_path_factory, "reference")

    def get(nproc: int, steps: int = 16) -> Path:
        if (nproc, steps) not in cache:
            out = base / f"reference-{nproc}-{steps}.pt"
            with open(base / f"reference-{nproc}-{steps}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not out.exists():
                    work = Path(tempfile.mkdtemp(dir=base))
                    torchrun_reference(work, nproc, steps).rename(out)
                    shutil.rmtree(work)
            cache[(nproc, steps)] = out
        return cache[(nproc, steps)]

    return get


def assert_verified_fingerprint(rec: dict) -> None:
    """A ``recovery`` record carries the state digest (per shard) the replicas verified against
    each other after the restore, before the first training step (jitckpt/verify/verifier.py)."""
    fp = rec.get("fingerprint")
    assert isinstance(fp, dict) and fp, f"recovery record without a verified state fingerprint: {rec}"
    assert all(isinstance(v, str) and len(v) == 32 and int(v, 16) >= 0 for v in fp.values()), rec


def assert_same_state(a: Path, b: Path) -> None:
    from compare_state import diff_states

    assert b.exists(), f"{b} was not written"
    n, diffs = diff_states(str(a), str(b))
    assert n > 10 and not diffs, diffs[:10]


# -- CRIU (test_criu, test_migrate_mechanism, test_device_loss) ------------------------------

@pytest.fixture(scope="module")
def criu_bin() -> str:
    """A working criu, built once per machine when missing (scripts/build_criu.sh);
    skips with the reason when there is none (not root, kernel without support)."""
    from jitrun.migration import criu

    if os.geteuid() != 0:
        pytest.skip("CRIU needs root")
    try:
        path = criu.find_criu()
        criu.check(path)
        return path
    except criu.CriuError:
        pass
    cp = subprocess.run([str(ROOT / "scripts" / "build_criu.sh")], capture_output=True, text=True)
    try:
        path = criu.find_criu()
        criu.check(path)
    except criu.CriuError as e:
        pytest.skip(f"no working CRIU here ({e}); build_criu.sh said: {cp.stderr[-800:]}")
    return path


@pytest.fixture
def subreaper():
    """Restored trees are detached from criu; as a child subreaper this test process
    becomes their parent, so it can wait for them. Reset after the test."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    yield
    libc.prctl(36, 0, 0, 0, 0)


# -- a real TCPStore on loopback, and the reject lines of jitckpt.wire.auth --------------------------


@pytest.fixture
def store():
    """A TCPStore master on loopback (the agent's store); clients come from ``store_client``."""
    import torch.distributed as dist

    yield dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)


def store_client(store):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30),
                         wait_for_workers=False)


@pytest.fixture
def rejected():
    """The reject lines of jitckpt.wire.auth (what, why), as the agent's events log gets them."""
    from jitckpt.wire import auth

    got: list[tuple[str, str]] = []
    auth.on_reject(lambda what, why: got.append((what, why)))
    yield got
    auth.on_reject(auth._stderr_hook)

