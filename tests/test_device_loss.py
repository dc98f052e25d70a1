"""A rank's device dies while its process lives (paper §4.3 with §4.2.2).

Three ranks of the stand-in data-parallel program (`dp`: compute and NCCL
streams, grouped gradient all-reduce, a grad-norm all-reduce and a momentum
update in the optimizer phase) run under the shim with
JITCKPT_ON_HANG=recover and JITCKPT_ON_DEVICE_LOSS=migrate, each as PID 1 of
its own PID namespace (the harness's MigratableProcs). One rank's device takes a
sticky error (JITSIM_STICKY_ERROR_AT: a kernel launch; JITSIM_STICKY_COLL_AT:
inside NCCL's kernel). The shim parks it; jitrun.migration.device_loss dumps it with
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
from netns import MigratableProcs

from jitrun.migration import device_loss

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


def run_with_lost_device(tmp: Path, fault: dict[str, str], lost: int, new_device: str = "GPU-spare-0",
                         refuse: str | None = None) -> dict:
    """Runs the job, serves the lost rank's move (or, with ``refuse``, tells it
    nobody will), returns outputs, exit codes, FINAL lines, final buffers,
    events and the move's numbers."""
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
                if refuse is not None:
                    device_loss.refuse(ctl, req, refuse)
                    res["moves"].append({"rank": req.rank, "refused": True})
                    continue
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
    # the refilled rank and its replica (the first healthy rank) agreed on the state bit for bit
    donor = min(set(range(NR)) - {lost})
    digests = {e["rank"]: e["state_digest"] for e in rec}
    assert digests[lost] and digests[lost] == digests[donor], digests
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


def test_a_refill_corrupted_on_the_way_is_caught_before_the_replay(criu_bin, subreaper, tmp_path: Path) -> None:
    """The lost rank's refill arrives with one bit flipped (the stand-in NCCL's
    JITSIM_FLIP_RECV_AT: its first receive is the refill's): the state digests of
    the refilled rank and its replica differ, so every rank falls back (exit 75)
    before a replayed call, the refilled rank naming both digests."""
    lost, fault = CASES["forward"]
    r = run_with_lost_device(tmp_path / "flip", {**fault, "JITSIM_FLIP_RECV_AT": "1"}, lost)
    assert r["rc"] == {i: 75 for i in range(NR)}, (r["rc"], r["out"])
    assert len(r["moves"]) == 1 and not r["final"]
    fb = {e["rank"]: e for e in r["events"] if e["event"] == "shim_recovery"}
    assert sorted(fb) == list(range(NR)) and all(e["outcome"] == "fallback" for e in fb.values()), fb
    assert "differs from replica 1's after the refill" in fb[lost]["reason"], fb[lost]
    assert fb[lost]["replayed"] == 0 and not fb[lost]["state_digest"], fb[lost]
    assert all("refilled rank's state differs" in fb[i]["reason"] for i in range(NR) if i != lost), fb


def test_a_refused_move_falls_back_everywhere_at_once(criu_bin, subreaper, tmp_path: Path) -> None:
    """Nobody can take the parked process ({"fallback": why}): it joins the epoch
    marked bad and every rank falls back (exit 75) within seconds, not at the
    60 s bound, the lost rank with the given reason."""
    t0 = time.monotonic()
    r = run_with_lost_device(tmp_path / "refused", CASES["forward"][1], 0, refuse="no spare device on node x")
    took = time.monotonic() - t0
    assert r["rc"] == {i: 75 for i in range(NR)}, (r["rc"], r["out"])
    assert r["moves"] == [{"rank": 0, "refused": True}]
    assert took < 30, f"the others waited for the bound ({took:.0f}s)"
    fb = {e["rank"]: e["reason"] for e in r["events"] if e["event"] == "shim_recovery"}
    assert fb[0] == "no spare device on node x", fb
    assert all("another rank" in fb[i] for i in (1, 2)), fb


