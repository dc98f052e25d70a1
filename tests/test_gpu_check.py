"""scripts/gpu_check.sh against the CPU stand-in, as CI runs it, so the GPU machine's one command cannot rot.

The device phases (torch under the shim with the real CUDA runtime) are skipped here and say so; every
other phase runs on the CPU: the build against the headers found, the per-call cost programs, the DDP job's
SIGKILL and SIGSTOP recoveries (bit-identical to torchrun), step time, fingerprint.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

pytestmark = pytest.mark.slow


def test_gpu_check_passes_on_the_stand_in(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    p = subprocess.run(["bash", SCRIPT, "--standin", "--out", tmp_path], env=env, capture_output=True, text=True,
                       timeout=400, start_new_session=True)
    log = p.stdout[-6000:] + p.stderr[-2000:]
    assert p.returncode == 0, log
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {k: v["status"] for k, v in doc["phases"].items()}
    assert doc["mode"] == "stand-in" and doc["ok"], log
    assert status == {"probe": "ok", "build": "ok", "shim_under_torch": "skipped", "call_cost": "ok",
                      "recovery": "ok", "step_time": "ok", "fingerprint": "ok"}, status
    rec = doc["phases"]["recovery"]
    for kind in ("sigkill", "sigstop"):
        assert rec[kind]["rc"] == 0 and rec[kind]["identical"] and rec[kind]["faults_fired"] == 1, rec[kind]
        assert rec[kind]["recoveries"] >= 1, rec[kind]
    cost = doc["phases"]["call_cost"]
    assert set(cost["bench"]["added_ns"]) == {"cudaEventRecord", "cudaEventQuery", "cudaStreamWaitEvent"}
    assert set(cost["ncclcost"]["added_ns"]) == {"ncclAllReduce"}
    steps = doc["phases"]["step_time"]
    assert len(steps["step_ms"]["torchrun"]) == len(steps["step_ms"]["jitrun"]) == 1 and steps["torchrun_ms"] > 0
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| recovery | ok" in table and "bit-identical to torchrun" in table, table


def test_gpu_check_refuses_bad_arguments(tmp_path: Path) -> None:
    p = subprocess.run(["bash", SCRIPT, "--frobnicate"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "unknown argument '--frobnicate'" in p.stderr and len(p.stderr.splitlines()) == 1
