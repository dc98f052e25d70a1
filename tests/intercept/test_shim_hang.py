"""Collective watchdog on the stand-in: hangs and NCCL errors are reported by
every healthy rank within timeout + 1 s; a healthy jittered run never is."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "shim_progs"))
import shimtest as st  # noqa: E402

TIMEOUT = 1.5


@pytest.fixture(scope="module", autouse=True)
def _build() -> None:
    st.build()


def _start(job: st.Job, tmp: Path, nranks: int, per_rank: dict[int, dict[str, str]] | None = None, **extra: str):
    procs = []
    for r in range(nranks):
        e = {"ITERS": "100000000", "JITTER_US": "50", **extra, **(per_rank or {}).get(r, {})}
        e.setdefault("JITCKPT_EVENT_LOG", str(tmp / f"events.{r}"))
        procs.append(job.spawn([str(st.PROGS / "ranks"), "train", str(r), str(nranks), str(tmp)], f"rank{r}", **e))
    return procs


@pytest.mark.parametrize(
    ("sig", "handles", "nranks"),
    [(signal.SIGKILL, "all", 3), (signal.SIGSTOP, "none", 4)],
    ids=["SIGKILL-3ranks", "SIGSTOP-4ranks"],
)
def test_dead_or_stopped_rank_makes_every_healthy_rank_report(
    tmp_path: Path, sig: signal.Signals, handles: str, nranks: int
) -> None:
    """Both handle modes: virtual handles everywhere, or physical ones with
    shadow records (the default)."""
    victim = 1
    with st.Job(tmp_path) as job:
        procs = _start(
            job, tmp_path, nranks, JITCKPT_TIMEOUT=str(TIMEOUT), JITCKPT_ON_HANG="exit", JITCKPT_VIRTUAL_HANDLES=handles
        )
        assert st.wait_for(lambda: all(st.progress(tmp_path, r) >= 200 for r in range(nranks)), 20), [
            job.output(f"rank{r}") for r in range(nranks)
        ]
        t_kill = time.time()
        os.kill(procs[victim].pid, sig)
        healthy = [r for r in range(nranks) if r != victim]
        for r in healthy:
            rc = procs[r].wait(timeout=TIMEOUT + 10)
            assert rc == 75, (r, rc, job.output(f"rank{r}"))
        for r in healthy:
            ev = st.events(tmp_path / f"events.{r}")
            assert len(ev) == 1, ev
            e = ev[0]
            assert e["event"] == "hang" and e["rank"] == r and e["collective"].startswith("nccl")
            assert e["waited_s"] >= TIMEOUT
            # Detected within timeout + 1 s of the failure.
            assert e["t"] - t_kill <= TIMEOUT + 1.0, (e, t_kill)
        assert procs[victim].poll() is None or sig == signal.SIGKILL
        # No event from the victim's shim (killed/stopped before any timeout).
        assert st.events(tmp_path / f"events.{victim}") == []


def test_injected_hang_is_reported_by_all_ranks_in_report_mode(tmp_path: Path) -> None:
    """JITSIM_HANG_AT: rank 1's 300th NCCL op never completes. Report mode
    logs one line per rank and leaves the processes running."""
    with st.Job(tmp_path) as job:
        procs = _start(job, tmp_path, 2, per_rank={1: {"JITSIM_HANG_AT": "300"}}, JITCKPT_TIMEOUT="1")
        assert st.wait_for(lambda: all(st.events(tmp_path / f"events.{r}") for r in range(2)), 15), [
            job.output(f"rank{r}") for r in range(2)
        ]
        time.sleep(0.3)
        for r in range(2):
            ev = st.events(tmp_path / f"events.{r}")
            assert [e["event"] for e in ev] == ["hang"] and ev[0]["on_hang"] == "report"
            assert procs[r].poll() is None  # report mode: still (hung) alive


def test_nccl_async_error_triggers_error_event(tmp_path: Path) -> None:
    """JITSIM_NCCL_ERROR_AT + ASYNC: rank 0's op ends without contributing and
    its communicator's async error becomes ncclRemoteError (6): rank 0 reports
    "error" from ncclCommGetAsyncError, rank 1 hangs on the missing peer."""
    with st.Job(tmp_path) as job:
        procs = _start(
            job,
            tmp_path,
            2,
            per_rank={0: {"JITSIM_NCCL_ERROR_AT": "200", "JITSIM_NCCL_ERROR_ASYNC": "1"}},
            JITCKPT_TIMEOUT=str(TIMEOUT),
            JITCKPT_ON_HANG="exit",
            PAUSE_ON_ERROR="1",
        )
        for r in range(2):
            assert procs[r].wait(timeout=15) == 75, job.output(f"rank{r}")
        e0 = st.events(tmp_path / "events.0")
        e1 = st.events(tmp_path / "events.1")
        assert e0[0]["event"] == "error" and e0[0]["code"] == 6 and e0[0]["source"] == "ncclCommGetAsyncError"
        assert e1[0]["event"] == "hang"


@pytest.mark.slow
def test_no_false_hang_in_10000_jittered_collectives(tmp_path: Path) -> None:
    """Adaptive timeout (JITCKPT_TIMEOUT unset, 1 s floor) and random host
    jitter before every collective: no event, all collectives completed."""
    with st.Job(tmp_path) as job:
        procs = _start(
            job,
            tmp_path,
            2,
            ITERS="8000",
            JITTER_US="400",
            SYNC_EVERY="4",
            JITCKPT_TIMEOUT_FLOOR="1",
            JITCKPT_POLL_MS="5",
            JITCKPT_ON_HANG="exit",
        )
        for r in range(2):
            assert procs[r].wait(timeout=55) == 0, job.output(f"rank{r}")
        for r in range(2):
            out = job.output(f"rank{r}")
            m = re.search(r"allreduce=(\d+) watched=(\d+) completed=(\d+) triggers=(\d+)", out)
            assert m, out
            allreduce, watched, completed, triggers = map(int, m.groups())
            assert allreduce == 10000 and triggers == 0
            # Own events alone are 10000 (one per outermost group / ungrouped
            # op); application events re-recorded before a poll go stale and
            # are dropped rather than completed. The last few may be unpolled.
            assert watched >= 10000 and completed >= 10000 - 8, out
            assert st.events(tmp_path / f"events.{r}") == []


def test_sticky_cuda_error_triggers_error_event(tmp_path: Path) -> None:
    """JITSIM_STICKY_ERROR_AT + ASYNC: a kernel faults on its stream
    (cudaErrorIllegalAddress, 700); the watchdog's event query returns it."""
    with st.Job(tmp_path) as job:
        procs = _start(
            job,
            tmp_path,
            2,
            per_rank={1: {"JITSIM_STICKY_ERROR_AT": "150", "JITSIM_STICKY_ASYNC": "1"}},
            JITCKPT_TIMEOUT="2",
            JITCKPT_ON_HANG="exit",
            PAUSE_ON_ERROR="1",
        )
        for r in range(2):
            assert procs[r].wait(timeout=15) == 75, job.output(f"rank{r}")
        e1 = st.events(tmp_path / "events.1")[0]
        assert e1["event"] == "error" and e1["code"] == 700 and e1["source"] == "cudaEventQuery"
        assert st.events(tmp_path / "events.0")[0]["event"] == "hang"  # its peer stopped contributing


