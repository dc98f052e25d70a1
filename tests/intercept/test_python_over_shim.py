"""In-place recovery is the default for Python workers too: a
script with no jitckpt code, launched by `jitrun --jit-intercept on`, whose
device work runs on the stand-in (dp_torch.py drives dp.c's steps through
ctypes; torch's backward and optimizer step mark the phases). jitckpt's
runtime hands the shim the optimizer phase marks, so a lost collective or an
NCCL error before the optimizer step is recovered in place by the same
processes, bit-identical, and one inside the optimizer step falls back to the
restart path."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "shim_progs"))
import shimtest as st  # noqa: E402

pytest.importorskip("torch.distributed")
# jitrun, the FINAL line and the module fixture that builds and skips where jitrun cannot preload the shim
from test_jitrun_transparent import FINAL, JITRUN, _build  # noqa: E402, F401

SCRIPT = Path(__file__).parent / "dp_torch.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _standin() -> None:
    """The workers import torch: with its CUDA build, torch's own libcudart.so.13
    would be the process's runtime and dp.so's stand-in would never load. The
    stand-in is preloaded (shimtest.STANDIN); where even so torch cannot run
    over it, the tests skip and say why."""
    st.build()  # the probe loads dp.so
    why = st.python_standin_problem(sys.executable)
    if why:
        pytest.skip(why)


def run(tmp: Path, restarts: int = 0, **env: str):
    tmp.mkdir(parents=True)
    # jitrun preloads the shim into the workers, ahead of the stand-in
    e = st.env(preload=False, standin=True)
    e["JITCKPT_INTERCEPT_LIB"] = str(st.SHIM)
    e.update(env)
    cmd = [str(JITRUN), "--nproc-per-node", "3", "--jit-intercept", "on", "--jit-timeout", "1",
           "--max-restarts", str(restarts), "--jit-dir", str(tmp / "jit"),
           str(SCRIPT), str(st.PROGS / "dp.so"), "6", str(tmp)]
    p = subprocess.run(cmd, env=e, cwd=tmp, capture_output=True, text=True, timeout=180)
    finals = {int(m.group(1)): m.groups() for m in FINAL.finditer(p.stdout)}
    bufs = {r: (tmp / f"final.{r}").read_bytes() for r in range(3) if (tmp / f"final.{r}").exists()}
    evs = [json.loads(x) for x in (tmp / "jit" / "events.jsonl").read_text().splitlines() if x.strip()]
    return p, finals, bufs, evs


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    p, finals, bufs, _ = run(tmp_path_factory.mktemp("pyshim") / "clean")
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(bufs) == [0, 1, 2] and all(int(f[4]) == 0 for f in finals.values())
    return finals, bufs


@pytest.mark.parametrize("fault", [
    dict(JITSIM_HANG_AT="5", JITSIM_HANG_RANK="1"),
    dict(JITSIM_NCCL_ERROR_AT="5"),
], ids=["lost_collective", "sync_nccl_error"])
def test_python_worker_recovers_in_place(tmp_path: Path, reference, fault: dict) -> None:
    f0, b0 = reference
    p, f, b, evs = run(tmp_path / "fault", **fault)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(f) == [0, 1, 2] and all(int(x[4]) == 1 for x in f.values()), p.stdout
    assert b == b0, "device buffers differ from the failure-free run"
    assert not [e for e in evs if e["event"] in ("restart", "failure_detected")], "no process was restarted"
    pids = {int(m) for m in re.findall(r"^PID (\d+)$", p.stdout, re.M)}
    assert pids == {int(x[1]) for x in f.values()}, "the processes that started are the ones that finished"
    rec = [e for e in evs if e["event"] == "in_place_recovery"]
    assert len(rec) == 1 and rec[0]["outcome"] == "recovered" and rec[0]["ranks"] == [0, 1, 2], rec


def test_python_worker_optimizer_phase_falls_back(tmp_path: Path, reference) -> None:
    """NCCL op 4 is minibatch 1's grad-norm all-reduce, inside the optimizer
    step (after the runtime's optimizer_begin mark): not replayable; every rank
    falls back and jitrun's restart runs the job again, bit-identical."""
    f0, b0 = reference
    p, f, b, evs = run(tmp_path / "opt", restarts=1, JITSIM_HANG_AT="4", JITSIM_HANG_RANK="1",
                       DP_FAULTS_FIRST_ATTEMPT="1")
    assert p.returncode == 0, p.stdout + p.stderr
    rec = [e for e in evs if e["event"] == "in_place_recovery"]
    assert rec and rec[0]["outcome"] == "fallback" and any("optimizer" in r for r in rec[0]["reasons"]), rec
    assert [e for e in evs if e["event"] == "restart"], "the fallback went to jitrun's restart path"
    assert sorted(f) == [0, 1, 2] and all(int(x[4]) == 0 for x in f.values())
    assert b == b0
