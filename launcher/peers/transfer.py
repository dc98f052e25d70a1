"""Peer transfer of replica checkpoints between nodes.

Nodes have their own disks. When the restore decision names a step whose
replica of a shard this node lacks, the agent fetches it from a node that has
it before its workers start, so ``get_checkpoint_path()`` finds it locally.

Coordination goes through the job's store (the rendezvous endpoint's TCPStore,
see ``rdzv``): requests and announcements are sealed under the job token
(``jitckpt.wire.auth``). The bytes go over a direct connection from the source agent
to a listener the requester opens for this one fetch on its node's job address
(``stream``: one connection, sendfile and splice), offered in a sealed record
next to the request. When the requester cannot listen or the source cannot
reach it (a firewall, an address that does not route, a source too old to know
the offer), the bytes go through the store instead, in chunks with a bounded
window (the store holds at most ``WINDOW`` chunks of one transfer at a time;
the reader deletes each chunk once written to disk), and the requester says so.

Either way the bytes are checked, not trusted: the manifest against the
checksum in the (sealed) restore decision, the announced file list against
that manifest, every file against its checksum. Names are checked
(``peer_files``) before anything is written, sizes are capped by the manifest
and the free space, and a transfer has one overall deadline.

* ``ReplicaServer``: a daemon thread per agent with its own store connection
  (a blocking ``wait`` on a shared client would stall the rendezvous
  heartbeats behind it). It answers requests addressed to its node from the
  verified replicas on its disk. It touches only its own connection, the
  read-only replica files and the connections it opens to requesters.
* ``fetch``: the agent's main thread. Stages into a temp dir, checks the
  manifest against the checksum in the decision and every file against the
  manifest, then renames into place (the same atomic publication as a save).
  A bad or failed transfer raises ``TransferError``; the caller tries the next
  source.

A shared jit dir needs no copies: the replica is found locally first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

from jitckpt.sealed_store import Requests, Space, StoreRecordError, space
from jitckpt.wire import auth, contract, layout

from . import peer_files, stream
from .stream import TransferError

CHUNK = 4 << 20
WINDOW = 4
# how long a source tries to reach the requester's listener before it sends through the store
CONNECT_S = 5.0
# the longest a source's send (or its wait for an acknowledgement) may stall
STALL_S = 120.0


def xfer(token: str) -> Space:
    """The records of replica transfers (labels ``xfer/...``)."""
    return space(token, "xfer")


def requests_to(token: str, node: str) -> Requests:
    """The replica requests to the :class:`ReplicaServer` of ``node``."""
    return Requests(xfer(token), "req", node)


REQUEST = auth.Schema({"id": str, "step": int, "shard": str, "rank": int})
# the requester's listener for one transfer, at its own key: a source too old to
# read it ignores it and answers through the store
OFFER = auth.Schema({"addr": str, "port": int})
META = auth.Schema({"ok": bool}, {"files": list, "why": str, "via": str, "fallback": str})
MAX_MANIFEST = 16 << 20
# a transfer's deadline: its timeout plus this long per byte announced (a sender
# that trickles is cut off; a large replica on a slow link is not)
MIN_RATE = 1 << 20  # bytes/s


def own_connection(store, timeout_s: float = 60.0):
    """A separate client connection to the same TCPStore server. A client
    runs one operation at a time: a long ``wait`` on a connection shared with
    torch's rendezvous heartbeat thread would stall the heartbeats until the
    other nodes declare this one dead."""
    import torch.distributed as dist

    if isinstance(store, dist.TCPStore):
        return connect_store(store.host, store.port, timeout_s)
    return store


def connect_store(host: str, port: int, timeout_s: float):
    """A client of the TCPStore at ``host:port``; a connection that is never
    answered raises with who listens on that port here (``port_facts``)."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except dist.DistNetworkError as e:
        raise dist.DistNetworkError(f"{e} [{port_facts(port)}]") from e


