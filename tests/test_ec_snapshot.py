"""EC snapshots: the snapshot/commit protocol and the restore, on one machine.

Several real worker processes (gloo over a TCPStore, as under jitrun) stand for the ranks of several
nodes; each "node" has its own directory in place of /dev/shm (JITCKPT_EC_SHM), so losing a node is
deleting its directory. The workers run this file (``python tests/test_ec_snapshot.py snap|restore``).
Plus pure tests of the version choice, the job-wide source decision and the jitrun flags.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jitckpt.ec import files as ec_files  # noqa: E402
from jitckpt.ec import pack as ec_pack  # noqa: E402
from jitckpt.ec import snapshot as ec_snapshot  # noqa: E402
from jitckpt.listeners import Event  # noqa: E402
from jitckpt.wire import contract  # noqa: E402


def _content(rank: int, step: int) -> dict[str, bytes]:
    """What rank ``rank``'s save_fn writes at ``step`` (sizes not a multiple of k, a subdirectory)."""
    h = hashlib.sha256(f"{rank}/{step}".encode()).digest()
    return {"state.bin": h * (97 + 13 * rank + step), "sub/extra.txt": f"rank {rank} step {step}\n".encode()}


# -- worker processes ---------------------------------------------------------------------------------------


def _runtime():
    from jitckpt import api
    from jitckpt.runtime import Runtime
    from jitckpt.wire import config

    rt = Runtime(config.from_env())
    api._runtime = rt
    return rt


def worker_snap(steps: int, every: int) -> None:
    from jitckpt.runtime import Phase

    rt = _runtime()
    rank = rt.cfg.rank

    def save_fn(d: str) -> None:
        import jitckpt

        # JITCKPT_TEST_UNLABELLED: a save_fn that keeps its own step counter (never checkpoint_step())
        step = rt.steps_done if os.environ.get("JITCKPT_TEST_UNLABELLED") else jitckpt.checkpoint_step()
        for name, data in _content(rank, step).items():
            os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)

    rt.save_fn = save_fn
    os.environ[contract.EC_EVERY.name] = str(every)  # as jitrun --jit-ec-every passes it
    snap = ec_snapshot.install(rt)
    assert snap is not None and rt.listeners.has(Event.SNAPSHOT)
    for step in range(1, steps + 1):
        rt.steps_done = step
        rt.phase = Phase.POST
        t0 = time.monotonic()
        rt.on_collective()  # a minibatch start after an optimizer step: the runtime's hook point
        print(f"step {step}: hook {time.monotonic() - t0:.3f}s", file=sys.stderr, flush=True)
        # a deterministic test: wait for the version in flight (training itself never waits);
        # JITCKPT_TEST_NOWAIT exercises the "previous one still in flight" skip instead
        while not os.environ.get("JITCKPT_TEST_NOWAIT") and (snap.busy.is_set() or not snap._q.empty()):
            time.sleep(0.01)
        time.sleep(0.01)
    snap.drain(60)
    print(json.dumps({"rank": rank, "committed": snap.committed, "disabled": snap.disabled}), flush=True)


def worker_restore() -> None:
    from jitckpt import api
    from jitckpt.wire import layout

    rt = _runtime()
    rt.shard = "0"
    path = api.get_checkpoint_path()
    out = {"rank": rt.cfg.rank, "path": path, "loaded": rt.loaded}
    if path is not None:
        rep = layout.verify(Path(path), rt.cfg.job_id)
        out["verified"] = not isinstance(rep, str)
        out["manifest_source"] = json.loads((Path(path) / layout.MANIFEST).read_text()).get("source")
        out["files"] = {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
                        for p in sorted(Path(path).rglob("*")) if p.is_file() and p.name != layout.MANIFEST}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    import traceback

    code = 0
    try:
        if sys.argv[1] == "snap":
            worker_snap(int(sys.argv[2]), int(sys.argv[3]))
        else:
            worker_restore()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no ProcessGroupGloo destructor at exit (see jitckpt._bootstrap)


# -- test harness -------------------------------------------------------------------------------------------

import pytest  # noqa: E402

JOB = "ectest"


