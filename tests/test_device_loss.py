"""A rank's device dies while its process lives (issue 13 item 4, paper §4.3 with §4.2.2).

Three ranks of the stand-in data-parallel program (`dp`: compute and NCCL
streams, grouped gradient all-reduce, a grad-norm all-reduce and a momentum
update in the optimizer phase) run under the shim with
JITCKPT_ON_HANG=recover and JITCKPT_ON_DEVICE_LOSS=migrate, each as PID 1 of
its own PID namespace (the harness's MigratableProcs). One rank's device takes a
sticky error (JITSIM_STICKY_ERROR_AT: a kernel launch; JITSIM_STICKY_COLL_AT:
inside NCCL's kernel). The shim parks it; jitrun.device_loss dumps it with
CRIU, restores it from the images and hands it a new device (nothing of the
old device memory survives: the stand-in maps a fresh arena, filled with
0xDB); the shim re-makes its allocations at their old addresses, refills them
from the lowest healthy rank over the re-created communicator and replays the minibatch (or,
for a fault in the optimizer step, takes the replicas' post-update state). The
other ranks wait in place. Every rank must finish bit-identical to a failure-free
run (device buffers and the losses the host saw), the healthy ranks in their
original processes, the moved one without re-running its start-up.

The stand-in's NCCL moves data through host shared memory, so the moved rank
is restored on this host; "another node" is modelled by the new device (its
identity, its memory), the move itself by a real CRIU dump and restore.
"""

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
from jitrun import device_loss
from netns import MigratableProcs

sys.path.insert(0, str(Path(__file__).parent / "intercept" / "shim_progs"))
import dpjob  # noqa: E402
import shimtest as st  # noqa: E402

pytest.importorskip("torch.distributed")

NR, STEPS = 3, 6
FINAL = re.compile(r"FINAL rank=(\d+) pid=(\d+) dev=(\w+) host=(\w+) recoveries=(\d+) triggers=(-?\d+) device=(\S+)")
_base: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _build() -> None:
    st.build()


def baseline(tmp: Path) -> dict:
    if not _base:
        r = dpjob.run(tmp / "base", NR, STEPS)
        assert all(c == 0 for c in r["rc"].values()), r["out"]
        _base.update(r)
    return _base


def run_with_lost_device(tmp: Path, fault: dict[str, str], lost: int, new_device: str = "GPU-spare-0") -> dict:
    """Runs the job, serves the lost rank's move, returns outputs, exit codes,
    FINAL lines, final buffers, events and the move's numbers."""
    tmp.mkdir(parents=True)
    ctl = tmp / "ctl"
    ctl.mkdir()
    store = dpjob.Store()
    events = tmp / "events.jsonl"
    procs = MigratableProcs()
    job = st.Job(tmp)
    res: dict = {"rc": {}, "out": {}, "final": {}, "buf": {}, "moves": []}
    try:
        starts, host_pid = {}, {}
        for r in range(NR):
            e = st.env(leaks=False, JITSIM_JOB=job.tag, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                       WORLD_SIZE=str(NR), RANK=str(r), LOCAL_RANK=str(r), JITCKPT_SHIM_EVENTS=str(events),
                       JITCKPT_ON_HANG="recover", JITCKPT_ON_DEVICE_LOSS="migrate", JITCKPT_DEVICE_DIR=str(ctl),
                       JITCKPT_TIMEOUT="1", JITCKPT_RECOVER_TIMEOUT="60", JITCKPT_POLL_MS="20",
                       JITSIM_DEVICE_UUID=f"GPU-node{r}-0", **(fault if r == lost else {}))
            starts[r], host_pid[r] = procs.start([str(st.PROGS / "dp"), str(r), str(NR), str(STEPS), str(tmp)],
                                                 output=tmp / f"out.{r}", env=e)
        waiters = dict(starts)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(p.poll() is None for p in waiters.values()):
            for req in device_loss.pending(ctl):
                assert req.rank == lost, req
                m = device_loss.move(req, host_pid[req.rank], tmp / f"images-{req.epoch}", new_device, ctl)
                procs.pids.append(m.pid)
                waiters[req.rank] = m.helper
                res["moves"].append({"rank": req.rank, "epoch": req.epoch, "dump_s": m.dump_s,
                                     "restore_s": m.restore_s, "image_bytes": m.image_bytes, "old": req.device})
            time.sleep(0.02)
        for r, p in waiters.items():
            try:
                res["rc"][r] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                res["rc"][r] = "timeout"
        for r in range(NR):
            out = (tmp / f"out.{r}").read_text() if (tmp / f"out.{r}").exists() else ""
            res["out"][r] = out
            m = FINAL.search(out)
            if m:
                res["final"][r] = {"dev": m.group(3), "host": m.group(4), "recoveries": int(m.group(5)),
                                   "device": m.group(7)}
            f = tmp / f"final.{r}"
            res["buf"][r] = f.read_bytes() if f.exists() else None
        res["events"] = st.events(events)
        res["host_pid"] = host_pid
    finally:
        procs.cleanup()
        for p in list(starts.values()) if "starts" in locals() else []:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        job.close()
        store.close()
    return res


