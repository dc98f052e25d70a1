"""`jitrun --no-python --jit-intercept on` runs a C program with the shim in
recover mode by default (launcher/cli.py): the issue's reproduction (a lost
collective hung the job for the full wall limit; an NCCL error ended it) now
recovers in place, the processes are the same, the result is bit-identical,
and the timeline gets one in_place_recovery record per recovery."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
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


def _rank_pid(parent: int, rank: int) -> int | None:
    """The worker of ``rank`` among the children of jitrun (pid ``parent``)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and f"\0RANK={rank}\0".encode() in b"\0" + (d / "environ").read_bytes():
                return int(d.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def jitrun(tmp: Path, nranks: int = 3, steps: int = 6, restarts: int = 0, per_rank: dict | None = None,
           stop: tuple[int, int, float] | None = None, **env: str):
    """``per_rank``: {rank: {VAR: value}} set for that rank only (through a shell
    wrapper). ``stop``: (rank, step, seconds): that rank is SIGSTOPped once it
    reports the step (its host work at the step's start), continued later."""
    tmp.mkdir(parents=True, exist_ok=True)
    e = st.env(preload=False)  # jitrun itself preloads the shim into the workers
    e["JITCKPT_INTERCEPT_LIB"] = str(st.SHIM)
    e.update(env)
    prog = [str(st.PROGS / "dp"), "-", "-", str(steps), str(tmp)]
    if per_rank:
        sets = " ".join(f'[ "$RANK" = {r} ] && export {" ".join(f"{k}={v}" for k, v in kv.items())};'
                        for r, kv in per_rank.items())
        prog = ["/bin/sh", "-c", f'{sets} exec "$@"', "sh", *prog]
    cmd = [str(JITRUN), "--nproc-per-node", str(nranks), "--no-python", "--jit-intercept", "on",
           "--jit-timeout", "1", "--max-restarts", str(restarts), "--jit-dir", str(tmp / "jit"), *prog]
    pj = subprocess.Popen(cmd, env=e, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if stop is not None:
            rank, at, secs = stop
            assert st.wait_for(lambda: st.progress(tmp, rank) >= at, 60, step=0.002), "never reached the step"
            pid = _rank_pid(pj.pid, rank)
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            time.sleep(secs)
            os.kill(pid, signal.SIGCONT)
        out, err = pj.communicate(timeout=120)
    finally:
        if pj.poll() is None:
            pj.kill()
            pj.communicate()
    p = subprocess.CompletedProcess(cmd, pj.returncode, out, err)
    finals = {int(m.group(1)): m.groups() for m in FINAL.finditer(p.stdout)}
    bufs = {r: (tmp / f"final.{r}").read_bytes() for r in range(nranks) if (tmp / f"final.{r}").exists()}
    evs = [json.loads(x) for x in (tmp / "jit" / "events.jsonl").read_text().splitlines() if x.strip()]
    return p, finals, bufs, evs


_refs: dict[int, tuple] = {}


def reference(tmp: Path, steps: int) -> tuple:
    if steps not in _refs:
        p0, f0, b0, _ = jitrun(tmp / f"clean{steps}", steps=steps, DP_STEP_MS="20" if steps > 6 else "0")
        assert p0.returncode == 0, p0.stdout + p0.stderr
        _refs[steps] = (f0, b0)
    return _refs[steps]


def check_in_place(tmp: Path, p, f, b, evs, steps: int = 6, epochs: int = 1) -> list[dict]:
    f0, b0 = reference(tmp, steps)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(f) == [0, 1, 2] and all(int(x[4]) == epochs for x in f.values()), p.stdout
    assert b == b0 and {r: x[3] for r, x in f.items()} == {r: x[3] for r, x in f0.items()}
    pids = {int(m) for m in re.findall(r"^PID (\d+)$", p.stdout, re.M)}
    assert pids == {int(x[1]) for x in f.values()}, "the processes that started are the ones that finished"
    assert not [e for e in evs if e["event"] == "restart"]  # no process was restarted
    rec = [e for e in evs if e["event"] == "in_place_recovery"]
    assert len(rec) == epochs and all(r["outcome"] == "recovered" and r["ranks"] == [0, 1, 2] for r in rec), rec
    assert f"in-place recovery (epoch {epochs}" in p.stdout
    return rec


@pytest.mark.parametrize("fault", [
    dict(JITSIM_HANG_AT="5", JITSIM_HANG_RANK="1"),
    dict(per_rank={1: dict(JITSIM_NCCL_ERROR_AT="5")}),
    dict(per_rank={0: dict(JITSIM_NCCL_ERROR_AT="3", JITSIM_NCCL_ERROR_ASYNC="1")}),
    dict(JITSIM_NCCL_ERROR_AT="5"),
    dict(JITSIM_NCCL_ERROR_AT="5", JITSIM_NCCL_ERROR_ASYNC="1"),
], ids=["lost_collective", "sync_nccl_error_one_rank", "async_nccl_error_one_rank",
        "sync_nccl_errors_all_ranks", "async_nccl_errors_all_ranks"])
def test_jitrun_recovers_in_place(tmp_path: Path, fault: dict) -> None:
    p, f, b, evs = jitrun(tmp_path / "fault", **fault)
    rec = check_in_place(tmp_path, p, f, b, evs)
    assert rec[0]["recovery_minus_timeout_s"] < 0.5


def test_jitrun_two_faults_in_one_run(tmp_path: Path) -> None:
    """A lost collective on rank 1, later a synchronous NCCL error on rank 2
    (op numbers shift by the replayed collectives): two epochs, same processes."""
    p, f, b, evs = jitrun(tmp_path / "two", per_rank={1: dict(JITSIM_HANG_AT="3"), 2: dict(JITSIM_NCCL_ERROR_AT="8")})
    check_in_place(tmp_path, p, f, b, evs, epochs=2)


def test_jitrun_stopped_rank_continued(tmp_path: Path) -> None:
    """Rank 2 SIGSTOPped for 2 s (twice the timeout) in its host work, then
    continued: the others detect the hang and wait in epoch 1, rank 2 joins it."""
    p, f, b, evs = jitrun(tmp_path / "stop", steps=30, stop=(2, 5, 2.0), DP_STEP_MS="20")
    rec = check_in_place(tmp_path, p, f, b, evs, steps=30)
    assert rec[0]["faults"]["2"] in ("peer", "hang"), rec


def test_jitrun_fallback_restarts(tmp_path: Path) -> None:
    """An optimizer-phase fault cannot be replayed: every rank exits 75 with a
    fallback line and jitrun's restart path runs the job again."""
    p, f, b, evs = jitrun(tmp_path / "opt", restarts=1, JITSIM_HANG_AT="4", JITSIM_HANG_RANK="1",
                          DP_FAULTS_FIRST_ATTEMPT="1")
    assert p.returncode == 0, p.stdout + p.stderr
    rec = [e for e in evs if e["event"] == "in_place_recovery"]
    assert rec and rec[0]["outcome"] == "fallback" and any("optimizer" in r for r in rec[0]["reasons"])
    assert sorted(f) == [0, 1, 2] and all(int(x[4]) == 0 for x in f.values())  # the restarted processes