@pytest.fixture
def cluster(tmp_path):
    """A TCPStore master (the agent's store) and per-node directories standing for /dev/shm."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    c = {"store": store, "port": store.port, "tmp": tmp_path}
    yield c
    shutil.rmtree(tmp_path, ignore_errors=True)


def node_dir(c, n: int) -> Path:
    return c["tmp"] / f"node{n}"


def run_ranks(c, mode: str, node_of: list[int], *, attempt: int, args: list[str] = (), env: dict | None = None,
              timeout: float = 120) -> list[dict]:
    """Start one process per rank (rank r on node node_of[r]) and return their JSON lines, by rank."""
    world = len(node_of)
    procs = []
    for r, n in enumerate(node_of):
        local = node_of[:r].count(n)
        e = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "GROUP_RANK": str(n), "LOCAL_RANK": str(local),
             "LOCAL_WORLD_SIZE": str(node_of.count(n)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(c["port"]),
             "JITCKPT_DIR": str(c["tmp"] / f"jit{n}"), "JITCKPT_JOB_ID": JOB, "JITCKPT_TOKEN": "t" * 32,
             "JITCKPT_ATTEMPT": str(attempt), "JITCKPT_EC_SHM": str(node_dir(c, n)), "OMP_NUM_THREADS": "1",
             "JITCKPT_TIMEOUT": "20", "PYTHONPATH": str(ROOT), **(env or {})}
        os.makedirs(e["JITCKPT_DIR"], exist_ok=True, mode=0o700)
        os.makedirs(node_dir(c, n), exist_ok=True, mode=0o700)
        procs.append(subprocess.Popen([sys.executable, __file__, mode, *args], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{mode} workers did not finish in {timeout}s")
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert p.returncode == 0 and lines, f"rc {p.returncode}\n{out}\n{err[-3000:]}"
        if os.environ.get("JITCKPT_TEST_VERBOSE"):
            print(err)
        outs.append((json.loads(lines[-1]), err))
    return [o for o, _ in outs], [e for _, e in outs]


def expected_files(rank: int, step: int) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in _content(rank, step).items()}


def scan(c, nodes) -> list[dict]:
    return [ec_files.scan_node(JOB, node_dir(c, n)) for n in nodes]


def test_snapshot_commit_place_and_restore_after_node_loss(cluster):
    c = cluster
    # 3 nodes x 1 rank, 2+1 (the default for 3 nodes); snapshots at steps 2, 4, 6
    res, _ = run_ranks(c, "snap", [0, 1, 2], attempt=0, args=["6", "2"])
    assert [r["committed"] for r in res] == [6, 6, 6] and not any(r["disabled"] for r in res), res
    invs = scan(c, [0, 1, 2])
    for n, inv in enumerate(invs):
        # two versions at most; after 6 committed everywhere only 6 is left
        assert {rec["step"] for rec in inv["commits"]} == {6}, inv
        assert {ch[0] for ch in inv["chunks"]} == {6}
        # one chunk of every rank's stripe per node: any one node loss leaves k=2 of 3
        assert sorted(ch[1] for ch in inv["chunks"]) == [0, 1, 2], (n, inv)
        for p in node_dir(c, n).rglob("*"):
            assert (p.stat().st_mode & 0o777) == (0o700 if p.is_dir() else 0o600), p
    # staging is cleaned up
    assert not [p for n in range(3) for p in node_dir(c, n).glob("*/stage/*")]
    ver, why = ec_files.choose_version(invs, 3)
    assert ver and ver["step"] == 6 and (ver["k"], ver["m"]) == (2, 1), why
    # node 1 lost (its memory gone); a replacement node 3 comes up empty; ranks renumbered across nodes
    shutil.rmtree(node_dir(c, 1))
    ver, why = ec_files.choose_version(scan(c, [0, 2, 3]), 3)
    assert ver and ver["step"] == 6, why
    res, errs = run_ranks(c, "restore", [3, 0, 2], attempt=1,
                          env={"JITCKPT_RESTORE_SOURCE": "ec", "JITCKPT_RESTORE_STEP": "6",
                               "JITCKPT_EC_FALLBACK_STEP": "none"})
    for r, out in enumerate(res):
        assert out["loaded"] == 6 and out["verified"] and out["manifest_source"] == "ec", (out, errs[r][-2000:])
        assert out["files"] == expected_files(r, 6), out


def test_unlabelled_snapshot_at_a_post_step_collective_is_dropped(cluster):
    """A collective after an optimizer step may be a barrier after the loop, where a save_fn's own step
    counter can name the minibatch just done: without checkpoint_step() the snapshot is not kept."""
    res, errs = run_ranks(cluster, "snap", [0, 1], attempt=0, args=["2", "2"], env={"JITCKPT_TEST_UNLABELLED": "1"})
    assert [r["committed"] for r in res] == [None, None], res
    assert all("step label cannot be trusted" in e for e in errs), errs[0][-2000:]
    assert scan(cluster, [0, 1]) == [{"chunks": [], "commits": []}] * 2


def test_two_nodes_lost_falls_back_loudly_and_never_decodes(cluster):
    c = cluster
    res, _ = run_ranks(c, "snap", [0, 1, 2], attempt=0, args=["4", "2"])
    assert [r["committed"] for r in res] == [4, 4, 4]
    shutil.rmtree(node_dir(c, 0))
    shutil.rmtree(node_dir(c, 1))
    ver, why = ec_files.choose_version(scan(c, [2]), 3)
    assert ver is None and any("not decodable" in w and "1 of the 2 chunks" in w for w in why), why
    # even if told to (a stale decision), the ranks refuse together and take the fallback: a fresh start
    res, errs = run_ranks(c, "restore", [2, 3, 4], attempt=1,
                          env={"JITCKPT_RESTORE_SOURCE": "ec", "JITCKPT_RESTORE_STEP": "4",
                               "JITCKPT_EC_FALLBACK_STEP": "none"})
    assert all(o["path"] is None for o in res), res
    assert all("FRESH START" in e for e in errs), errs[0][-2000:]


def test_corrupt_chunk_is_counted_lost_not_decoded(cluster):
    c = cluster
    run_ranks(c, "snap", [0, 1, 2], attempt=0, args=["2", "2"])
    # corrupt rank 0's chunk on node 2 (payload byte): checksum catches it, the other two decode
    name = ec_pack.chunk_name(ec_pack.ChunkTag(JOB, 2, 0, 0, 0, 1, 0, 0))
    victims = [p for n in range(3) for p in ec_files.ec_dir(JOB, node_dir(c, n)).glob(name.replace(".c0.", ".c*."))]
    assert len(victims) == 3
    bad = next(p for p in victims if p.parent.parent.parent == node_dir(c, 2))
    raw = bytearray(bad.read_bytes())
    raw[ec_pack.CHUNK_HEADER_SIZE + 5] ^= 0xFF
    bad.write_bytes(raw)
    res, errs = run_ranks(c, "restore", [0, 1, 2], attempt=1,
                          env={"JITCKPT_RESTORE_SOURCE": "ec", "JITCKPT_RESTORE_STEP": "2"})
    assert res[0]["files"] == expected_files(0, 2), res[0]
    assert "checksum mismatch" in errs[0] and "counted as lost" in errs[0], errs[0][-2000:]
    # a second loss of that stripe (node 1 gone): fewer than k valid chunks -> every rank falls back together
    for r in range(3):
        shutil.rmtree(c["tmp"] / f"jit{r}", ignore_errors=True)
    shutil.rmtree(node_dir(c, 1))
    res, errs = run_ranks(c, "restore", [0, 3, 2], attempt=2,
                          env={"JITCKPT_RESTORE_SOURCE": "ec", "JITCKPT_RESTORE_STEP": "2",
                               "JITCKPT_EC_FALLBACK_STEP": "none"})
    assert all(o["path"] is None for o in res), res
    assert "1 valid chunk(s) of rank 0's stripe survive, 2 needed" in errs[0], errs[0][-2000:]


def test_two_ranks_per_node_spread_and_restore(cluster):
    c = cluster
    # 2 nodes x 2 ranks, 1+1: each stripe's 2 chunks on the 2 nodes; receivers spread over a node's ranks
    res, _ = run_ranks(c, "snap", [0, 0, 1, 1], attempt=0, args=["3", "3"],
                       env={"JITCKPT_EC_CODE": "1+1"})
    assert [r["committed"] for r in res] == [3] * 4, res
    invs = scan(c, [0, 1])
    for inv in invs:
        assert sorted(ch[1] for ch in inv["chunks"]) == [0, 1, 2, 3]
    shutil.rmtree(node_dir(c, 0))
    res, _ = run_ranks(c, "restore", [1, 1, 2, 2], attempt=1,
                       env={"JITCKPT_RESTORE_SOURCE": "ec", "JITCKPT_RESTORE_STEP": "3"})
    for r, out in enumerate(res):
        assert out["files"] == expected_files(r, 3), out


# -- pure logic -------------------------------------------------------------------------------------------------


def _inv(chunks, commits):
    return {"chunks": chunks, "commits": commits}


def _rec(step, k=2, m=1, world=2, csize=10):
    return {"job": JOB, "step": step, "k": k, "m": m, "world_size": world,
            "stripes": {str(r): {"size": 2 * csize, "csize": csize, "shard": "0"} for r in range(world)}}


def _ch(step, rank, index, csize=10):
    return [step, rank, 0, index, ec_pack.CHUNK_HEADER_SIZE + csize]


def test_choose_version_newest_decodable():
    # step 8 committed but rank 1's stripe has only one chunk left; step 4 complete
    invs = [_inv([_ch(8, 0, 0), _ch(8, 0, 1), _ch(8, 1, 0), _ch(4, 0, 0), _ch(4, 1, 0)], [_rec(8)]),
            _inv([_ch(4, 0, 1), _ch(4, 1, 2)], [_rec(4)])]
    ver, why = ec_files.choose_version(invs, 2)
    assert ver["step"] == 4 and "EC step 8" in why[0] and "rank 1: 1 of the 2" in why[0], why
    # a chunk of the wrong size (another encode) does not count
    invs[1]["chunks"][0][4] += 1
    assert ec_files.choose_version(invs, 2)[0] is None
    # an uncommitted version is never chosen, however complete
    assert ec_files.choose_version([_inv([_ch(9, 0, 0), _ch(9, 0, 1)], [])], 1)[0] is None
    # world size changed since the snapshot
    ver, why = ec_files.choose_version([_inv([_ch(4, 0, 0), _ch(4, 0, 1)] * 2, [_rec(4, world=2)])], 3)
    assert ver is None and "2 ranks" in why[0]


def test_scan_node_ignores_other_jobs_and_junk(tmp_path):
    d = ec_files.ec_dir(JOB, tmp_path)
    ec_pack.write_chunk(d, ec_pack.ChunkTag(JOB, 3, 0, 0, 1, 2, 1, 20), b"x" * 10)
    ec_pack.write_chunk(ec_files.ec_dir("other", tmp_path), ec_pack.ChunkTag("other", 3, 0, 0, 0, 2, 1, 20),
                        b"y" * 10)
    (d / f"{JOB}.s3.r0.commit.json").write_text(json.dumps(_rec(3)))
    (d / f"{JOB}.s5.r0.commit.json").write_text("{not json")
    (d / "junk").write_text("x")
    inv = ec_files.scan_node(JOB, tmp_path)
    assert inv["chunks"] == [[3, 0, 0, 1, ec_pack.CHUNK_HEADER_SIZE + 10]]
    assert [r["step"] for r in inv["commits"]] == [3]
    assert ec_files.scan_node("nothing-here", tmp_path) == {"chunks": [], "commits": []}


def test_parse_code():
    assert ec_snapshot.parse_code("auto") is None and ec_snapshot.parse_code(None) is None
    assert ec_snapshot.parse_code("2+1") == (2, 1) and ec_snapshot.parse_code(" 8 + 3 ") == (8, 3)
    for bad in ("2", "0+1", "2-1", "200+100", "a+b"):
        with pytest.raises(ValueError):
            ec_snapshot.parse_code(bad)


def _decide(replica_steps, ec_invs, world=2):
    from jitrun import decision

    invs = [{"node_id": f"n{i}", "host": "h", "addr": f"a{i}",
             "replicas": [{"step": s, "shard": "0", "rank": 0, "saved_at": 0.0, "manifest_sha256": "x"}
                          for s in (replica_steps if i == 0 else [])],
             "finished": [], "ec": e} for i, e in enumerate(ec_invs)]
    return decision.compute(1, invs, {str(r): "0" for r in range(world)}, [], decided_by="n0")


def test_decision_order_replica_ec_persistent_fresh():
    from jitrun import decision

    ec4 = [_inv([_ch(4, 0, 0), _ch(4, 1, 0)], [_rec(4)]), _inv([_ch(4, 0, 1), _ch(4, 1, 1)], [])]
    # a replica at the failure's step beats an older EC version
    d = _decide([6], ec4)
    assert (d.source, d.step, d.ec_step) == ("replica", 6, None)
    assert "not newer than replica step 6" in decision.source_event(d)["not_used"][0]
    # no replica newer: EC; the older persistent replica stays the workers' fallback
    d = _decide([2], ec4)
    assert (d.source, d.step, d.ec_step) == ("ec", 2, 4), d
    env = {}
    decision.plan_of(d).to_env(env)
    assert env == {"JITCKPT_RESTORE_STEP": "4", "JITCKPT_RESTORE_SOURCE": "ec", "JITCKPT_EC_FALLBACK_STEP": "2"}
    ev = decision.source_event(d, progress=6)
    assert ev["source"] == "ec" and ev["step"] == 4 and ev["minibatches_lost"] == 3 and ev["not_used"], ev
    assert "erasure-coded snapshot of step 4" in decision.source_line(d, 6)
    # a decision round-trips through the store's JSON
    assert decision.Decision.from_json(d.to_json()).ec_step == 4
    # EC not decodable (a node's chunks gone): the persistent replica
    d = _decide([2], ec4[:1])
    assert (d.source, d.step) == ("replica", 2) and "not decodable" in decision.source_event(d)["not_used"][0]
    # nothing at all: a fresh start, said loudly
    d = _decide([], ec4[:1])
    assert d.source == "fresh" and d.step is None
    assert "RESTARTS FROM SCRATCH" in decision.source_line(d) and "not decodable" in decision.source_line(d)
    env = {"JITCKPT_RESTORE_SOURCE": "ec", "JITCKPT_EC_FALLBACK_STEP": "2"}
    decision.plan_of(d).to_env(env)
    assert env == {"JITCKPT_RESTORE_STEP": "none"}  # the EC variables cleared, the fresh start said
    # EC off (no "ec" in any inventory, --jit-ec-every 0): the replica decision, untouched
    d = _decide([2], [None, None])
    assert (d.source, d.step, d.ec_step, d.ec) == ("replica", 2, None, None)


def test_inventory_lists_ec_only_when_enabled(tmp_path, monkeypatch):
    from jitrun import decision

    monkeypatch.setenv(contract.EC_SHM.name, str(tmp_path))
    ec_pack.write_chunk(ec_files.ec_dir(JOB, tmp_path), ec_pack.ChunkTag(JOB, 3, 0, 0, 1, 2, 1, 20), b"x" * 10)
    node = decision.NodeInfo("n", "h", "a")
    monkeypatch.setenv(contract.EC_EVERY.name, "0")
    assert "ec" not in decision.inventory(tmp_path / "jit", JOB, node)
    monkeypatch.setenv(contract.EC_EVERY.name, "4")
    assert decision.inventory(tmp_path / "jit", JOB, node)["ec"]["chunks"][0][:4] == [3, 0, 0, 1]


def test_default_off_installs_nothing(monkeypatch):
    from jitckpt.runtime import Runtime
    from jitckpt.wire import config

    monkeypatch.setenv("JITCKPT_DIR", "/nonexistent")
    monkeypatch.setenv("JITCKPT_TOKEN", "t")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    rt = Runtime(config.from_env())
    for every in ("", "0"):
        monkeypatch.setenv("JITCKPT_EC_EVERY", every)
        assert ec_snapshot.install(rt) is None and not rt.listeners.has(Event.SNAPSHOT)


@pytest.mark.parametrize("argv,msg", [
    (["--jit-ec-every", "-1"], "--jit-ec-every -1: expected a number of minibatches >= 0"),
    (["--jit-ec-every", "5", "--jit-ec-code", "2-1"], "--jit-ec-code: EC code '2-1': expected K+M"),
    (["--jit-ec-every", "5", "--jit-ec-code", "4+1", "--nnodes", "3"], "survives no node loss"),
])
def test_cli_rejects_bad_ec_flags(tmp_path, argv, msg):
    cmd = [sys.executable, "-m", "jitrun.cli", "--jit-dir", str(tmp_path / "jit"), *argv,
           str(ROOT / "scripts" / "demo_train.py")]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert cp.returncode == 2, cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], cp.stderr
    assert not (tmp_path / "jit").exists(), "a rejected command creates nothing"