def port_facts(port: int) -> str:
    """Who listens on local TCP ``port`` and how many connections it has, for an
    error that says why a connection to our own store went unanswered."""
    import psutil

    try:
        conns = [c for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port]
    except (psutil.Error, OSError) as e:
        return f"port {port}: no socket facts ({e})"
    listening = sorted({(c.pid, f"{c.laddr.ip}") for c in conns if c.status == psutil.CONN_LISTEN},
                       key=lambda x: (x[0] or 0, x[1]))
    states: dict[str, int] = {}
    for c in conns:
        if c.status != psutil.CONN_LISTEN:
            states[c.status] = states.get(c.status, 0) + 1
    who = ", ".join(f"pid {pid} on {ip}" for pid, ip in listening) or "nobody"
    return f"port {port}: listening {who}; its other sockets by state {states or 'none'}; this process {os.getpid()}"


class ReplicaServer:
    def __init__(self, store, token: str, node_id: str, root: Path, job_id: str, identity: str | None = None) -> None:
        self._store = own_connection(store, 30.0)
        self._token = token
        self._node = node_id
        self._root = root
        self._job = job_id
        self._identity = identity
        # test hook: serve corrupted bytes (a corrupted transfer must be refused and
        # the replica fetched from another source)
        self._corrupt = contract.TEST_CORRUPT_TRANSFER.get()
        self._stopping = False
        self.served = 0
        self._thread = threading.Thread(target=self._run, name="jitrun-replica-server", daemon=True)

    def start(self) -> ReplicaServer:
        self._thread.start()
        return self

    def stop(self, store, timeout_s: float = 5.0) -> bool:
        """Unblock and join the thread; True when it ended. It must not be
        inside a store call when the interpreter finalizes: a daemon thread
        that wakes up then is ended by pthread_exit inside pybind11's noexcept
        GIL re-acquisition, and the process aborts with "terminate called
        without an active exception"."""
        self._stopping = True
        if not self._thread.is_alive():
            return True
        try:
            requests_to(self._token, self._node).stop(store)
        except Exception:
            pass  # the store is gone: the thread's wait fails on its own
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        requests_to(self._token, self._node).serve(
            self._store, "replica request", problem=REQUEST.problem, handle=self._handle,
            stopping=lambda: self._stopping, on_store_error=lambda: not self._stopping and self._alive())

    def _handle(self, req: dict) -> bool:
        try:
            self._serve(req)
        except Exception as e:  # tell the fetcher instead of leaving it waiting
            try:
                send_failed(self._store, self._token, req.get("id"), f"{type(e).__name__}: {e}")
            except Exception:
                return False  # the store is gone: nobody waits any more
        return True

    def _alive(self) -> bool:
        try:
            self._store.check([xfer(self._token).key("alive")])
            return True
        except Exception:
            return False

    def _serve(self, req: dict) -> None:
        tid = req["id"]
        path = layout.replica_dir(self._root, int(req["step"]), str(req["shard"]), int(req["rank"]))
        ok = layout.verify(path, self._job, self._identity)
        if not isinstance(ok, layout.Replica):
            raise TransferError(f"replica {path} on node {self._node} is not usable: {ok}")
        names = [layout.MANIFEST, *sorted(json.loads((path / layout.MANIFEST).read_text())["files"])]
        files = [(rel, path / rel) for rel in names]
        conn, why_not = self._reach(tid)
        if conn is not None:
            self._stream(conn, tid, files)
        else:
            send_files(self._store, self._token, tid, files, note={"fallback": why_not} if why_not else None,
                       corrupt=(lambda rel: rel != layout.MANIFEST) if self._corrupt else None)
        self.served += 1

    def _reach(self, tid: str) -> tuple[socket.socket | None, str | None]:
        """A connection to the listener the requester of ``tid`` offered; else None and
        why not (None: it offered none)."""
        offer = xfer(self._token).get(self._store, f"stream offer of transfer {tid}", "offer", tid, schema=OFFER)
        if offer is None:
            return None, None
        if not 0 < offer["port"] < 65536:
            return None, f"the offered port {offer['port']} is not a port"
        try:
            return stream.connect(offer["addr"], offer["port"], CONNECT_S), None
        except TransferError as e:
            return None, f"node {self._node}: {e}"

    def _stream(self, conn: socket.socket, tid: str, files: list[tuple[str, Path]]) -> None:
        """``files`` over ``conn``, announced in the store first (the requester checks the
        list before it accepts). The corruption test hook sends a copy of the first
        replica file with its first byte flipped."""
        with conn:
            xfer(self._token).put(self._store, {"ok": True, "files": [[rel, p.stat().st_size] for rel, p in files],
                                                "via": "stream"}, "data", tid, "meta")
            if not self._corrupt or len(files) < 2:
                stream.send_on(conn, self._token, tid, files, STALL_S)
                return
            with tempfile.TemporaryDirectory(dir=self._root, prefix=".corrupt-") as tmp:
                rel, src = files[1]
                data = bytearray(src.read_bytes())
                if data:
                    data[0] ^= 0xFF
                (Path(tmp) / "f").write_bytes(data)
                stream.send_on(conn, self._token, tid, [files[0], (rel, Path(tmp) / "f"), *files[2:]], STALL_S)