def test_device_loss_requests_are_validated(tmp_path: Path) -> None:
    (tmp_path / "device-lost-1-1.json").write_text(json.dumps({"rank": 1}))
    with pytest.raises(ValueError, match="device-lost-1-1.json: not a device-lost request"):
        device_loss.pending(tmp_path)
    req = device_loss.Request(1, 5, 1, "GPU-a", tmp_path / "x")
    with pytest.raises(ValueError, match="under 64 characters"):
        device_loss.answer(tmp_path, req, 'bad"name')
    p = device_loss.answer(tmp_path, req, "GPU-b")
    assert json.loads(p.read_text())["uuid"] == "GPU-b" and p.stat().st_mode & 0o777 == 0o600


# -- under jitrun: the agent serves its own workers' requests ------------------------------

JITRUN = Path(sys.executable).parent / "jitrun"


def jitrun_dp(tmp: Path, per_rank: dict[int, dict[str, str]], nvml_devices: int, restarts: int = 0,
              extra: tuple[str, ...] = (), **env: str) -> dict:
    """The `dp` job under ``jitrun --no-python --jit-intercept on --jit-migratable on``
    on a node whose stand-in NVML counts ``nvml_devices`` devices (ranks use the
    first NR). Returns jitrun's exit code and output, each rank's output (the
    migratable workers write to <jit dir>/migrate/out/), FINAL lines, buffers, events."""
    if st.ASAN:
        pytest.skip("jitrun cannot preload the ASan shim")
    tmp.mkdir(parents=True)
    e = st.env(preload=False, leaks=False)
    e.update(JITCKPT_INTERCEPT_LIB=str(st.SHIM), JITCKPT_NVML_LIB=str(st.BUILD / "sim" / "libnvidia-ml.so.1"),
             JITSIM_NVML_DEVICES=str(nvml_devices), JITCKPT_RECOVER_TIMEOUT="60", JITCKPT_POLL_MS="20",
             DP_FAULTS_FIRST_ATTEMPT="1", **env)
    sets = " ".join(f'[ "$RANK" = {r} ] && export {" ".join(f"{k}={v}" for k, v in kv.items())};'
                    for r, kv in per_rank.items())
    prog = ["/bin/sh", "-c", f'{sets} exec "$@"', "sh", str(st.PROGS / "dp"), "-", "-", str(STEPS), str(tmp)]
    cmd = [str(JITRUN), "--nproc-per-node", str(NR), "--no-python", "--jit-intercept", "on",
           "--jit-migratable", "on", "--jit-timeout", "1", "--max-restarts", str(restarts),
           "--jit-dir", str(tmp / "jit"), *extra, *prog]
    with st.Job(tmp) as job:  # the stand-in NCCL's /dev/shm segments carry its tag: removed after
        e["JITSIM_JOB"] = job.tag
        p = subprocess.run(cmd, env=e, cwd=tmp, capture_output=True, text=True, timeout=180)
    res: dict = {"rc": p.returncode, "log": p.stdout + p.stderr, "out": {}, "final": {}, "buf": {}}
    outs = sorted((tmp / "jit").glob("**/migrate/out/rank*.log"))
    for r in range(NR):
        res["out"][r] = "".join(f.read_text() for f in outs if f.name.startswith(f"rank{r}."))
        for m in FINAL.finditer(res["out"][r]):
            res["final"][r] = {"pid": int(m.group(2)), "host": m.group(4), "recoveries": int(m.group(5)),
                               "device": m.group(7)}
        f = tmp / f"final.{r}"
        res["buf"][r] = f.read_bytes() if f.exists() else None
    ev = next((tmp / "jit").glob("**/events.jsonl"))
    res["events"] = [json.loads(x) for x in ev.read_text().splitlines() if x.strip()]
    return res


