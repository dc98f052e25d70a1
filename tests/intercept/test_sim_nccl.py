"""Stand-in NCCL (build/sim/libnccl.so.2) across processes: results, hangs, aborts, faults."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sim_progs"))
import simharness as H  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _build():
    H.build()


@pytest.fixture
def ranks(tmp_path):
    with H.Ranks(tmp_path) as r:
        yield r
    assert not H.shm_entries(r.job), "segments left behind"


def _hash(out: str) -> str:
    return re.search(r"allreduce_f32_hash (\w+)", out).group(1)


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_collectives_correct(ranks, nranks):
    """AllReduce (all ops, 6 dtypes, grouped and nested), Broadcast, Reduce, AllGather,
    ReduceScatter, Send/Recv; every rank checks its own results."""
    ranks.start("coll", nranks)
    outs = ranks.wait()
    assert all("PASS coll" in o for o in outs)
    assert len({_hash(o) for o in outs}) == 1, "ranks disagree bit-wise"
    # The segment name is unlinked as soon as every rank has mapped it.
    assert not H.shm_entries(ranks.job)


def test_allreduce_bit_identical_across_runs(tmp_path):
    hashes = []
    for i in range(2):
        d = tmp_path / f"run{i}"
        d.mkdir()
        with H.Ranks(d) as r:
            r.start("coll", 3)
            hashes += [_hash(o) for o in r.wait()]
    assert len(set(hashes)) == 1


def test_sigstopped_rank_blocks_peers_until_abort(ranks):
    """A SIGSTOPped rank: the peers' event after the collective stays cudaErrorNotReady (checked
    for 1.2 s) and a cudaMemcpy behind it on the legacy stream stays blocked; ncclCommAbort from
    another thread unblocks both."""
    procs = ranks.start("stop", 3)
    outs = ranks.wait(procs[:2])
    H.wait_stopped(procs[2].pid)
    for o in outs:
        assert "BLOCKED 1.2" in o and "UNBLOCKED" in o and "PASS stop" in o


def test_sigkilled_rank_blocks_peers_until_abort(ranks):
    procs = ranks.start("stop", 2)
    H.wait_stopped(procs[1].pid)
    procs[1].kill()
    procs[1].wait(5)
    out = ranks.wait(procs[:1])[0]
    assert "BLOCKED" in out and "PASS stop" in out


def test_dead_peer_error_opt_in(ranks):
    """JITSIM_DEAD_PEER_ERROR=1: once the stopped rank is SIGKILLed, the survivors' collective
    fails by itself with ncclRemoteError (socket-transport behaviour) instead of hanging."""
    procs = ranks.start("deadpeer", 3, lambda r: {"JITSIM_DEAD_PEER_ERROR": "1"})
    H.wait_stopped(procs[2].pid)
    time.sleep(0.5)
    procs[2].kill()
    procs[2].wait(5)
    for o in ranks.wait(procs[:2]):
        assert "REMOTE ERROR" in o and "is gone" in o and "PASS deadpeer" in o


def test_injected_hang(ranks):
    """JITSIM_HANG_AT=2 JITSIM_HANG_RANK=1 for the whole job: rank 1 never contributes to its
    2nd collective; every rank's stream blocks until it aborts."""
    ranks.start("hang", 3, lambda r: {"JITSIM_HANG_AT": "2", "JITSIM_HANG_RANK": "1"})
    for o in ranks.wait():
        assert "BLOCKED 1.2" in o and "PASS hang" in o


def test_injected_nccl_error_then_reinit(ranks):
    """JITSIM_NCCL_ERROR_AT=2 on rank 1: the call fails with ncclSystemError, the async error is
    ncclRemoteError; rank 0 hangs, both abort and re-initialize, and collectives work again."""
    ranks.start("ncclerr", 2, lambda r: {"JITSIM_NCCL_ERROR_AT": "2"} if r == 1 else None)
    o0, o1 = ranks.wait()
    assert "BLOCKED" in o0 and "REINIT OK" in o0
    assert "ERROR 2 ASYNC 6" in o1 and "REINIT OK" in o1


def test_injected_async_nccl_error_then_reinit(ranks):
    """JITSIM_NCCL_ERROR_ASYNC=1: the 2nd call succeeds, its stream work ends without contributing
    and the async error becomes ncclRemoteError; the peer hangs until abort; re-init works."""
    ranks.start(
        "ncclerr", 2, lambda r: {"JITSIM_NCCL_ERROR_AT": "2", "JITSIM_NCCL_ERROR_ASYNC": "1"} if r == 1 else None
    )
    o0, o1 = ranks.wait()
    assert "BLOCKED" in o0 and "REINIT OK" in o0
    assert "ASYNC ERROR 6" in o1 and "REINIT OK" in o1


def test_sticky_cuda_error_fails_nccl(ranks):
    ranks.start("sticky", 1, lambda r: {"JITSIM_STICKY_ERROR_AT": "1"})
    assert "PASS sticky" in ranks.wait()[0]


def test_nonblocking_init_and_split(ranks):
    ranks.start("nonblocking", 4)
    assert all("PASS nonblocking" in o for o in ranks.wait())


def test_cleanup_tool_removes_leftovers(tmp_path):
    """A job whose ranks never all joined leaves its segment (here: rank 1 never starts and rank 0
    is SIGKILLed while waiting in ncclCommInitRank); jitsim-cleanup --stale JOB removes it."""
    with H.Ranks(tmp_path) as r:
        (p0,) = r.start("coll", 2, only=[0])
        deadline = time.monotonic() + 10
        while not H.shm_entries(r.job) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = H.shm_entries(r.job)
        assert left, "rank 0 should have created the segment"
        dry = subprocess.run(
            [str(H.SIM / "jitsim-cleanup"), "--stale", r.job], capture_output=True, text=True, check=True
        ).stdout
        assert dry == "", "creator alive: --stale must keep it"
        p0.kill()
        p0.wait(5)
        out = subprocess.run(
            [str(H.SIM / "jitsim-cleanup"), "--stale", r.job], capture_output=True, text=True, check=True
        ).stdout
        assert out.split() == [f"/{e.name}" for e in left]
        assert not H.shm_entries(r.job)