def send_files(store, token: str, tid: str, files: list[tuple[str, Path]], *, note: dict | None = None,
               corrupt: Callable[[str], bool] | None = None, ack_timeout_s: float = STALL_S) -> int:
    """Announce ``files`` (name, path) under transfer ``tid`` (with ``note``'s keys, e.g.
    why the stream was not used) and send them through the store in chunks, at most
    WINDOW unacknowledged; returns the bytes sent. ``corrupt``: test hook, the first
    chunk of the first file it selects goes out with a flipped byte."""
    sizes = [[rel, path.stat().st_size] for rel, path in files]
    # no "via" key: an older requester's schema refuses keys it does not know
    xfer(token).put(store, {"ok": True, "files": sizes, **(note or {})}, "data", tid, "meta")
    n = sent = 0
    for rel, path in files:
        with open(path, "rb") as fh:
            while True:
                data = fh.read(CHUNK)
                if not data:
                    break
                if n >= WINDOW:
                    _wait_ack(store, token, tid, n - WINDOW, ack_timeout_s, sent)
                if corrupt is not None and corrupt(rel):
                    corrupt = None
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                store.set(xfer(token).key("data", tid, "c", n), data)
                sent += len(data)
                n += 1
    return sent


def _wait_ack(store, token: str, tid: str, n: int, timeout_s: float, sent: int) -> None:
    """Chunk ``n`` was taken; TransferError when the receiver gave up on the transfer
    (``abort``, e.g. a manifest that did not match: it then acknowledges what the
    sender may wait for) or took nothing for ``timeout_s``."""
    try:
        store.wait([xfer(token).key("data", tid, "ack", n)], timedelta(seconds=timeout_s))
    except Exception:
        raise TransferError(f"the receiver took nothing more within {timeout_s:.0f}s ({sent} bytes sent)") from None
    if store.check([xfer(token).key("data", tid, "abort")]):
        raise TransferError(f"the receiver gave up on the transfer ({sent} bytes sent)")


def send_failed(store, token: str, tid: str, why: str) -> None:
    """Tell the receiver of ``tid`` that nothing will come, and why."""
    xfer(token).put(store, {"ok": False, "why": why}, "data", tid, "meta")


def wait_meta(store, token: str, tid: str, timeout_s: float) -> dict:
    """The sender's announcement of ``tid``; TransferError if it refused, never came,
    or does not verify."""
    try:
        meta = xfer(token).wait(store, f"announcement of transfer {tid}", "data", tid, "meta", timeout_s=timeout_s,
                                schema=META)
    except StoreRecordError as e:
        if e.kind == StoreRecordError.TIMEOUT:
            raise TransferError(f"did not answer within {timeout_s:.0f}s") from None
        raise TransferError("its announcement does not verify under the job token") from None
    if not meta["ok"]:
        raise TransferError(f"refused: {meta.get('why')}")
    return meta