CASES = {  # (the rank whose device dies, its fault)
    # kernel launches: 4 per step (forward, gradient, grad norm, update); NCCL ops: 2 per step.
    # Rank 0 also publishes the re-created communicator's id; the donor is then rank 1.
    "forward": (0, {"JITSIM_STICKY_ERROR_AT": "9"}),  # step 2's forward kernel
    "allreduce": (1, {"JITSIM_STICKY_COLL_AT": "5"}),  # inside step 2's gradient all-reduce
    # step 2's update kernel faults as it runs, after the norm all-reduce it follows on the stream (a
    # launch failing synchronously may leave that all-reduce undone: the replicas would then still be in
    # their optimizer step, the fallback case below)
    "optimizer": (2, {"JITSIM_STICKY_ERROR_AT": "12", "JITSIM_STICKY_ASYNC": "1"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lost_device_rank_moves_and_finishes_bit_identical(criu_bin, subreaper, tmp_path: Path, case: str) -> None:
    base = baseline(tmp_path)
    lost, fault = CASES[case]
    r = run_with_lost_device(tmp_path / case, fault, lost)
    assert r["rc"] == {i: 0 for i in range(NR)}, r["out"]
    assert len(r["moves"]) == 1 and r["moves"][0]["old"] == f"GPU-node{lost}-0", r["moves"]
    for i in range(NR):
        f = r["final"][i]
        assert r["buf"][i] == base["buf"][i], f"rank {i}: device state differs from the failure-free run"
        assert f["host"] == base["final"][i]["host"], f"rank {i}: the host saw other losses"
        assert f["recoveries"] == 1
        assert f["device"] == ("GPU-spare-0" if i == lost else f"GPU-node{i}-0")
        # start-up ran once: the moved process continued from its image
        assert r["out"][i].count("PID ") == 1, r["out"][i]
    gone = [e for e in r["events"] if e["event"] == "shim_device_lost"]
    assert [(e["rank"], e["device"]) for e in gone] == [(lost, f"GPU-node{lost}-0")]
    rec = [e for e in r["events"] if e["event"] == "shim_recovery"]
    assert sorted(e["rank"] for e in rec) == list(range(NR)), rec
    assert all(e["outcome"] == "recovered" and e["epoch"] == 1 for e in rec), rec
    mine = next(e for e in rec if e["rank"] == lost)
    if case == "optimizer":
        assert mine["replayed"] == 0  # took the replica's post-update state
    else:
        assert mine["replayed"] > 0
    # the others waited in place: same processes, alive until their own exit 0
    assert r["moves"][0]["image_bytes"] > 0 and r["moves"][0]["dump_s"] > 0


def test_device_lost_before_replicas_finish_the_optimizer_step_falls_back(criu_bin, subreaper, tmp_path: Path) -> None:
    """Rank 1 dies at step 2's grad-norm kernel: the others wait in the norm's
    all-reduce, inside their optimizer step, so no replica holds a minibatch
    boundary state. Every rank falls back (exit 75, the JIT checkpoint path)
    and none prints a result."""
    r = run_with_lost_device(tmp_path / "opt-early", {"JITSIM_STICKY_ERROR_AT": "11"}, 1)
    assert r["rc"] == {i: 75 for i in range(NR)}, (r["rc"], r["out"])
    assert not r["final"]
    fb = [e for e in r["events"] if e["event"] == "shim_recovery"]
    assert fb and all(e["outcome"] == "fallback" for e in fb), fb
    assert any("optimizer" in e["reason"] for e in fb), [e["reason"] for e in fb]


def test_device_loss_requests_are_validated(tmp_path: Path) -> None:
    (tmp_path / "device-lost-1-1.json").write_text(json.dumps({"rank": 1}))
    with pytest.raises(ValueError, match="device-lost-1-1.json: not a device-lost request"):
        device_loss.pending(tmp_path)
    req = device_loss.Request(1, 5, 1, "GPU-a", tmp_path / "x")
    with pytest.raises(ValueError, match="under 64 characters"):
        device_loss.answer(tmp_path, req, 'bad"name')
    p = device_loss.answer(tmp_path, req, "GPU-b")
    assert json.loads(p.read_text())["uuid"] == "GPU-b" and p.stat().st_mode & 0o777 == 0o600
