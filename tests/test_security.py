"""Attacks on a job's store and peers, each against the real parts (README: Threat model).

The attacker reaches torch's TCPStore (it has no authentication and lists its keys) but has no
job token; where a test gives the attacker the token it plays a compromised peer of the job, which
must still not get a write outside the receiver's directory. Stores are real TCPStores on
loopback; jobs are real jitrun jobs; every job's final state is compared bit for bit with a
failure-free torchrun run, or the job must stop with a clear line.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import TRAIN, assert_same_state, run_tree
from conftest import store_client as client

from jitckpt import migrate_worker
from jitckpt.ec import files as ec_files
from jitckpt.verify import consistency
from jitckpt.wire import auth, contract, layout
from jitckpt.wire.report import Reporter, ReportReader
from jitrun import decide, decision
from jitrun.events import EventLog
from jitrun.migration import agents as migrate_agent
from jitrun.migration import control as migrate
from jitrun.peers import stream, transfer

TOKEN = "sec-test-token-0123456789abcdef"




def tree(root: Path, skip: Path | None = None) -> set[str]:
    """Every path under ``root`` (not under ``skip``)."""
    out = set()
    for dirpath, dirs, files in os.walk(root):
        if skip is not None and Path(dirpath).is_relative_to(skip):
            continue
        out.update(os.path.join(dirpath, n) for n in dirs + files)
    return out


def outside(base: Path, before: set[str], *inside: Path) -> set[str]:
    """What appeared under ``base`` since ``before``, other than the ``inside`` dirs and their contents."""
    return tree(base) - before - {str(p) for p in inside}.union(*(tree(p) for p in inside))


def forged(value: object, key: str = "x") -> bytes:
    """What an attacker without the token can write: a record sealed under a token of its own."""
    return auth.Auth("attacker-guess-0123456789").seal(key, value)


# -- the token ---------------------------------------------------------------------------------


def test_token_never_in_key_names_or_values(store):
    c = client(store)
    Reporter(c, TOKEN, 0).send("registered", shard="0", token_echo="no")
    coord = decide.Coordinator(c, TOKEN, decision.NodeInfo("n0", "h", "127.0.0.1"))
    coord.announce(0, 0)
    coord.handling(0)
    transfer.send_failed(c, TOKEN, "tid", "why")
    for k in store.list_keys():
        assert TOKEN not in k
        assert TOKEN.encode() not in store.get(k)


@pytest.mark.parametrize("token,why", [("tökentökentökentöken", "printable ASCII"), ("short", "at least 16"),
                                       ("with space 0123456789", "printable ASCII")])
def test_bad_token_refused_cleanly(tmp_path, token, why):
    cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "--standalone", "--jit-dir", str(tmp_path / "jit"),
                         str(TRAIN)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                        env={**os.environ, "JITCKPT_TOKEN": token})
    assert cp.returncode == 2, cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and why in lines[0] and "JITCKPT_TOKEN" in lines[0], cp.stderr
    assert not (tmp_path / "jit").exists()
    # nor does a non-ASCII MAC in a stream header make the check raise
    assert not auth.of(TOKEN).check_mac("stream/x", {"a": 1}, "é" * 64)


def test_multi_node_without_token_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JITCKPT_TOKEN"}
    cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "--nnodes", "2", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", "127.0.0.1:1", "--jit-dir", str(tmp_path / "jit"), str(TRAIN)],
                        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert cp.returncode == 2 and "needs JITCKPT_TOKEN" in cp.stderr, cp.stderr
    assert not (tmp_path / "jit").exists()


# -- forged steering records -------------------------------------------------------------------


def test_forged_and_malformed_reports_are_skipped(store, rejected):
    c = client(store)
    a = auth.of(TOKEN)
    reader = ReportReader(store, TOKEN)
    w = Reporter(c, TOKEN, 1)
    w.send("started")
    # slots an attacker fills after seeing them: garbage, a record sealed under another token,
    # a record of ours replayed from another slot, and a token holder's malformed report
    for value in (b"garbage", forged({"event": "failure_detected", "t": 0.0, "rank": 0}, a.key("r", 2))):
        slot = c.add(a.key("n"), 1)
        c.set(a.key("r", slot), value)
    slot = c.add(a.key("n"), 1)
    c.set(a.key("r", slot), c.get(a.key("r", 1)))
    a.put(c, {"event": "checkpoint_saved", "t": 0.0, "rank": 0, "step": "999"}, "r", c.add(a.key("n"), 1))
    w.send("finished")
    assert [m["event"] for m in reader.poll()] == ["started", "finished"]
    whys = [why for _, why in rejected]
    assert len(whys) == 4 and "not JSON" in whys[0] and "MAC" in whys[1] and "MAC" in whys[2], rejected
    assert "malformed" in whys[3]


def test_forged_failure_mark_and_decision_are_ignored_or_stop(store, rejected):
    c = client(store)
    coord = decide.Coordinator(c, TOKEN, decision.NodeInfo("n0", "h", "127.0.0.1"))
    # the keys of the old layout: the attacker had read the token off the store
    for k in ("round/0/failed", "round/0/decision", "decision"):
        c.set(f"jitckpt/{TOKEN}/{k}", json.dumps({"round": 0, "step": 999, "decided_by": "evil-node"}))
    assert not coord.failed(0) and coord.latest() is None and coord.decided(0) is None
    # an attacker who saw the new keys appear and overwrites them
    a = auth.of(TOKEN)
    c.set(a.key("round", 0, "failed"), forged("evil-node"))
    assert not coord.failed(0)
    good = decision.compute(0, [], {"0": "0"}, [], decided_by="n0")
    evil = {**json.loads(good.to_json()), "step": 999, "decided_by": "evil-node"}
    c.set(a.key("round", 0, "decision"), forged(evil, a.key("round", 0, "decision")))
    with pytest.raises(decision.DecisionTampered, match="does not verify under the job token"):
        coord.publish(good)  # first writer wins: the forged one is there first, and refused
    # a token holder's decision with an extra key (it raised in the agent's main thread before)
    a.put(c, {**evil, "extra": 1}, "decision")
    with pytest.raises(decision.DecisionTampered):
        coord.latest()
    assert any("unexpected key" in why for _, why in rejected), rejected


def test_forged_migration_request_is_ignored(store, rejected):
    c = client(store)
    watch = migrate_worker.Watch(c, TOKEN)
    gen = c.add(migrate.key(TOKEN, "gen"), 1)
    c.set(migrate.key(TOKEN, gen, "req"), forged({"ranks": [0], "to": "10.6.6.6", "t": 0.0}))
    assert watch.poll(5) is None and migrate.read_request(c, TOKEN, gen) is None
    gen = c.add(migrate.key(TOKEN, "gen"), 1)
    c.set(migrate.key(TOKEN, gen, "req"), json.dumps({"ranks": [0], "to": "10.6.6.6", "t": 0.0}))
    assert watch.poll(6) is None
    # a real request still works afterwards: every rank pauses at the next minibatch start
    gen = migrate.request(c, TOKEN, [0], "127.0.0.1")
    assert watch.poll(7) is None
    got = watch.poll(8)
    assert got is not None and got[0] == gen and got[1]["ranks"] == [0] and got[1]["to"] == "127.0.0.1"
    assert len(rejected) == 2, rejected


def test_migration_goes_only_to_an_agent_of_the_job(store, tmp_path):
    c = client(store)
    # an attacker announces a listener of its own for an address of its choosing
    evil = socket.create_server(("127.0.0.1", 0))
    c.set(migrate_agent.mig(TOKEN).key("to", "127.0.0.1", "port"), json.dumps({"port": evil.getsockname()[1]}))
    images = tmp_path / "img"
    images.mkdir()
    (images / "jitckpt-manifest.json").write_text("{}")
    with pytest.raises(migrate_agent.MigrationError, match="no jitrun agent of this job"):
        migrate_agent.ship(c, TOKEN, images, None, "127.0.0.1", {"rank": 0})
    evil.settimeout(0.5)
    with pytest.raises(TimeoutError):
        evil.accept()  # nothing of the rank (or the token) went there
    evil.close()


def test_forged_loaded_record_stops_the_worker(store):
    c = client(store)
    a = auth.of(TOKEN)
    c.set(a.key("loaded", 0, 1), forged({"value": 999}))
    with pytest.raises(consistency.StateTampered, match="does not verify"):
        consistency.check_loaded(c, TOKEN, 0, 0, 2, 5, timeout_s=10)


# -- the replica transfer: a compromised peer -----------------------------------------------------


def _evil_replica_server(store, answer) -> threading.Thread:
    """A peer holding the token that answers the first request to node EVIL with ``answer(c, tid)``
    (on a connection of its own: a TCPStore client runs one call at a time)."""
    a = auth.of(TOKEN)
    c = client(store)

    def run():
        key = a.key("xfer", "req", "EVIL", 1)
        c.wait([key], timedelta(seconds=30))
        req = a.unseal(key, c.get(key))[0]
        answer(c, req["id"])

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/escaped-abs", "abs/escaped", "ok/../../escaped",
                                  "1TB"])
def test_replica_transfer_refuses_names_outside_and_huge_sizes(store, tmp_path, name):
    c = client(store)
    a = auth.of(TOKEN)
    root = tmp_path / "jit"
    manifest = json.dumps({"files": {name: {"size": 5, "sha256": "0" * 64}}}).encode()
    files = [["MANIFEST.json", len(manifest)], ["big" if name == "1TB" else name, 10 ** 12 if name == "1TB" else 5]]

    def answer(c, tid):
        a.put(c, {"ok": True, "files": files}, "xfer", "data", tid, "meta")
        c.set(a.key("xfer", "data", tid, "c", 0), manifest)
        c.set(a.key("xfer", "data", tid, "c", 1), b"pwned")

    before = tree(tmp_path)
    th = _evil_replica_server(store, answer)
    import hashlib

    src = {"node_id": "EVIL", "rank": 0, "manifest_sha256": hashlib.sha256(manifest).hexdigest()}
    with pytest.raises(transfer.TransferError):
        transfer.fetch(c, TOKEN, source=src, step=3, shard="0", root=root, timeout_s=10)
    th.join(5)
    assert not Path("/tmp/escaped-abs").exists()
    assert outside(tmp_path, before, root) == set(), "written outside the jit dir"
    assert not any(p.is_file() for p in root.rglob("*")), "nothing kept of a refused transfer"


def test_replica_transfer_trickle_is_cut_at_the_deadline(store, tmp_path):
    c = client(store)
    a = auth.of(TOKEN)
    stop = threading.Event()

    def answer(c, tid):
        data = b"{}" * 500  # 1000 bytes, sent one per chunk
        a.put(c, {"ok": True, "files": [["MANIFEST.json", len(data)]]}, "xfer", "data", tid, "meta")
        for n in range(len(data)):
            if stop.is_set():
                return
            c.set(a.key("xfer", "data", tid, "c", n), data[n:n + 1])
            time.sleep(0.5)

    th = _evil_replica_server(store, answer)
    t0 = time.monotonic()
    with pytest.raises(transfer.TransferError, match="deadline"):
        transfer.fetch(c, TOKEN, source={"node_id": "EVIL", "rank": 0, "manifest_sha256": "0" * 64}, step=1,
                       shard="0", root=tmp_path / "jit", timeout_s=2)
    stop.set()
    # the whole file would take 500 s at that pace
    assert time.monotonic() - t0 < 100
    th.join(5)


# -- the image stream and the migration target -----------------------------------------------------


def _stream_receiver(srv, tid, files, dest, timeout_s, result):
    def run():
        try:
            result["got"] = stream.recv_stream(srv, TOKEN, tid, files, dest, timeout_s)
        except Exception as e:  # noqa: BLE001 (reported to the test)
            result["error"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_idle_connection_does_not_delay_a_real_sender(tmp_path):
    srv = stream.listen("127.0.0.1")
    port = srv.getsockname()[1]
    (tmp_path / "f").write_bytes(b"a" * 100_000)
    files = [("img/f", 100_000)]
    result: dict = {}
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]  # connect and say nothing
    th = _stream_receiver(srv, "t1", files, tmp_path / "dst", 60.0, result)
    stream.send_stream("127.0.0.1", port, TOKEN, "t1", [("img/f", tmp_path / "f")], timeout_s=30)
    th.join(20)
    assert not th.is_alive() and "error" not in result, result  # done while the idle ones still wait
    assert (tmp_path / "dst" / "img" / "f").read_bytes() == b"a" * 100_000
    for s in idle:
        s.close()
    srv.close()


def test_trickling_stream_sender_is_cut_at_the_deadline(tmp_path):
    srv = stream.listen("127.0.0.1")
    port = srv.getsockname()[1]
    files = [("img/f", 1000)]
    result: dict = {}
    t0 = time.monotonic()
    th = _stream_receiver(srv, "t2", files, tmp_path / "dst", 2.0, result)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(json.dumps(stream._header(TOKEN, "t2", files)).encode() + b"\n")
        for _ in range(1000):  # 1 byte every 0.3 s: 300 s for the file
            if not th.is_alive():
                break
            try:
                conn.sendall(b"x")
            except OSError:
                break
            time.sleep(0.3)
    th.join(10)
    assert isinstance(result.get("error"), transfer.TransferError) and "deadline" in str(result["error"]), result
    assert time.monotonic() - t0 < 100
    srv.close()


def _target(store, root: Path) -> migrate_agent.Target:
    return migrate_agent.Target(store, TOKEN, "127.0.0.1", root, EventLog(root / "events.jsonl")).start()


def _request(c, body: dict) -> str:
    tid = os.urandom(16).hex()
    migrate_agent.requests_to(TOKEN, "127.0.0.1").send(c, {"id": tid, **body})
    return tid


def _answer(c, tid: str) -> dict | None:
    return migrate_agent._wait_answer(c, TOKEN, tid, 30)


@pytest.mark.parametrize("files,output,why", [
    ([["img/../../../escaped", 3]], None, "'..' component"),
    ([["abs/tmp/escaped-abs", 3]], None, "only img/<name>"),
    ([["/tmp/escaped-abs", 3]], None, "absolute"),
    ([["img/pages-1.img", 10 ** 12], ["img/jitckpt-manifest.json", 2]], None, "bytes free"),
    ([["img/jitckpt-manifest.json", 2], ["output", 3]], "/tmp/escaped-abs", "not rank 0's output file"),
])
def test_migration_target_refuses_paths_outside_and_huge_sizes(store, tmp_path, files, output, why):
    root = tmp_path / "jit"
    layout.makedirs_private(root)
    target = _target(store, root)
    c = client(store)
    before = tree(tmp_path)
    try:
        tid = _request(c, {"rank": 0, "gen": 1, "files": files, "output": output, "manifest_sha256": "0" * 64,
                           "ctl": str(root / "migrate" / "ctl"), "resume": {"gen": 1, "prefix": "p",
                                                                             "store": ["127.0.0.1", 1]}})
        got = _answer(c, tid)
    finally:
        target.stop()
    assert got is not None and got["ok"] is False and why in got["why"], got
    assert not Path("/tmp/escaped-abs").exists()
    assert outside(tmp_path, before, root) == set(), "written outside the jit dir"


def test_migration_target_takes_the_mode_of_its_own_and_refuses_a_requested_one(store, tmp_path, rejected):
    root = tmp_path / "jit"
    layout.makedirs_private(root)
    output = root / "migrate" / "out" / "rank0.a0.log"
    layout.makedirs_private(output.parent)
    output.write_text("old\n")
    os.chmod(output, 0o600)
    src = tmp_path / "src"
    (src / "img").mkdir(parents=True)
    (src / "img" / "jitckpt-manifest.json").write_text("{}")
    (src / "out.log").write_text("the worker's output\n")
    os.chmod(src / "out.log", 0o4755)
    target = _target(store, root)
    c = client(store)
    files = [("img/jitckpt-manifest.json", src / "img" / "jitckpt-manifest.json"), ("output", src / "out.log")]
    body = {"rank": 0, "gen": 1, "files": [[r, p.stat().st_size] for r, p in files], "output": str(output),
            "manifest_sha256": migrate_agent.criu_manifest_sha(src / "img"), "ctl": str(root / "migrate" / "ctl"),
            "resume": {"gen": 1, "prefix": "p", "store": ["127.0.0.1", 1]}}
    try:
        # the old protocol's per-file modes: the whole request is refused, nothing written
        tid = _request(c, {**body, "modes": {"output": 0o4755}})
        deadline = time.monotonic() + 10
        while not rejected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rejected and "unexpected key(s) ['modes']" in rejected[0][1], rejected
        assert output.read_text() == "old\n"
        # a well-formed request: the file lands 0600 whatever its mode was on the source
        port = auth.of(TOKEN).get(c, "port", "mig", "to", "127.0.0.1", "port")["port"]
        tid = _request(c, body)
        stream.send_stream("127.0.0.1", port, TOKEN, tid, files, timeout_s=20)
        got = _answer(c, tid)
    finally:
        target.stop()
    assert got is not None and got["ok"] is False, got  # no CRIU images to restore: that part fails
    assert output.read_text() == "the worker's output\n"
    assert stat.S_IMODE(output.stat().st_mode) == 0o600


# -- local directories ---------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_foreign_owned_shm_job_dir_is_refused(tmp_path, monkeypatch):
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setenv(contract.EC_SHM.name, str(base))
    d = ec_files.job_root("secjob")
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    os.chown(d, 65534, 65534)
    (d / "ec").mkdir()
    (d / "ec" / "secjob.s5.r0.commit.json").write_text(json.dumps({"job": "secjob", "step": 5}))
    with pytest.raises(layout.CheckpointDirError, match="belongs to uid 65534"):
        ec_files.private_root("secjob")
    assert ec_files.scan_node("secjob") == {"commits": [], "chunks": []}
    # a symlink planted at the name is refused too
    os.symlink(tmp_path, ec_files.job_root("other"))
    with pytest.raises(layout.CheckpointDirError, match="not a directory of ours"):
        ec_files.private_root("other")


def test_existing_jit_dir_is_tightened_and_foreign_one_refused(tmp_path):
    root = tmp_path / "jit"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    layout.claim_root(root, "j")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    if os.geteuid() == 0:
        other = tmp_path / "other"
        other.mkdir()
        os.chown(other, 65534, 65534)
        with pytest.raises(layout.CheckpointDirError, match="--jit-dir"):
            layout.claim_root(other, "j")


# -- a whole job under attack ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Attacker(threading.Thread):
    """Lists and reads every key of the job's store while it runs; writes forged records under the
    old layout's names and over every record key it sees (counters left alone: a forged counter only
    stops the job, which the job does loudly)."""

    def __init__(self, port: int, pwned: Path) -> None:
        super().__init__(daemon=True)
        self.port, self.pwned = port, pwned
        self.seen: dict[str, bytes] = {}
        self.forged = 0
        self.touched: set[str] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        store = None
        while not self.stop.is_set() and store is None:
            try:
                store = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=5),
                                      wait_for_workers=False)
            except Exception:
                time.sleep(0.1)
        evil = {"round": 0, "step": 999, "shards": ["0"], "decided_by": "evil-node", "source": "replica",
                "sources": {"0": [{"node_id": "evil", "host": "evil", "addr": "127.0.0.1", "rank": 0,
                                   "manifest_sha256": "0" * 64}]}, "files": [[f"../../{self.pwned.name}", 1]],
                "output": str(self.pwned), "ranks": [0, 1], "to": "127.0.0.1"}
        while not self.stop.is_set():
            try:
                for k in store.list_keys():
                    v = store.get(k)
                    self.seen[k] = v
                    if re.fullmatch(r"jitckpt/[0-9a-f]{32}", k) and k not in self.touched and v.startswith(b"{"):
                        store.set(k, forged(evil, k))
                        self.forged += 1
                        self.touched.add(k)
                for k in ("jitckpt/job-token/sec", "jitckpt/x/round/0/decision", "jitckpt/x/round/0/failed"):
                    store.set(k, json.dumps(evil))
            except Exception:
                if self.stop.is_set():
                    return
            time.sleep(0.05)


def test_job_under_attack_ends_exact_or_stops_loudly(tmp_path, reference):
    port = _free_port()
    jit, out = tmp_path / "jit", tmp_path / "final.pt"
    pwned = tmp_path / "pwned"
    attacker = Attacker(port, pwned)
    attacker.start()
    cmd = [sys.executable, "-m", "jitrun.cli", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "sec", "--max-restarts", "3",
           "--jit-timeout", "3", "--jit-dir", str(jit), str(TRAIN), "--steps", "16", "--out", str(out),
           "--step-sleep", "0.1"]
    before = tree(tmp_path)
    cp = run_tree(cmd, env={"JITCKPT_TOKEN": TOKEN, "JITCKPT_FAULT": "rank=1,step=6,phase=backward,kind=sigkill"},
                  timeout=240)
    attacker.stop.set()
    attacker.join(10)
    assert attacker.seen, "the attacker reached the store"
    for k, v in attacker.seen.items():
        assert TOKEN not in k and TOKEN.encode() not in v, k
    assert not pwned.exists() and not any("pwned" in p for p in tree(tmp_path)), "a forged name was written"
    assert outside(tmp_path, before, jit) - {str(out)} == set(), "written outside the jit dir"
    events = [json.loads(x) for x in (jit / "events.jsonl").read_text().splitlines()]
    loaded = {json.dumps(e["loaded"]) for e in events if e["event"] == "loaded"}
    assert "999" not in loaded, loaded
    print(f"attacked job: exit {cp.returncode}, {attacker.forged} records forged; last lines:\n"
          + "\n".join(cp.stdout.strip().splitlines()[-3:]))
    if cp.returncode == 0:
        assert_same_state(reference(2, 16), out)
    else:  # a record it needed was overwritten: the job says so and stops
        assert any(w in cp.stdout for w in ("does not verify", "something outside the job")), cp.stdout[-4000:]
    assert attacker.forged > 0
