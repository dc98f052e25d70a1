"""The restore path's replica fetch (launcher/peers/transfer.py ``ensure_local``, the function
the agent calls) over the direct stream between agents, and its fallback to the store:
real ``ReplicaServer`` threads and a real TCPStore, every copy checked against the
manifest whose checksum the decision carries. Across network namespaces too: a source
that cannot reach the requester's address sends through the store instead."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import textwrap
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from netns import Cluster, wait_for_line
from test_security import outside, tree

from jitckpt.wire import auth, contract, layout
from jitrun.peers import stream, transfer

TOKEN = "replica-fetch-token-0123456789"
PAYLOAD = bytes(range(256)) * 70000  # ~17 MiB: several socket buffers and store chunks


def _replica(root: Path, step: int, rank: int, payload: bytes = PAYLOAD) -> dict:
    """A published replica of shard 0 at ``step`` (a file in a subdirectory too) and
    the decision's source record for it."""
    tmp = layout.staging_dir(root, step, "0", rank)
    (tmp / "state.pt").write_bytes(payload)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "x.bin").write_bytes(payload[::-1][:100_000])
    rep = layout.publish(tmp, root=root, step=step, shard="0", rank=rank, world_size=2, job_id="j")
    return {"rank": rank, "manifest_sha256": layout.sha256_file(rep / layout.MANIFEST)}


@pytest.fixture
def tcp_store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield server
    del server


def _client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


class _Events:
    def __init__(self) -> None:
        self.got: list[dict] = []

    def emit(self, event: str, **fields) -> None:
        self.got.append({"event": event, **fields})

    def of(self, name: str) -> list[dict]:
        return [e for e in self.got if e["event"] == name]


def _assert_private_copy(path: Path) -> None:
    assert isinstance(layout.verify(path, "j"), layout.Replica)
    assert (path / "state.pt").read_bytes() == PAYLOAD
    for p in [path, *path.rglob("*")]:
        want = layout.DIR_MODE if p.is_dir() else layout.FILE_MODE
        assert stat.S_IMODE(p.stat().st_mode) == want, p
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")], "staging left behind"


def _fetch_from_a(tmp_path, tcp_store, listen_addr: str) -> tuple[Path, list, str | None, int, _Events]:
    """Node B fetches step 8 from node A's ReplicaServer: (path, errors, source, A's served count, events)."""
    src = {"node_id": "A", **_replica(tmp_path / "a", 8, 0)}
    serving, fetching = _client(tcp_store), _client(tcp_store)
    server = transfer.ReplicaServer(serving, TOKEN, "A", tmp_path / "a", "j").start()
    ev = _Events()
    try:
        path, errors, fetched = transfer.ensure_local(fetching, TOKEN, root=tmp_path / "b", job_id="j", step=8,
                                                      shard="0", sources=[src], self_node="B", timeout_s=30,
                                                      listen_addr=listen_addr, emit=ev.emit)
    finally:
        assert server.stop(serving)
    return path, errors, fetched, server.served, ev


def test_fetch_over_the_stream_between_two_agents(tmp_path, tcp_store):
    path, errors, fetched, served, ev = _fetch_from_a(tmp_path, tcp_store, "127.0.0.1")
    assert errors == [] and fetched == "A" and served == 1
    _assert_private_copy(path)
    [done] = ev.of("replica_fetched")
    assert done["via"] == "stream" and done["source"] == "A", ev.got
    assert done["bytes"] == sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert not ev.of("replica_fetch_fallback") and not ev.of("replica_fetch_failed"), ev.got


def _fetch_a_or_b(tmp_path, tcp_store, monkeypatch, *, corrupt_a: bool = False, tamper=None):
    """Node C fetches step 3 from A, else B (both hold it). ``corrupt_a``: A's agent
    flips the first byte of what it streams; ``tamper()`` runs once the replicas exist."""
    a = {"node_id": "A", **_replica(tmp_path / "a", 3, 0)}
    b = {"node_id": "B", **_replica(tmp_path / "b", 3, 1)}
    if tamper is not None:
        tamper()
    ca, cb, cc = _client(tcp_store), _client(tcp_store), _client(tcp_store)
    if corrupt_a:
        monkeypatch.setenv(contract.TEST_CORRUPT_TRANSFER.name, "1")
    sa = transfer.ReplicaServer(ca, TOKEN, "A", tmp_path / "a", "j").start()
    monkeypatch.delenv(contract.TEST_CORRUPT_TRANSFER.name, raising=False)
    sb = transfer.ReplicaServer(cb, TOKEN, "B", tmp_path / "b", "j").start()
    ev = _Events()
    try:
        path, errors, fetched = transfer.ensure_local(cc, TOKEN, root=tmp_path / "c", job_id="j", step=3,
                                                      shard="0", sources=[a, b], self_node="C", timeout_s=30,
                                                      listen_addr="127.0.0.1", emit=ev.emit)
    finally:
        assert sa.stop(ca) and sb.stop(cb)
    return path, errors, fetched, ev


