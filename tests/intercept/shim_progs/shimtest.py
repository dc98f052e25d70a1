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

# The stand-in's runtime and NCCL, as the test programs link them. A library
# is found by SONAME once one of that name is in the process, so in a Python
# child that imports torch's CUDA build (which needs the wheel's real
# libcudart.so.13 and libnccl.so.2) the stand-in would never load; preloaded,
# the stand-in is the one torch and the test programs both bind to.
STANDIN = (SIM / "libcudart.so.13", SIM / "libnccl.so.2")


def env(preload: bool = True, leaks: bool = True, standin: bool = False, **extra: str) -> dict[str, str]:
    """Environment for a child with the shim preloaded (``preload``) and the
    stand-in preloaded after it (``standin``: Python children that load the
    stand-in; C programs find it through their RPATH).

    Under ASan, leak checking is on for C programs (leaks=True), with the
    stand-in's own objects suppressed (events and streams the watchdog keeps
    for the life of the process are allocated inside libjitsimcore); Python
    children pass leaks=False (the interpreter does not free at exit)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "JITSIM_"))}
    e.pop("LD_PRELOAD", None)
    libs = ([_libasan()] if ASAN and preload else []) + ([str(SHIM)] if preload else [])
    libs += [str(p) for p in STANDIN] if standin else []
    if libs:
        e["LD_PRELOAD"] = " ".join(libs)
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
        python = "python" in Path(argv[0]).name
        e = env(leaks=not python, standin=python, **extra)
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


# Which file a library that needs libcudart.so.13 / libnccl.so.2 binds to (the
# first loaded object of that SONAME), and what torch's own calls reach.
# torch's CUDA build also dlopens the wheel's copies by path (RTLD_LOCAL,
# torch/__init__.py _preload_cuda_deps); nothing binds to those.
_PROBE = """
import ctypes, json, os, sys
import torch
ctypes.CDLL(sys.argv[1])

class DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

def origin(soname, sym):
    h = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
    info = DlInfo()
    ctypes.CDLL(None).dladdr(ctypes.cast(getattr(h, sym), ctypes.c_void_p), ctypes.byref(info))
    return info.fname.decode()

devices = torch.cuda.device_count() if torch.version.cuda else None
print(json.dumps({"torch": torch.__version__, "devices": devices,
                  "cudart": origin("libcudart.so.13", "cudaGetDeviceCount"),
                  "nccl": origin("libnccl.so.2", "ncclGetVersion")}))
"""
_python_standin: dict[str, str | None] = {}


def python_standin_problem(python: str) -> str | None:
    """None when a child of ``python`` that imports torch, with ``env(standin=True)``,
    binds every libcudart.so.13 and libnccl.so.2 reference to the stand-in
    (torch's included: a CUDA build counts the stand-in's devices) and can
    load dp.so; otherwise why not, for a skip: a torch build whose libraries
    need entry points the stand-in does not export."""
    if python not in _python_standin:
        p = subprocess.run([python, "-c", _PROBE, str(PROGS / "dp.so")],
                           env=env(preload=False, standin=True, JITSIM_DEVICES="3"),
                           capture_output=True, text=True, timeout=300)
        why = None
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            why = (f"torch in {python} cannot run over the stand-in runtime ({', '.join(map(str, STANDIN))} "
                   f"preloaded): {last}")
        else:
            res = json.loads(p.stdout.splitlines()[-1])
            bound = {Path(res["cudart"]).resolve(), Path(res["nccl"]).resolve()}
            if bound != {lib.resolve() for lib in STANDIN} or res["devices"] not in (None, 3):
                why = (f"torch {res['torch']} does not use the stand-in although it is preloaded: libcudart.so.13 "
                       f"is {res['cudart']}, libnccl.so.2 is {res['nccl']}, torch counts {res['devices']} devices")
        _python_standin[python] = why
    return _python_standin[python]


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