@pytest.mark.parametrize("case", ["forward", "optimizer"])
def test_jitrun_moves_a_lost_device_rank_to_a_spare_device(criu_bin, tmp_path: Path, case: str) -> None:
    """The node has a fourth, unused device: jitrun's agent sees the parked rank's
    request, the local scheduler hook names the spare, the agent moves the live
    process onto it with CRIU. No restart, no user code, bit-identical."""
    base = baseline(tmp_path)
    lost, fault = CASES[case]
    r = jitrun_dp(tmp_path / case, {lost: fault}, nvml_devices=NR + 1)
    assert r["rc"] == 0, r["log"]
    assert sorted(r["final"]) == list(range(NR)), r["out"]
    for i in range(NR):
        assert r["buf"][i] == base["buf"][i], f"rank {i}: device state differs from the failure-free run"
        assert r["final"][i]["host"] == base["final"][i]["host"]
        assert r["final"][i]["recoveries"] == 1
        assert r["out"][i].count("PID ") == 1, r["out"][i]  # start-up ran once, also for the moved rank
    ev = r["events"]
    assert not [e for e in ev if e["event"] == "restart"], "no process was restarted"
    moved = [e for e in ev if e["event"] == "device_moved"]
    assert [(e["rank"], e["old_device"]) for e in moved] == [(lost, "GPU-sim-0")], moved
    spare = moved[0]["device"]
    assert r["final"][lost]["device"] == spare and spare.startswith("GPU-")
    assert moved[0]["image_bytes"] > 0 and moved[0]["dump_s"] > 0 and moved[0]["restore_s"] > 0
    assert f"moved the live process to device {spare}" in r["log"]
    rec = [e for e in ev if e["event"] == "in_place_recovery"]
    assert len(rec) == 1 and rec[0]["outcome"] == "recovered", rec
    assert re.fullmatch(r"[0-9a-f]{16}", rec[0]["state_digest"] or ""), rec  # the refill was verified


def test_jitrun_without_a_spare_device_falls_back_at_once(criu_bin, tmp_path: Path) -> None:
    """Every device of the node is in use: the local hook answers restart, the
    agent tells the parked process so, every rank falls back to the restart path
    well before JITCKPT_RECOVER_TIMEOUT (60 s here), and the restarted job
    finishes bit-identical."""
    base = baseline(tmp_path)
    lost, fault = CASES["forward"]
    t0 = time.monotonic()
    r = jitrun_dp(tmp_path / "nospare", {lost: fault}, nvml_devices=NR, restarts=1)
    took = time.monotonic() - t0
    assert r["rc"] == 0, r["log"]
    assert all(r["buf"][i] == base["buf"][i] for i in range(NR))
    ev = r["events"]
    refused = [e for e in ev if e["event"] == "device_move_refused"]
    assert [e["rank"] for e in refused] == [lost] and "restart" in refused[0]["why"], refused
    assert not [e for e in ev if e["event"] == "device_moved"]
    assert [e for e in ev if e["event"] == "restart"], "the job restarted"
    assert took < 45, f"the fallback waited for the recovery bound ({took:.0f}s)"
    assert "is not moved" in r["log"]


@pytest.mark.parametrize("fault", ["kill-criu", "corrupt-image"])
def test_jitrun_failed_device_move_falls_back_to_a_restart(criu_bin, tmp_path: Path, fault: str) -> None:
    """The move itself breaks: criu SIGKILLed mid-dump (the process still runs,
    parked: the agent tells it to fall back) or an image corrupted (the dump ended
    the process; the restore's checksum check refuses the images). Either way the
    job restarts and finishes bit-identical, and the timeline says why."""
    base = baseline(tmp_path)
    lost, fault_env = CASES["allreduce"]
    r = jitrun_dp(tmp_path / fault, {lost: fault_env}, nvml_devices=NR + 1, restarts=1,
                  JITCKPT_TEST_MIGRATE_FAULT=fault)
    assert r["rc"] == 0, r["log"]
    assert all(r["buf"][i] == base["buf"][i] for i in range(NR))
    ev = r["events"]
    failed = [e for e in ev if e["event"] == "device_move_failed"]
    assert [e["rank"] for e in failed] == [lost], failed
    assert ("checksum" in failed[0]["error"] or "corrupt" in failed[0]["error"]) if fault == "corrupt-image" \
        else "dump" in failed[0]["error"], failed
    assert not [e for e in ev if e["event"] == "device_moved"]
    assert [e for e in ev if e["event"] == "restart"], "the job restarted"
    assert not list((tmp_path / fault / "jit" / "migrate" / "img").glob("*")), "images left on the node's tmpfs"


