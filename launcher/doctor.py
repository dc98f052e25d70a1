"""``jitrun doctor``: does this machine have what jitckpt's optional parts need?

One line per component: ``ok`` or ``FAIL``, what was checked, and for a
failure why and what to do. Exit 0 when all are ok, 1 otherwise. Each check
tries the real thing (a CRIU dump of a process holding a TCP socket, creating a
network namespace, preloading the shim, loading ISA-L), since "installed" is
not "works": e.g. an unpatched CRIU 4.1.1 passes ``criu check`` on kernel 6.18
and then cannot dump any process with an inet socket.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from jitckpt.wire import contract

from .migration import criu

_REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


def _tool(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin",
                                                    "/usr/bin", "/bin"]))


# A process like a migratable worker: PID 1 of its own PID namespace, one established
# TCP connection (the case kernels >= 6.16 broke for unpatched CRIU).
_PROBE = ("import socket, sys, time\n"
          "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
          "c = socket.create_connection(s.getsockname()); a, _ = s.accept()\n"
          "open(sys.argv[1], 'w').close(); time.sleep(60)\n")


def check_criu() -> Result:
    try:
        path = criu.find_criu()
        desc = criu.check(path)
    except criu.CriuError as e:
        return Result("criu", False, str(e))
    with tempfile.TemporaryDirectory(prefix="jitckpt-doctor-") as tmp:
        ready = Path(tmp) / "ready"
        try:
            cmd = criu.migratable_command([sys.executable, "-c", _PROBE, str(ready)])
        except criu.CriuError as e:
            return Result("criu", False, str(e))
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        pid = None
        try:
            pid = criu.ns_init_pid(p.pid)
            deadline = time.monotonic() + 20
            while not ready.exists():
                if p.poll() is not None or time.monotonic() > deadline:
                    return Result("criu", False, f"{desc}, but the probe process did not start")
                time.sleep(0.02)
            res = criu.dump(pid, Path(tmp) / "images", leave_running=True, criu=path, timeout=60)
        except criu.CriuError as e:
            return Result("criu", False, f"{path} cannot dump a process with a TCP socket: {e}")
        finally:
            # ours, by PID: the namespace's PID 1 (its death ends the namespace) and unshare
            for q in (pid, p.pid):
                if q:
                    try:
                        os.kill(q, 9)
                    except ProcessLookupError:
                        pass
            p.wait(timeout=10)
    return Result("criu", True, f"{desc}; dumped a test process with a TCP socket in {res.seconds:.2f}s")


def check_netns() -> Result:
    if os.geteuid() != 0:
        return Result("netns", False, "network namespaces need root; run as root (multi-node tests and "
                                      "migration between namespaces need it)")
    ip, unshare = _tool("ip"), _tool("unshare")
    if not ip or not unshare:
        return Result("netns", False, f"{'ip' if not ip else 'unshare'} not found; "
                                      "apt-get install -y iproute2 util-linux")
    name = f"jitdoctor{os.getpid()}"
    cp = subprocess.run([ip, "netns", "add", name], capture_output=True, text=True)
    if cp.returncode != 0:
        return Result("netns", False, f"`ip netns add` failed: {cp.stderr.strip()}; the kernel needs "
                                      "CONFIG_NET_NS and this container CAP_SYS_ADMIN")
    try:
        cp = subprocess.run([ip, "netns", "exec", name, unshare, "-m", "--propagation", "private", "true"],
                            capture_output=True, text=True)
    finally:
        subprocess.run([ip, "netns", "del", name], capture_output=True)
    if cp.returncode != 0:
        return Result("netns", False, f"a private mount namespace inside a network namespace failed: "
                                      f"{cp.stderr.strip()}; needs CAP_SYS_ADMIN")
    return Result("netns", True, "network and private mount namespaces can be created")


def shim_path() -> Path:
    """The shim jitrun preloads: $JITCKPT_INTERCEPT_LIB, else build/libjitintercept.so
    (as cli._intercept_lib; the shim tests use $JITCKPT_SHIM or the same build path)."""
    env = contract.INTERCEPT_LIB.get()
    return Path(env) if env else _REPO / "build" / "libjitintercept.so"


def check_shim() -> Result:
    lib = shim_path()
    if not lib.is_file():
        return Result("shim", False, f"{lib} not found; run `make build` (needs a C toolchain)"
                      + (f" or fix {contract.INTERCEPT_LIB.name}" if contract.INTERCEPT_LIB.get() else ""))
    true = _tool("true") or "/bin/true"
    # Preload it into a trivial program, as jitrun does into workers: ld.so reports why it cannot.
    cp = subprocess.run([true], env={**os.environ, "LD_PRELOAD": str(lib)}, capture_output=True, text=True)
    if cp.returncode != 0 or "cannot be preloaded" in cp.stderr or "error" in cp.stderr.lower():
        return Result("shim", False, f"{lib} does not preload: {cp.stderr.strip()[:300]}; "
                                     "rebuild it with `make build`")
    return Result("shim", True, f"{lib} preloads")


def check_isal() -> Result:
    try:
        ctypes.CDLL("libisal.so.2")
    except OSError as e:
        return Result("isa-l", False, f"libisal.so.2 cannot be loaded ({e}); apt-get install -y libisal2")
    return Result("isa-l", True, "libisal.so.2 loads")


def check_nvml() -> Result:
    """Not a failure without a driver: a CPU node has no device to watch."""
    from .devices import health

    if not health.available():
        return Result("nvml", True, "no NVML here (libnvidia-ml.so.1 not loadable, or nvidia-ml-py missing): "
                                    "device health checks are off, nothing to do on a CPU node")
    devs = health.check()
    bad = [d for d in devs if not d.ok]
    if bad:
        return Result("nvml", False, "failing: " + "; ".join(f"device {d.index}: {d.reason}" for d in bad)
                      + " (jitrun leaves them out at the next start; replace or reset them)")
    return Result("nvml", True, f"{len(devs)} device(s) healthy")


CHECKS = (check_criu, check_netns, check_shim, check_isal, check_nvml)


def run_checks() -> list[Result]:
    out = []
    for check in CHECKS:
        try:
            out.append(check())
        except Exception as e:  # a broken check must not hide the others
            out.append(Result(check.__name__.removeprefix("check_"), False, f"check crashed: {e!r}"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="jitrun doctor",
        description="Check, one line each, whether CRIU (process migration), network namespaces "
                    "(multi-node tests), the libintercept shim, ISA-L (erasure coding) and NVML (device "
                    "health) work on this machine, and what to do when not. Exit 0 when all work, 1 otherwise.")
    p.parse_args(argv)
    results = run_checks()
    for r in results:
        print(r.line(), flush=True)
    return 0 if all(r.ok for r in results) else 1
