"""Device health through NVML, against the CPU stand-in
libnvidia-ml.so.1 (build/sim, libintercept/sim/nvml.c) loaded by the real pynvml:
each failure kind is reported with its reason; a device that fails while the job
runs makes jitrun stop its rank with a JIT checkpoint and restart without the device
(the local scheduler hook), bit-identical; a device failing before the start is left
out of CUDA_VISIBLE_DEVICES; no NVML (every CPU machine) checks nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TRAIN, Job, assert_same_state

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / "build" / "sim" / "libnvidia-ml.so.1"


@pytest.fixture(scope="module")
def nvml_lib() -> Path:
    subprocess.run(["make", "-s", "-C", str(ROOT / "libintercept"), "sim"], check=True, capture_output=True)
    assert LIB.exists()
    return LIB


def _check(state: str | None, tmp_path: Path, lib: Path | str, code: str = "print(json.dumps(["
           "d.__dict__ for d in health.check()]))") -> list | str:
    f = tmp_path / "nvml.state"
    if state is not None:
        f.write_text(state)
    env = {**os.environ, "JITCKPT_NVML_LIB": str(lib), "JITSIM_NVML_STATE": str(f), "JITSIM_NVML_DEVICES": "3",
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", "import json; from jitrun.devices import health; " + code], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def test_healthy_devices(nvml_lib, tmp_path):
    got = _check(None, tmp_path, nvml_lib)
    assert [(d["index"], d["ok"]) for d in got] == [(0, True), (1, True), (2, True)], got
    assert got[2]["uuid"].startswith("GPU-") and len({d["uuid"] for d in got}) == 3


def test_each_failure_kind_is_reported_with_its_reason(nvml_lib, tmp_path):
    got = _check("device=0 ecc_uncorrected=2\ndevice=1 lost\n", tmp_path, nvml_lib)
    assert [d["ok"] for d in got] == [False, False, True], got
    assert got[0]["reason"] == "2 uncorrected ECC error(s)"
    assert "lost" in got[1]["reason"].lower(), got[1]


def test_fatal_xid_is_reported_once_by_the_monitor_and_a_harmless_one_not(nvml_lib, tmp_path):
    code = ("seen = []; m = health.HealthMonitor(60, seen.append, lambda *a, **k: None); "
            "a = m.poll_once(); open(__import__('os').environ['JITSIM_NVML_STATE'], 'w').write('device=2 xid=79\\n'); "
            "b = m.poll_once(); c = m.poll_once(); "
            "print(json.dumps([[d.__dict__ for d in x] for x in (a, b, c)] + [len(seen)]))")
    a, b, c, calls = _check("device=1 xid=13\n", tmp_path, nvml_lib, code)  # 13: a program's own fault
    assert a == [] and c == [] and calls == 1, (a, b, c)
    assert [(d["index"], d["reason"]) for d in b] == [(2, "XID 79")]


def test_no_nvml_checks_nothing(tmp_path):
    got = _check(None, tmp_path, tmp_path / "no-such-libnvidia-ml.so.1",
                 "print(json.dumps([health.available(), health.check()]))")
    assert got == [False, []]


def _jitrun(tmp_path: Path, state: Path, extra_env: dict, steps: int = 40) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
           "--jit-timeout", "3", "--jit-dir", str(tmp_path / "jit"), "--jit-health-interval", "0.3", str(TRAIN),
           "--steps", str(steps), "--step-sleep", "0.1", "--out", str(tmp_path / "final.pt")]
    env = {**os.environ, "JITCKPT_NVML_LIB": str(LIB), "JITSIM_NVML_STATE": str(state), "JITSIM_NVML_DEVICES": "3",
           "OMP_NUM_THREADS": "1", **extra_env}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    log = open(tmp_path / "jitrun.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _finish(p: subprocess.Popen, tmp_path: Path) -> Job:
    try:
        assert p.wait(timeout=240) == 0, (tmp_path / "jitrun.log").read_text()[-4000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    return Job(0, (tmp_path / "jitrun.log").read_text(), tmp_path / "jit", tmp_path / "final.pt")


def test_device_failing_while_training_restarts_its_rank_without_it(nvml_lib, tmp_path, reference):
    state = tmp_path / "nvml.state"
    p = _jitrun(tmp_path, state, {})
    deadline = time.monotonic() + 120
    while "step   10" not in (tmp_path / "jitrun.log").read_text():
        assert time.monotonic() < deadline and p.poll() is None, (tmp_path / "jitrun.log").read_text()[-3000:]
        time.sleep(0.05)
    state.write_text("device=1 lost\n")
    job = _finish(p, tmp_path)
    assert_same_state(reference(2, 40), job.out)
    bad = job.of("device_unhealthy")
    assert bad and bad[0]["device"] == 1 and "lost" in bad[0]["reason"].lower(), bad
    assert [e["ranks"] for e in job.of("device_restart")] == [[1]], job.events()
    restart = job.of("restart")
    assert len(restart) == 1 and restart[0]["placement"]["visible_devices"] == "0,2", restart
    rec = job.of("recovery")
    assert len(rec) == 1 and rec[0]["redone_minibatches"] <= 1, rec


def test_device_failing_before_the_start_is_left_out(nvml_lib, tmp_path, reference):
    state = tmp_path / "nvml.state"
    state.write_text("device=0 ecc_uncorrected=1\n")
    job = _finish(_jitrun(tmp_path, state, {}, steps=12), tmp_path)
    assert_same_state(reference(2, 12), job.out)
    bad = job.of("device_unhealthy")
    assert bad and bad[0]["stage"] == "start" and bad[0]["devices"] == ["0"], bad
    assert "CUDA_VISIBLE_DEVICES=1,2" in job.output, job.output[-3000:]
    assert not job.of("restart")