def test_jitrun_scheduler_hook_names_the_device(criu_bin, tmp_path: Path) -> None:
    """An exec hook gets the device_lost event (rank, lost device, spares) and
    answers which device to attach on which node."""
    base = baseline(tmp_path)
    hook = tmp_path / "hook.py"
    seen = tmp_path / "seen.json"
    hook.write_text(f"#!{sys.executable}\nimport json, sys\nf = json.load(sys.stdin)\n"
                    f"open({str(seen)!r}, 'w').write(json.dumps(f))\n"
                    "print(json.dumps({'action': 'migrate', 'to': f['node']['addr'], 'device': 'GPU-from-hook'}))\n")
    hook.chmod(0o755)
    lost, fault = CASES["allreduce"]
    r = jitrun_dp(tmp_path / "hook", {lost: fault}, nvml_devices=NR,
                  extra=("--jit-scheduler", f"exec:{hook}"))
    assert r["rc"] == 0, r["log"]
    assert all(r["buf"][i] == base["buf"][i] for i in range(NR))
    f = json.loads(seen.read_text())
    assert f["event"] == "device_lost" and f["rank"] == lost and f["device_uuid"] == "GPU-sim-0", f
    assert f["failed_devices"] == [str(lost)] and f["spare_devices"] == [], f
    assert r["final"][lost]["device"] == "GPU-from-hook"


# -- to another node: the parked process goes to a spare agent's node ----------------------