class _Chunks:
    """Chunk after chunk of transfer ``tid`` from the store, acknowledged and deleted,
    each within what is left of ``deadline`` (monotonic). Leaving it on an error tells
    the sender to stop."""

    def __init__(self, store, token: str, tid: str, deadline: float) -> None:
        self.store, self.token, self.tid, self.deadline = store, token, tid, deadline
        self.n = 0

    def take(self, files: list[tuple[str, int]], base: Path) -> None:
        """The next ``files`` (checked names and sizes) into new files under ``base``
        (0600, fsynced)."""
        for rel, size in files:
            fd = peer_files.open_new(base, rel)
            with os.fdopen(fd, "wb") as out:
                left = size
                while left > 0:
                    data = self._read(rel, left)
                    out.write(data)
                    left -= len(data)
                out.flush()
                os.fsync(out.fileno())

    def _read(self, rel: str, left: int) -> bytes:
        key = xfer(self.token).key("data", self.tid, "c", self.n)
        wait = self.deadline - time.monotonic()
        try:
            if wait <= 0:
                raise TimeoutError
            self.store.wait([key], timedelta(seconds=wait))
        except Exception:
            raise TransferError(f"chunk {self.n} of {rel} did not come before the transfer's deadline") from None
        data = self.store.get(key)
        self.store.delete_key(key)
        self.store.set(xfer(self.token).key("data", self.tid, "ack", self.n), b"")
        self.n += 1
        if len(data) > left:
            raise TransferError(f"chunk {self.n - 1} of {rel}: {len(data)} bytes, {left} announced")
        return data

    def __enter__(self) -> _Chunks:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            return
        try:  # a sender waiting for acknowledgements stops now, not after its timeout
            self.store.set(xfer(self.token).key("data", self.tid, "abort"), b"")
            for n in range(self.n, self.n + WINDOW + 1):
                self.store.set(xfer(self.token).key("data", self.tid, "ack", n), b"")
        except Exception:
            pass


def _manifest_files(tmp: Path, want_sha: str) -> list[tuple[str, int]]:
    """The (name, size) list the manifest received into ``tmp`` promises, after its
    checksum matched the one the decision carries."""
    data = (tmp / layout.MANIFEST).read_bytes()
    if hashlib.sha256(data).hexdigest() != want_sha:
        raise TransferError("its manifest does not match the checksum in the restore decision")
    try:
        files = json.loads(data)["files"]
        return [(layout.MANIFEST, len(data))] + sorted((rel, int(m["size"])) for rel, m in files.items())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise TransferError(f"its manifest is malformed ({e!r})") from None


class Fetched(NamedTuple):
    path: Path
    via: str  # "stream" (the direct connection) or "store" (chunks through the store)


