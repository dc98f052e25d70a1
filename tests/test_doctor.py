"""`jitrun doctor`: one correct line per component for this machine, and the right
"what to do" when a component is made to fail."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from netns import Cluster

from jitckpt.wire import contract
from jitrun import doctor
from jitrun.migration import criu

ROOT = Path(__file__).resolve().parent.parent


def _doctor(env: dict | None = None) -> tuple[int, dict[str, str]]:
    cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "doctor"], capture_output=True, text=True,
                        env={**os.environ, **(env or {})}, timeout=120, cwd=ROOT)
    lines = {}
    for ln in cp.stdout.splitlines():
        status, rest = ln.split(None, 1)
        name, detail = rest.split(": ", 1)
        lines[name] = f"{status} {detail}"
    assert set(lines) == {"criu", "netns", "shim", "isa-l", "nvml"}, cp.stdout + cp.stderr
    return cp.returncode, lines


def _criu_works() -> bool:
    try:
        path = criu.find_criu()
    except criu.CriuNotFound:
        return False
    return os.geteuid() == 0 and subprocess.run([path, "check"], capture_output=True).returncode == 0


def _isal_loads() -> bool:
    try:
        ctypes.CDLL("libisal.so.2")
        return True
    except OSError:
        return False


def test_each_line_is_right_for_this_machine():
    rc, lines = _doctor()
    expect = {
        "criu": _criu_works(),
        "netns": Cluster.unavailable() is None,
        "shim": (ROOT / "build" / "libjitintercept.so").is_file()
                if not os.environ.get(contract.INTERCEPT_LIB.name) else None,
        "isa-l": _isal_loads(),
    }
    for name, ok in expect.items():
        if ok is None:
            continue
        assert lines[name].startswith("ok" if ok else "FAIL"), (name, lines[name])
    assert rc == (0 if all(v.startswith("ok") for v in lines.values()) else 1)
    if expect["criu"]:
        assert "dumped a test process with a TCP socket" in lines["criu"]
    assert "nvml" in lines


def test_nvml_line_against_the_stand_in():
    """The stand-in libnvidia-ml.so.1: healthy, then one device lost (a FAIL naming it);
    no NVML at all is not a failure on a CPU node."""
    subprocess.run(["make", "-s", "-C", str(ROOT / "libintercept"), "sim"], check=True, capture_output=True)
    code = ("import sys; from jitrun import doctor; r = doctor.check_nvml(); print(r.ok, r.detail)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JITSIM_NVML_DEVICES": "2",
           "JITCKPT_NVML_LIB": str(ROOT / "build" / "sim" / "libnvidia-ml.so.1")}
    with tempfile.NamedTemporaryFile("w", suffix=".state") as st:
        env["JITSIM_NVML_STATE"] = st.name
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
        assert out.startswith("True 2 device(s) healthy"), out
        st.write("device=1 lost\n")
        st.flush()
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
        assert out.startswith("False failing: device 1") and "lost" in out, out
    env["JITCKPT_NVML_LIB"] = "/nonexistent/libnvidia-ml.so.1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
    assert out.startswith("True no NVML here"), out


def test_forced_failures_say_what_to_do(monkeypatch, tmp_path, capsys):
    # criu nowhere: not in the repo's build/, not cached, not on PATH
    monkeypatch.setattr(criu, "_REPO", tmp_path)
    monkeypatch.setenv("JITCKPT_CRIU_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(contract.CRIU.name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    if any(Path(d, "criu").exists() for d in ("/usr/sbin", "/sbin")):
        pytest.skip("a system criu is installed in /usr/sbin or /sbin")
    monkeypatch.setenv(contract.INTERCEPT_LIB.name, str(tmp_path / "libjitintercept.so"))

    def no_isal(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(doctor.ctypes, "CDLL", no_isal)
    monkeypatch.setattr(doctor.os, "geteuid", lambda: 1000)
    assert doctor.main([]) == 1
    out = {ln.split(None, 2)[1].rstrip(":"): ln for ln in capsys.readouterr().out.splitlines()}
    assert out["criu"].startswith("FAIL") and "criu not found" in out["criu"] and "run `make criu`" in out["criu"]
    assert out["netns"].startswith("FAIL") and "run as root" in out["netns"]
    assert out["shim"].startswith("FAIL") and "not found; run `make build`" in out["shim"]
    assert out["isa-l"].startswith("FAIL") and "apt-get install -y libisal2" in out["isa-l"]


def test_bad_criu_override_and_bad_shim_in_a_real_run(tmp_path):
    bogus = tmp_path / "libjitintercept.so"
    bogus.write_bytes(b"not an ELF file")
    rc, lines = _doctor({contract.CRIU.name: str(tmp_path / "criu"), contract.INTERCEPT_LIB.name: str(bogus)})
    assert rc == 1
    assert lines["criu"].startswith("FAIL") and "fix or unset it" in lines["criu"]
    assert lines["shim"].startswith("FAIL") and "does not preload" in lines["shim"] and "make build" in lines["shim"]


def test_help_lists_doctor():
    cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "--help"], capture_output=True, text=True,
                        timeout=120)
    assert "jitrun doctor" in cp.stdout
