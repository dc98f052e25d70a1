"""Helpers for the shim tests: build, environment, process bookkeeping.

JITCKPT_SHIM selects the shim under test (default build/libjitintercept.so);
pointing it at build/asan/libjitintercept.so re-runs every test against the
ASan/UBSan build (libasan is then preloaded first, as it must be).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BUILD = REPO / "build"
PROGS = BUILD / "shim-tests"
SIM = BUILD / "sim"
_env_shim = os.environ.get("JITCKPT_SHIM", "")
SHIM = (REPO / _env_shim).resolve() if _env_shim else BUILD / "libjitintercept.so"
ASAN = "asan" in SHIM.parts
_built = False


def build() -> None:
    """Builds the shim, the stand-in and the test programs (idempotent)."""
    global _built
    if _built:
        return
    targets = ["shim", "shim-test-progs"] + (["asan"] if ASAN else [])
    subprocess.run(["make", "-s", "-C", str(REPO / "libintercept"), *targets], check=True)
    _built = True


def _libasan() -> str:
    out = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


LSAN_SUPP = BUILD / "shim-tests" / "lsan.supp"


def env(preload: bool = True, leaks: bool = True, **extra: str) -> dict[str, str]:
    """Environment for a child with the shim preloaded.

    Under ASan, leak checking is on for C programs (leaks=True), with the
    stand-in's own objects suppressed (events and streams the watchdog keeps
    for the life of the process are allocated inside libjitsimcore); Python
    children pass leaks=False (the interpreter does not free at exit)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "JITSIM_"))}
    e.pop("LD_PRELOAD", None)
    if preload:
        e["LD_PRELOAD"] = f"{_libasan()} {SHIM}" if ASAN else str(SHIM)
    if ASAN:
        LSAN_SUPP.parent.mkdir(parents=True, exist_ok=True)
        LSAN_SUPP.write_text("leak:libjitsimcore.so\n")
        e["ASAN_OPTIONS"] = f"detect_leaks={int(leaks)}:abort_on_error=0:exitcode=66"
        e["LSAN_OPTIONS"] = f"suppressions={LSAN_SUPP}:exitcode=68"
        e["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1:exitcode=67"
    e.update(extra)
    return e


class Job:
    """A set of child processes of one stand-in job; cleans up by PID and job tag."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.tag = "shimt" + uuid.uuid4().hex[:10]
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, argv: list[str], name: str, **extra: str) -> subprocess.Popen[str]:
        e = env(leaks="python" not in Path(argv[0]).name, **extra)
        e["JITSIM_JOB"] = self.tag
        out = open(self.tmp / f"{name}.out", "w")
        p = subprocess.Popen(argv, env=e, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=self.tmp)
        out.close()
        self.procs.append(p)
        return p

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.out").read_text()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for f in glob.glob(f"/dev/shm/jitsim-{self.tag}-*"):
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for(pred, timeout: float, step: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def progress(tmp: Path, rank: int) -> int:
    try:
        return int((tmp / f"progress.{rank}").read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return -1


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
