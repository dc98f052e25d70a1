"""`jitrun --no-python --jit-intercept on` runs a C program with the shim in
recover mode by default (launcher/cli.py): the issue's reproduction (a lost
collective hung the job for the full wall limit; an NCCL error ended it) now
recovers in place, the processes are the same, the result is bit-identical,
and the timeline gets one in_place_recovery record per recovery."""

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
JITRUN = Path(sys.executable).parent / "jitrun"
FINAL = re.compile(r"FINAL rank=(\d+) pid=(\d+) dev=(\w+) host=(\w+) recoveries=(\d+)")


@pytest.fixture(scope="module", autouse=True)
def _build() -> None:
    st.build()
    if not JITRUN.exists():
        pytest.skip("jitrun is not installed in this environment")
    if st.ASAN:
        # jitrun puts the shim first in LD_PRELOAD; libasan must come first. The
        # shim's recovery paths run under ASan in test_shim_transparent.py.
        pytest.skip("jitrun cannot preload the ASan shim")


def jitrun(tmp: Path, nranks: int = 3, steps: int = 6, restarts: int = 0, **env: str):
    tmp.mkdir(parents=True, exist_ok=True)
    e = st.env(preload=False)  # jitrun itself preloads the shim into the workers
    e["JITCKPT_INTERCEPT_LIB"] = str(st.SHIM)
    e.update(env)
    cmd = [str(JITRUN), "--nproc-per-node", str(nranks), "--no-python", "--jit-intercept", "on",
           "--jit-timeout", "1", "--max-restarts", str(restarts), "--jit-dir", str(tmp / "jit"),
           str(st.PROGS / "dp"), "-", "-", str(steps), str(tmp)]
    p = subprocess.run(cmd, env=e, cwd=tmp, capture_output=True, text=True, timeout=120)
    finals = {int(m.group(1)): m.groups() for m in FINAL.finditer(p.stdout)}
    bufs = {r: (tmp / f"final.{r}").read_bytes() for r in range(nranks) if (tmp / f"final.{r}").exists()}
    evs = [json.loads(x) for x in (tmp / "jit" / "events.jsonl").read_text().splitlines() if x.strip()]
    return p, finals, bufs, evs


@pytest.mark.parametrize("fault", [
    dict(JITSIM_HANG_AT="5", JITSIM_HANG_RANK="1"),
    dict(JITSIM_NCCL_ERROR_AT="5"),
    dict(JITSIM_NCCL_ERROR_AT="5", JITSIM_NCCL_ERROR_ASYNC="1"),
], ids=["lost_collective", "sync_nccl_error", "async_nccl_error"])
def test_jitrun_recovers_in_place(tmp_path: Path, fault: dict) -> None:
    p0, f0, b0, _ = jitrun(tmp_path / "clean")
    assert p0.returncode == 0, p0.stdout + p0.stderr
    p, f, b, evs = jitrun(tmp_path / "fault", **fault)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(f) == [0, 1, 2] and all(int(x[4]) == 1 for x in f.values())
    assert b == b0 and {r: x[3] for r, x in f.items()} == {r: x[3] for r, x in f0.items()}
    assert not [e for e in evs if e["event"] == "restart"]  # no process was restarted
    rec = [e for e in evs if e["event"] == "in_place_recovery"]
    assert len(rec) == 1 and rec[0]["outcome"] == "recovered" and rec[0]["ranks"] == [0, 1, 2], rec
    assert rec[0]["recovery_minus_timeout_s"] < 0.5
    assert "in-place recovery (epoch 1" in p.stdout


def test_jitrun_fallback_restarts(tmp_path: Path) -> None:
    """An optimizer-phase fault cannot be replayed: every rank exits 75 with a
    fallback line and jitrun's restart path runs the job again."""
    p, f, b, evs = jitrun(tmp_path / "opt", restarts=1, JITSIM_HANG_AT="4", JITSIM_HANG_RANK="1",
                          DP_FAULTS_FIRST_ATTEMPT="1")
    assert p.returncode == 0, p.stdout + p.stderr
    rec = [e for e in evs if e["event"] == "in_place_recovery"]
    assert rec and rec[0]["outcome"] == "fallback" and any("optimizer" in r for r in rec[0]["reasons"])
    assert sorted(f) == [0, 1, 2] and all(int(x[4]) == 0 for x in f.values())  # the restarted processes
