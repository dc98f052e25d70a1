"""In-place recovery of transient faults (JITCKPT_ON_HANG=recover, paper §4.2.1).

A 3-rank data-parallel program on the stand-in (`dp`: compute stream + NCCL
stream + events, H2D input, gradient kernel, grouped all-reduce, optimizer
kernel with momentum state and a grad-norm all-reduce in the optimizer phase)
runs against a real torch.distributed TCPStore. Faults are injected with the
stand-in's JITSIM_* variables; every rank must exit 0 in the same process, and
the final device buffers (and the losses the host saw) must equal those of a
failure-free run bit for bit. Fallback cases must never print a result.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "shim_progs"))
import dpjob  # noqa: E402
import shimtest as st  # noqa: E402

pytest.importorskip("torch.distributed")

NR = 3
_baselines: dict[tuple[int, int], dict] = {}


@pytest.fixture(scope="module", autouse=True)
def _build() -> None:
    st.build()


def baseline(tmp: Path, steps: int) -> dict:
    key = (NR, steps)
    if key not in _baselines:
        r = dpjob.run(tmp / f"base{steps}", NR, steps)
        assert all(c == 0 for c in r["rc"].values()), r["out"]
        assert not r["events"]
        _baselines[key] = r
    return _baselines[key]


def check_recovered(r: dict, base: dict, epochs: int) -> None:
    assert r["rc"] == {i: 0 for i in range(NR)}, r["out"]
    for i in range(NR):
        f = r["final"][i]
        assert f["pid"] == r["pids"][i]  # the same process ran to the end
        assert f["recoveries"] == epochs, r["events"]
        assert r["buf"][i] == base["buf"][i]  # device state bit for bit
        assert f["host"] == base["final"][i]["host"]  # and what the host read
    rec = [e for e in r["events"] if e["event"] == "shim_recovery"]
    assert len(rec) == NR * epochs, rec
    assert all(e["outcome"] == "recovered" for e in rec), rec
    assert sorted(e["epoch"] for e in rec) == sorted(list(range(1, epochs + 1)) * NR)
    for e in rec:
        for k in ("detect_s", "abort_s", "agree_s", "reinit_s", "replay_s", "total_s"):
            assert e[k] >= 0
        assert e["replayed"] > 0
    assert r["store_done"][epochs] == NR  # read back with torch's TCPStore client


def _stop_later(tmp: Path, pid_index: int, at_step: int, stopped: float):
    """SIGSTOP the rank right after it reports step `at_step` (it is then in
    its host work at the start of the step, before any device call)."""

    def start(procs):
        def f():
            st.wait_for(lambda: st.progress(tmp, pid_index) >= at_step, 20, step=0.002)
            os.kill(procs[pid_index].pid, signal.SIGSTOP)
            time.sleep(stopped)
            os.kill(procs[pid_index].pid, signal.SIGCONT)

        threading.Thread(target=f, daemon=True).start()

    return start


CASES = {
    # op 2k+1 is step k's gradient all-reduce (forward/backward phase)
    "hang_one_rank": dict(JITSIM_HANG_AT="5", JITSIM_HANG_RANK="1"),
    "hang_one_rank_virtual_all": dict(JITSIM_HANG_AT="5", JITSIM_HANG_RANK="2", JITCKPT_VIRTUAL_HANDLES="all"),
    "sync_error_one_rank": dict(per_rank_env={1: dict(JITSIM_NCCL_ERROR_AT="5")}),
    "async_error_one_rank": dict(per_rank_env={0: dict(JITSIM_NCCL_ERROR_AT="3", JITSIM_NCCL_ERROR_ASYNC="1")}),
    "sync_errors_all_ranks": dict(JITSIM_NCCL_ERROR_AT="5"),
    "async_errors_all_ranks": dict(JITSIM_NCCL_ERROR_AT="7", JITSIM_NCCL_ERROR_ASYNC="1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_recovered_in_place(tmp_path: Path, case: str) -> None:
    base = baseline(tmp_path, 6)
    r = dpjob.run(tmp_path / case, NR, 6, **CASES[case])
    check_recovered(r, base, 1)
    kinds = {e["fault"] for e in r["events"]}
    if "hang" in case:
        assert kinds == {"hang"}
    elif "async" in case:
        assert "nccl_async_error" in kinds
    else:
        assert "nccl_error" in kinds


def test_two_faults_in_one_run(tmp_path: Path) -> None:
    """A lost collective on rank 1, later a synchronous NCCL error on rank 2
    (op numbers shift by the replayed collectives)."""
    base = baseline(tmp_path, 6)
    r = dpjob.run(
        tmp_path / "two",
        NR,
        6,
        per_rank_env={1: dict(JITSIM_HANG_AT="3"), 2: dict(JITSIM_NCCL_ERROR_AT="8")},
    )
    check_recovered(r, base, 2)
    by_epoch = {e["epoch"]: set() for e in r["events"]}
    for e in r["events"]:
        by_epoch[e["epoch"]].add(e["fault"])
    assert "hang" in by_epoch[1] and "nccl_error" in by_epoch[2]


def test_stopped_rank_joins_late(tmp_path: Path) -> None:
    """Rank 2 is SIGSTOPped past the timeout and continued: the others detect
    the hang, start epoch 1 and wait; rank 2 joins the same epoch."""
    base = baseline(tmp_path, 30)
    r = dpjob.run(tmp_path / "stop", NR, 30, on_start=_stop_later(tmp_path / "stop", 2, 5, 2.0), DP_STEP_MS="40")
    check_recovered(r, base, 1)
    late = [e for e in r["events"] if e["rank"] == 2]
    assert late[0]["fault"] in ("peer", "hang")
    waiting = [e for e in r["events"] if e["rank"] != 2]
    assert all(e["agree_s"] > 0.3 for e in waiting)  # they waited for the late rank


def _fallback(r: dict, reason: str, survivors) -> None:
    for i in survivors:
        assert r["rc"][i] == 75, (i, r["rc"], r["out"][i])
        assert i not in r["final"]  # never a result computed from doubtful state
    fb = [e for e in r["events"] if e["event"] == "shim_recovery"]
    assert {e["rank"] for e in fb} >= set(survivors)
    assert all(e["outcome"] == "fallback" for e in fb), fb
    assert any(reason in e["reason"] for e in fb), [e["reason"] for e in fb]


def test_fallback_rank_killed(tmp_path: Path) -> None:
    tmp = tmp_path / "kill"

    def kill(procs):  # in its host work at the start of step 5: the others hang in step 5's all-reduce
        def f():
            st.wait_for(lambda: st.progress(tmp, 2) >= 5, 20, step=0.002)
            os.kill(procs[2].pid, signal.SIGKILL)

        threading.Thread(target=f, daemon=True).start()

    r = dpjob.run(tmp, NR, 30, on_start=kill, DP_STEP_MS="40", JITCKPT_RECOVER_TIMEOUT="2")
    _fallback(r, "did not complete: 2 of 3 ranks joined", [0, 1])


@pytest.mark.parametrize("asynchronous", [False, True])
def test_fallback_sticky_error(tmp_path: Path, asynchronous: bool) -> None:
    extra = dict(JITSIM_STICKY_ERROR_AT="6")  # step 1's gradient kernel on rank 1
    if asynchronous:
        extra["JITSIM_STICKY_ASYNC"] = "1"
    r = dpjob.run(tmp_path / "sticky", NR, 6, per_rank_env={1: extra})
    _fallback(r, "sticky CUDA error", [0, 1, 2])
    assert any("another rank cannot recover" in e["reason"] for e in r["events"])


def test_fallback_optimizer_phase(tmp_path: Path) -> None:
    # op 4: step 1's grad-norm all-reduce, issued between optimizer_begin/end
    r = dpjob.run(tmp_path / "opt", NR, 6, JITSIM_HANG_AT="4", JITSIM_HANG_RANK="1")
    _fallback(r, "optimizer", [0, 1, 2])


def test_fallback_replay_log_overflow(tmp_path: Path) -> None:
    r = dpjob.run(tmp_path / "ovf", NR, 6, JITSIM_HANG_AT="5", JITSIM_HANG_RANK="1", JITCKPT_REPLAY_CAP_MB="0.01")
    _fallback(r, "replay log overflowed", [0, 1, 2])


def test_fallback_unreplayable_log(tmp_path: Path) -> None:
    """A host function on a stream (like a launch whose parameter sizes are
    unknown) makes the minibatch's log unreplayable."""
    r = dpjob.run(tmp_path / "hostfn", NR, 6, JITSIM_HANG_AT="5", JITSIM_HANG_RANK="1", DP_HOSTFN="1")
    _fallback(r, "replay log is incomplete", [0, 1, 2])


def test_fallback_without_store(tmp_path: Path) -> None:
    r = dpjob.run(tmp_path / "nostore", NR, 6, JITSIM_HANG_AT="5", JITSIM_HANG_RANK="1", MASTER_ADDR=None)
    _fallback(r, "no store", [0, 1, 2])