def test_lost_device_rank_moves_to_another_node(criu_bin, tmp_path: Path) -> None:
    """Two nodes (network namespaces, each agent's --jit-dir a private tmpfs) run
    one rank each; a third node runs a spare agent of the job. Rank 1's device
    dies in step 2's forward; the scheduler hook (exec) sends its process to the
    spare's node with a device there. Node 1's agent dumps it, ships the images
    and its open output file to node 2's agent, which restores it and hands it the
    device; it refills from rank 0 and the job finishes bit-identical, no process
    restarted. (The nodes share the host's /dev/shm: the stand-in NCCL's wire.)"""
    from netns import Cluster
    from test_multinode import BASE_ENV, PORT

    why = Cluster.unavailable()
    if why:
        pytest.skip(why)
    if st.ASAN:
        pytest.skip("jitrun cannot preload the ASan shim")
    nr = 2
    base = dpjob.run(tmp_path / "base2", nr, STEPS)
    assert all(c == 0 for c in base["rc"].values()), base["out"]
    out = tmp_path / "out"
    out.mkdir()
    gate = tmp_path / "go"
    seen = tmp_path / "seen.json"
    with Cluster(3, tag="dl") as c, st.Job(tmp_path / "shm") as shm:
        spare = c.nodes[2]
        hook = tmp_path / "hook.py"
        hook.write_text(f"#!{sys.executable}\nimport json, sys\nf = json.load(sys.stdin)\n"
                        f"open({str(seen)!r}, 'w').write(json.dumps(f))\n"
                        f"print(json.dumps({{'action': 'migrate', 'to': {spare.addr!r}, 'device': 'GPU-node2-1'}}))\n")
        hook.chmod(0o755)
        jit = str(c.dir / "jit")
        e = st.env(preload=False, leaks=False)
        e.update(BASE_ENV, JITCKPT_INTERCEPT_LIB=str(st.SHIM), JITSIM_JOB=shm.tag, JITCKPT_RECOVER_TIMEOUT="60",
                 JITCKPT_POLL_MS="20", DP_GATE=f"2:{gate}", DP_STEP_MS="1",
                 PYTHONPATH=str(Path(__file__).resolve().parent.parent))
        prog = ["/bin/sh", "-c", '[ "$RANK" = 1 ] && export JITSIM_STICKY_ERROR_AT=9; exec "$@"', "sh",
                str(st.PROGS / "dp"), "-", "-", str(STEPS), str(out)]
        procs = {}

        def logs() -> str:
            return "\n".join(f"===== {k}\n{p.output()[-3000:]}" for k, p in procs.items())

        for n in c.nodes:
            name = f"agent{n.index}"
            cmd = [sys.executable, "-m", "jitrun.cli", "--nnodes", "2", "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{c.nodes[0].addr}:{PORT}", "--rdzv-id", "dl",
                   "--rdzv-conf", "keep_alive_interval=2", "--max-restarts", "0", "--jit-timeout", "1",
                   "--jit-dir", jit, "--local-addr", n.addr, "--no-python", "--jit-intercept", "on",
                   "--jit-migratable", "on", "--jit-scheduler", f"exec:{hook}", *prog]
            keep = ((f"{jit}/events.jsonl", str(c.dir / f"events-{name}.jsonl")),
                    (f"{jit}/migrate/out", str(c.dir / f"out-{name}")))
            procs[name] = n.run(cmd, name=name, env=e, private_dirs=(jit,), keep=keep, shared_shm=True)
            deadline = time.monotonic() + 60
            while n.index == 1 and not all((out / f"progress.{r}").exists() for r in range(nr)):
                # the two training nodes form the rendezvous (and train) before the spare starts
                assert time.monotonic() < deadline, "the job never started\n" + logs()
                time.sleep(0.05)
        deadline = time.monotonic() + 60
        while not subprocess.run([*spare.exec_prefix(), "ss", "-Hltn", "src", spare.addr],
                                 capture_output=True, text=True).stdout.strip():
            # the spare agent's migration target listens on its node's address
            assert time.monotonic() < deadline, "the spare's agent never listened\n" + logs()
            time.sleep(0.05)
        gate.touch()
        codes = {k: p.wait(120) for k, p in procs.items() if k != "agent2"}
        assert codes == {"agent0": 0, "agent1": 0}, logs()
        assert procs["agent2"].wait(60) == 0, logs()  # ends with the job's rendezvous, with its outcome
        evs = {k: [json.loads(x) for x in (c.dir / f"events-{k}.jsonl").read_text().splitlines()] for k in procs}
        outs = {k: "".join(p.read_text() for p in sorted((c.dir / f"out-{k}").glob("rank*.log")))
                for k in procs if (c.dir / f"out-{k}").exists()}
    for r in range(nr):
        assert (out / f"final.{r}").read_bytes() == base["buf"][r], f"rank {r}: differs from the failure-free run"
    f = json.loads(seen.read_text())
    assert f["event"] == "device_lost" and f["rank"] == 1 and f["node"]["addr"] == c.nodes[1].addr, f
    moved = [e for e in evs["agent1"] if e["event"] == "device_moved"]
    assert [(e["rank"], e["to"], e["device"]) for e in moved] == [(1, spare.addr, "GPU-node2-1")], evs["agent1"]
    arrived = [e for e in evs["agent2"] if e["event"] == "migration_arrived"]
    assert [e["rank"] for e in arrived] == [1], evs["agent2"]
    exits = [e for e in evs["agent2"] if e["event"] == "worker_exit"]
    assert [(e["rank"], e["exitcode"]) for e in exits] == [(1, 0)], exits
    assert not [e for k in evs for e in evs[k] if e["event"] in ("restart", "failure_detected")]
    # the moved process ran its start-up once, on node 1, and finished on node 2 with the new device
    final = [m.groups() for m in FINAL.finditer(outs.get("agent2", ""))]
    assert [(g[0], g[6]) for g in final] == [("1", "GPU-node2-1")], outs
    assert outs["agent2"].count("PID ") == 1 and "FINAL" not in outs.get("agent1", ""), outs