def test_adaptive_timeout_follows_longest_collective(tmp_path: Path) -> None:
    """JITCKPT_TIMEOUT unset: timeout = max(floor, MULT x longest collective).
    Up to 150 ms of jitter before each collective makes the longest wait
    ~0.15 s, so the timeout rises above the 0.2 s floor; a killed rank is then
    reported within that timeout + 1 s."""
    with st.Job(tmp_path) as job:
        procs = _start(
            job,
            tmp_path,
            2,
            JITTER_US="150000",
            JITCKPT_TIMEOUT_FLOOR="0.2",
            JITCKPT_TIMEOUT_MULT="4",
            JITCKPT_ON_HANG="exit",
        )
        assert st.wait_for(lambda: all(st.progress(tmp_path, r) >= 0 for r in range(2)), 10)
        time.sleep(2.5)  # ~30 collectives
        t_kill = time.time()
        os.kill(procs[1].pid, signal.SIGKILL)
        assert procs[0].wait(timeout=15) == 75, job.output("rank0")
        e = st.events(tmp_path / "events.0")[0]
        assert e["event"] == "hang"
        assert 0.3 < e["timeout_s"] < 2.5, e  # derived from observed collectives, not the floor
        assert e["waited_s"] >= e["timeout_s"]
        assert e["t"] - t_kill <= e["timeout_s"] + 1.0


@pytest.mark.parametrize("fixed", [False, True], ids=["ceiling", "fixed"])
def test_timeout_is_a_ceiling_unless_fixed(tmp_path: Path, fixed: bool) -> None:
    """The rule jitrun sets (jitckpt/hang/bound.py, docs/hangs.md):
    JITCKPT_TIMEOUT caps the adaptive timeout max(floor, MULT x longest);
    with JITCKPT_TIMEOUT_FIXED=1 it is the timeout itself."""
    ceiling = 6.0
    with st.Job(tmp_path) as job:
        procs = _start(job, tmp_path, 2, JITCKPT_TIMEOUT=str(ceiling), JITCKPT_TIMEOUT_FIXED=str(int(fixed)),
                       JITCKPT_TIMEOUT_FLOOR="0.3", JITCKPT_TIMEOUT_MULT="4", JITCKPT_ON_HANG="exit")
        assert st.wait_for(lambda: all(st.progress(tmp_path, r) >= 200 for r in range(2)), 20)
        os.kill(procs[1].pid, signal.SIGKILL)
        assert procs[0].wait(timeout=ceiling + 10) == 75, job.output("rank0")
        e = st.events(tmp_path / "events.0")[0]
        assert e["event"] == "hang"
        if fixed:
            assert e["timeout_s"] == ceiling, e
        else:
            assert 0.3 <= e["timeout_s"] < ceiling, e  # learned from the fast collectives, under the ceiling


def test_abort_mode_unblocks_the_application(tmp_path: Path) -> None:
    """JITCKPT_ON_HANG=abort: after reporting, the shim aborts the
    communicators; the blocked calls return and the application sees an NCCL
    error instead of hanging forever."""
    with st.Job(tmp_path) as job:
        procs = _start(job, tmp_path, 2, JITCKPT_TIMEOUT="1", JITCKPT_ON_HANG="abort")
        assert st.wait_for(lambda: all(st.progress(tmp_path, r) >= 100 for r in range(2)), 20)
        os.kill(procs[1].pid, signal.SIGKILL)
        rc = procs[0].wait(timeout=10)
        assert rc == 3, job.output("rank0")  # the test program's exit code for a failed call
        assert re.search(r"-> [1-9]", job.output("rank0"))
        ev = st.events(tmp_path / "events.0")
        assert [e["event"] for e in ev] == ["hang"] and ev[0]["on_hang"] == "abort"