def test_corrupted_stream_is_refused_and_the_next_source_delivers(tmp_path, tcp_store, monkeypatch):
    """A's bytes arrive with one flipped (its agent's corruption hook flips the first
    byte of what it streams); B's are good."""
    path, errors, fetched, ev = _fetch_a_or_b(tmp_path, tcp_store, monkeypatch, corrupt_a=True)
    assert fetched == "B" and len(errors) == 1 and "checksum mismatch" in errors[0], errors
    _assert_private_copy(path)
    [failed] = ev.of("replica_fetch_failed")
    assert failed["source"] == "A" and "verification" in failed["error"]
    [done] = ev.of("replica_fetched")
    assert done["source"] == "B" and done["via"] == "stream"
    assert not [p for p in (tmp_path / "a").rglob(".corrupt-*")], "the hook's copy left behind"


def test_tampered_source_file_is_refused_and_the_next_source_delivers(tmp_path, tcp_store, monkeypatch):
    """A byte of A's replica changed on A's disk after it was published: A's agent
    does not serve it, B's copy is fetched."""
    def tamper() -> None:
        victim = layout.replica_dir(tmp_path / "a", 3, "0", 0) / "state.pt"
        data = bytearray(victim.read_bytes())
        data[1234] ^= 0x01
        victim.write_bytes(data)

    path, errors, fetched, ev = _fetch_a_or_b(tmp_path, tcp_store, monkeypatch, tamper=tamper)
    assert fetched == "B" and len(errors) == 1 and "not usable" in errors[0], errors
    _assert_private_copy(path)
    assert [e["via"] for e in ev.of("replica_fetched")] == ["stream"]


def test_requester_that_cannot_listen_falls_back_to_the_store(tmp_path, tcp_store):
    """This node's address is wrong (an address no interface here has): no listener,
    the bytes come through the store, and an event says why."""
    path, errors, fetched, _served, ev = _fetch_from_a(tmp_path, tcp_store, "192.0.2.1")
    assert errors == [] and fetched == "A"
    _assert_private_copy(path)
    [fb] = ev.of("replica_fetch_fallback")
    assert fb["source"] == "A" and "listening on 192.0.2.1 failed" in fb["why"], fb
    assert [e["via"] for e in ev.of("replica_fetched")] == ["store"]


# -- a compromised peer on the stream: the requester's checks ----------------------------------------


def _evil_peer(server, answer) -> threading.Thread:
    """A peer holding the token that answers the first request to node EVIL with
    ``answer(store, tid, offer)`` (``offer``: the requester's sealed listener record).
    What fails on its side (the requester hung up on it) is what the tests want."""
    a = auth.of(TOKEN)
    c = _client(server)

    def run():
        key = a.key("xfer", "req", "EVIL", 1)
        c.wait([key], timedelta(seconds=30))
        tid = a.unseal(key, c.get(key))[0]["id"]
        try:
            answer(c, tid, a.get(c, "offer", "xfer", "offer", tid, schema=transfer.OFFER))
        except transfer.TransferError:
            pass

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def _stream_answer(tmp: Path, manifest: bytes, announced: list, sent: list, body: bytes):
    """An answer announcing ``announced`` (via the stream) in the store, then streaming
    ``sent`` names (the manifest, then ``body`` under every other name)."""
    tmp.mkdir()
    (tmp / "m").write_bytes(manifest)
    (tmp / "b").write_bytes(body)

    def answer(c, tid, offer):
        auth.of(TOKEN).put(c, {"ok": True, "files": announced, "via": "stream"}, "xfer", "data", tid, "meta")
        files = [(rel, tmp / ("m" if rel == layout.MANIFEST else "b")) for rel, _ in sent]
        stream.send_stream(offer["addr"], offer["port"], TOKEN, tid, files, timeout_s=10)

    return answer


