"""Stand-in CUDA runtime (build/sim/libcudart.so.1x): streams, events, kernels, faults, loading."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sim_progs"))
import simharness as H  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _build():
    H.build()


def run(mode: str, prog: str = "sim_cuda", **env: str) -> str:
    e = {k: v for k, v in os.environ.items() if not k.startswith("JITSIM_")}
    p = subprocess.run([str(H.PROGS / prog), mode], capture_output=True, text=True, timeout=30, env={**e, **env})
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"PASS {mode}" in p.stdout
    return p.stdout


def test_event_stream_ordering():
    """Event not ready until prior work ends; never-recorded event is ready; wait-event orders
    streams and holds the record current at enqueue; launch args copied by value; timing."""
    run("order")


def test_legacy_default_stream_semantics():
    """cudaMemcpy waits for blocking streams, not non-blocking ones; legacy work orders later
    blocking-stream work; memset/memcpyAsync; last-error bookkeeping."""
    run("legacy")


def test_per_thread_stream_and_cuda13_launch_path():
    run("ptsz")


def test_kernel_param_info_and_errors():
    run("params")


@pytest.mark.parametrize("mode", ["order", "legacy", "ptsz", "params"])
def test_cuda12_runtime(mode):
    """The same behaviour through libcudart.so.12 (no __cudaLaunchKernel there)."""
    run(mode, prog="sim_cuda12")


def test_device_count_env():
    assert "devices 1 err 0" in run("devices")
    assert "devices 4 err 0" in run("devices", JITSIM_DEVICES="4")
    assert "devices 0 err 100" in run("devices", JITSIM_DEVICES="0")


def test_sticky_error_injection():
    run("sticky", JITSIM_STICKY_ERROR_AT="3")
    run("sticky", JITSIM_STICKY_ERROR_AT="3", JITSIM_STICKY_ASYNC="1")


def test_rtld_local_dlopen():
    """A library needing libcudart.so.13, dlopen'ed RTLD_LOCAL, works; the runtime's symbols do
    not become global (dlsym(RTLD_DEFAULT) finds nothing) but the library is loaded."""
    p = subprocess.run(
        [str(H.PROGS / "sim_dlopen"), str(H.PROGS / "libsimdl.so")], capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "result 77 global_cudaLaunchKernel no loaded_cudart13 yes" in p.stdout