def fetch(store, token: str, *, source: dict, step: int, shard: str, root: Path, timeout_s: float = 120.0,
          listen_addr: str | None = None, on_fallback: Callable[[str], object] | None = None) -> Fetched:
    """Copy ``source``'s replica of (step, shard) into ``root``. The bytes come over a
    direct connection to a listener on ``listen_addr`` (this node's job address) when
    one is given and the source reaches it, else through the store; ``on_fallback``
    hears why when the stream was wanted but not used."""
    tid = uuid.uuid4().hex
    lsn, why_not = _listen(listen_addr)
    if why_not and on_fallback is not None:
        on_fallback(why_not)
    try:
        if lsn is not None:
            xfer(token).put(store, {"addr": listen_addr, "port": lsn.getsockname()[1]}, "offer", tid)
        requests_to(token, source["node_id"]).send(
            store, {"id": tid, "step": step, "shard": shard, "rank": int(source["rank"])})
        final = layout.replica_dir(root, step, shard, int(source["rank"]))
        layout.makedirs_private(final.parent)
        tmp = final.parent / f".tmp-rank-{source['rank']}-fetch-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp, layout.DIR_MODE)
        try:
            via = _receive(store, token, tid, source, tmp, lsn, timeout_s, on_fallback)
            checked = layout.verify(tmp, None)
            if not isinstance(checked, layout.Replica) or checked.step != step or checked.shard != shard:
                raise TransferError(f"replica from node {source['node_id']} failed verification: {checked}")
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            layout.fsync_dir(final.parent)
            return Fetched(final, via)
        except peer_files.RefusedFile as e:
            raise TransferError(f"node {source['node_id']}: {e}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when it became ``final``
    finally:
        if lsn is not None:
            lsn.close()


def _listen(addr: str | None) -> tuple[socket.socket | None, str | None]:
    """A listener for one fetch on this node's job address, or None and why not."""
    if not addr:
        return None, None
    try:
        return stream.listen(addr), None
    except OSError as e:
        return None, f"listening on {addr} failed ({e}); pass --local-addr with this node's address"


def _receive(store, token: str, tid: str, source: dict, tmp: Path, lsn: socket.socket | None, timeout_s: float,
             on_fallback: Callable[[str], object] | None) -> str:
    """Transfer ``tid``'s files into ``tmp`` the way the source announced ("stream" or
    "store", returned): first the manifest, checked against the decision's checksum,
    then, when the announced list is exactly the manifest's, the files it lists."""
    node = source["node_id"]
    t0 = time.monotonic()
    try:
        meta = wait_meta(store, token, tid, timeout_s)
        files = peer_files.file_list(meta.get("files"), where=tmp)
    except (TransferError, peer_files.RefusedFile) as e:
        raise TransferError(f"node {node} {e}") from None
    if not files or files[0][0] != layout.MANIFEST or files[0][1] > MAX_MANIFEST:
        raise TransferError(f"node {node} announced no manifest first (or one over {MAX_MANIFEST} bytes)")
    deadline = t0 + timeout_s + sum(size for _, size in files) / MIN_RATE
    via = meta.get("via", "store")
    if via == "stream" and lsn is not None:
        parts: stream.Incoming | _Chunks = stream.Incoming(lsn, token, tid, files, deadline, sync=True)
    elif via == "store":
        if meta.get("fallback") and on_fallback is not None:
            on_fallback(meta["fallback"])
        parts = _Chunks(store, token, tid, deadline)
    else:
        raise TransferError(f"node {node} announced its files {via!r:.20}, which this node did not offer")
    with parts:
        parts.take(files[:1], tmp)
        if files != _manifest_files(tmp, source["manifest_sha256"]):
            raise TransferError(f"node {node} announced files that are not its manifest's")
        parts.take(files[1:], tmp)
    return via


def ensure_local(store, token: str, *, root: Path, job_id: str, step: int, shard: str, sources: list[dict],
                 self_node: str, timeout_s: float = 120.0, listen_addr: str | None = None,
                 emit: Callable[..., object] | None = None, identity: str | None = None
                 ) -> tuple[Path | None, list[str], str | None]:
    """A verified local replica of (step, shard): found on disk, or fetched from the
    first source that delivers a good copy (over a stream to ``listen_addr`` where it
    can, see :func:`fetch`). Returns (path, errors of failed sources, the node fetched
    from or None). ``emit`` (the agent's ``EventLog.emit``) hears, as they happen,
    ``replica_fetch_failed`` for each failed source, ``replica_fetch_fallback`` when a
    source's bytes went through the store instead of the stream, and ``replica_fetched``."""
    good, _ = layout.scan(root, job_id, identity)
    for r in good:
        if r.step == step and r.shard == shard:
            return r.path, [], None
    say = emit or (lambda *_a, **_k: None)
    t0 = time.monotonic()
    errors = []
    for src in sorted(sources, key=lambda s: s["node_id"] == self_node):
        if src["node_id"] == self_node:
            continue  # ours was listed but is no longer verifiable here
        node = src["node_id"]
        try:
            got = fetch(store, token, source=src, step=step, shard=shard, root=root, timeout_s=timeout_s,
                        listen_addr=listen_addr, on_fallback=lambda why, node=node: say(
                            "replica_fetch_fallback", step=step, shard=shard, source=node, why=why))
        except TransferError as e:
            errors.append(str(e))
            say("replica_fetch_failed", step=step, shard=shard, source=node, error=str(e))
            continue
        say("replica_fetched", step=step, shard=shard, path=str(got.path), source=node, via=got.via,
            bytes=sum(f.stat().st_size for f in got.path.rglob("*") if f.is_file()),
            seconds=round(time.monotonic() - t0, 3))
        return got.path, errors, node
    return None, errors, None