def _evil_fetch(tcp_store, tmp_path, answer, manifest: bytes, timeout_s: float = 10) -> str:
    """``fetch`` from node EVIL answering with ``answer``; the error, after checking that
    nothing was written outside the jit dir and nothing of the transfer was kept."""
    root = tmp_path / "jit"
    before = tree(tmp_path)
    th = _evil_peer(tcp_store, answer)
    src = {"node_id": "EVIL", "rank": 0, "manifest_sha256": hashlib.sha256(manifest).hexdigest()}
    with pytest.raises(transfer.TransferError) as err:
        transfer.fetch(_client(tcp_store), TOKEN, source=src, step=3, shard="0", root=root, timeout_s=timeout_s,
                       listen_addr="127.0.0.1")
    th.join(15)
    assert not Path("/tmp/escaped-abs").exists()
    assert outside(tmp_path, before, root, tmp_path / "evil") == set(), "written outside the jit dir"
    assert not any(p.is_file() for p in root.rglob("*")), "nothing kept of a refused transfer"
    return str(err.value)


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/escaped-abs", "ok/../../escaped", "over-manifest"])
def test_stream_peer_names_outside_or_sizes_over_the_manifest_are_refused(tcp_store, tmp_path, name):
    manifest = json.dumps({"files": {name: {"size": 5, "sha256": "0" * 64}}}).encode()
    files = [[layout.MANIFEST, len(manifest)], [name, 1 << 20 if name == "over-manifest" else 5]]
    why = _evil_fetch(tcp_store, tmp_path, _stream_answer(tmp_path / "evil", manifest, files, files,
                                                          b"p" * files[1][1]), manifest)
    assert ("not its manifest's" if name == "over-manifest" else "file name") in why, why


def test_stream_header_naming_other_files_than_announced_is_not_accepted(tcp_store, tmp_path):
    """The store's announcement is fine; the stream's (sealed) header names a file
    outside the dir: that connection is dropped, the fetch ends at its deadline."""
    manifest = json.dumps({"files": {"ok": {"size": 5, "sha256": "0" * 64}}}).encode()
    announced = [[layout.MANIFEST, len(manifest)], ["ok", 5]]
    sent = [[layout.MANIFEST, len(manifest)], ["../../escaped", 5]]
    why = _evil_fetch(tcp_store, tmp_path, _stream_answer(tmp_path / "evil", manifest, announced, sent, b"pwned"),
                      manifest, timeout_s=3)
    assert "deadline" in why, why


def test_stream_with_a_tampered_byte_is_refused(tcp_store, tmp_path):
    """A real replica's manifest and files, one byte flipped on the way."""
    rep = layout.replica_dir(tmp_path / "src", 3, "0", 0)
    _replica(tmp_path / "src", 3, 0)
    manifest = (rep / layout.MANIFEST).read_bytes()
    names = [layout.MANIFEST, *sorted(json.loads(manifest)["files"])]
    files = [[rel, (rep / rel).stat().st_size] for rel in names]
    evil = tmp_path / "evil"
    evil.mkdir()
    flipped = bytearray((rep / "state.pt").read_bytes())
    flipped[-1] ^= 0x80
    (evil / "state.pt").write_bytes(flipped)

    def answer(c, tid, offer):
        auth.of(TOKEN).put(c, {"ok": True, "files": files, "via": "stream"}, "xfer", "data", tid, "meta")
        paths = [(rel, evil / rel if rel == "state.pt" else rep / rel) for rel in names]
        stream.send_stream(offer["addr"], offer["port"], TOKEN, tid, paths, timeout_s=10)

    why = _evil_fetch(tcp_store, tmp_path, answer, manifest)
    assert "failed verification" in why and "checksum mismatch" in why, why


def test_forged_offer_does_not_redirect_a_replica(tcp_store, tmp_path):
    """A record at a transfer's offer key that is not sealed under the job token: the
    source's agent connects nowhere and sends through the store."""
    rejected: list[tuple[str, str]] = []
    auth.on_reject(lambda what, why: rejected.append((what, why)))
    a = auth.of(TOKEN)
    _replica(tmp_path / "a", 8, 0, b"small")
    serving, c = _client(tcp_store), _client(tcp_store)
    server = transfer.ReplicaServer(serving, TOKEN, "A", tmp_path / "a", "j").start()
    trap = stream.listen("127.0.0.1")
    trap.setblocking(False)
    try:
        tid = "f" * 32
        key = a.key("xfer", "offer", tid)
        c.set(key, auth.Auth("attacker-guess-0123456789").seal(key, {"addr": "127.0.0.1",
                                                                    "port": trap.getsockname()[1]}))
        seq = c.add(a.key("xfer", "req", "A", "n"), 1)
        a.put(c, {"id": tid, "step": 8, "shard": "0", "rank": 0}, "xfer", "req", "A", seq)
        meta = transfer.wait_meta(c, TOKEN, tid, 20)
        with pytest.raises(BlockingIOError):
            trap.accept()
    finally:
        trap.close()
        assert server.stop(serving)
        auth.on_reject(auth._stderr_hook)
    assert "via" not in meta and meta["files"], meta  # the store's chunks, as for a requester without an offer
    assert any("stream offer" in what for what, _ in rejected), rejected


# -- two nodes (network namespaces) ----------------------------------------------------------------

SOURCE_NODE = textwrap.dedent('''
    import json, sys
    from datetime import timedelta
    from pathlib import Path
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from test_replica_fetch import TOKEN, _replica
    from jitrun.peers import transfer
    addr, port, root = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    store = dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    src = {"node_id": "A", **_replica(root, 8, 0)}
    server = transfer.ReplicaServer(store, TOKEN, "A", root, "j").start()
    print("READY " + json.dumps(src), flush=True)
    store.wait(["done"], timedelta(seconds=120))
    print("SERVED", server.served, flush=True)
    sys.exit(0 if server.stop(store) else 3)
''')

REQUESTER_NODE = textwrap.dedent('''
    import json, sys
    from datetime import timedelta
    from pathlib import Path
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[5])
    from test_replica_fetch import PAYLOAD, TOKEN, _Events
    from jitrun.peers import transfer
    addr, port, root, src = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4])
    store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=120))
    for where, listen in (("own", sys.argv[6]), ("loopback", "127.0.0.1")):
        ev = _Events()
        path, errors, fetched = transfer.ensure_local(store, TOKEN, root=root / where, job_id="j", step=8,
                                                      shard="0", sources=[src], self_node="B", timeout_s=60,
                                                      listen_addr=listen, emit=ev.emit)
        same = path is not None and (path / "state.pt").read_bytes() == PAYLOAD
        print("RESULT " + json.dumps({"where": where, "errors": errors, "same": same, "events": ev.got}), flush=True)
    store.set("done", "1")
''')


@pytest.mark.skipif(Cluster.unavailable() is not None, reason=str(Cluster.unavailable()))
def test_fetch_between_nodes_and_fallback_when_the_source_cannot_reach_back(tmp_path):
    """Node B fetches A's replica twice: listening on its own address (the stream
    crosses the namespaces), then on its loopback, which A reaches only as A's own
    loopback: nothing of B listens there, so A sends through the store."""
    here = str(Path(__file__).resolve().parent)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), here]))}
    with Cluster(2) as c:
        a, b = c.nodes
        jit = str(c.dir / "jit")
        src_proc = a.run([sys.executable, "-c", SOURCE_NODE, a.addr, "29561", jit, here], name="source",
                         env=env, private_dirs=(jit,))
        src = wait_for_line(src_proc, "READY ", 120).split(" ", 1)[1]
        req_proc = b.run([sys.executable, "-c", REQUESTER_NODE, a.addr, "29561", jit, src, here, b.addr],
                         name="requester", env=env, private_dirs=(jit,))
        assert req_proc.wait(240) == 0, req_proc.output()
        assert src_proc.wait(60) == 0, src_proc.output()
        results = {r["where"]: r for r in (json.loads(line.split(" ", 1)[1])
                                           for line in req_proc.output().splitlines() if line.startswith("RESULT "))}
        assert "SERVED 2" in src_proc.output(), src_proc.output()
    own, loop = results["own"], results["loopback"]
    assert own["same"] and own["errors"] == [], own
    assert [e["via"] for e in own["events"] if e["event"] == "replica_fetched"] == ["stream"], own
    assert not [e for e in own["events"] if e["event"] == "replica_fetch_fallback"], own
    assert loop["same"] and loop["errors"] == [], loop
    [fb] = [e for e in loop["events"] if e["event"] == "replica_fetch_fallback"]
    assert "127.0.0.1" in fb["why"] and "cannot connect" in fb["why"], fb
    assert [e["via"] for e in loop["events"] if e["event"] == "replica_fetched"] == ["store"], loop
