"""Peer transfer of replica checkpoints between nodes, through the job's store.

Nodes have their own disks. When the restore decision names a step whose
replica of a shard this node lacks, the agent fetches it from a node that has
it before its workers start, so ``get_checkpoint_path()`` finds it locally.

Transport: the coordination store (the rendezvous endpoint's TCPStore, see
``rdzv``): no new listening port. Requests and announcements are sealed under
the job token (``jitckpt.auth``); the bytes are checked instead: the manifest
against the checksum in the (sealed) restore decision, the announced file list
against that manifest, every file against its checksum. Names are checked
(``peer_files``) before anything is written, sizes are capped by the manifest
and the free space, and a transfer has one overall deadline. Files move in
chunks with a bounded window (the store holds at most ``WINDOW`` chunks of one
transfer at a time; the reader deletes each chunk once written to disk).

* ``ReplicaServer``: a daemon thread per agent with its own store connection
  (a blocking ``wait`` on a shared client would stall the rendezvous
  heartbeats behind it). It answers requests addressed to its node from the
  verified replicas on its disk. It touches only its own connection and the
  read-only replica files.
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
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from jitckpt import auth, contract, layout

from . import peer_files

CHUNK = 4 << 20
WINDOW = 4
# Test hook: a node whose agent has this set corrupts what it serves (proves
# that a corrupted transfer is detected and retried from another source).


class TransferError(RuntimeError):
    pass


def _k(token: str, *parts: object) -> str:
    return auth.of(token).key("xfer", *parts)


def _put(store, token: str, value: object, *parts: object) -> None:
    auth.of(token).put(store, value, "xfer", *parts)


STOP = {"stop": True}
REQUEST = auth.Schema({"id": str, "step": int, "shard": str, "rank": int})
META = auth.Schema({"ok": bool}, {"files": list, "why": str})
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
        return dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    return store


class ReplicaServer:
    def __init__(self, store, token: str, node_id: str, root: Path, job_id: str) -> None:
        self._store = own_connection(store, 30.0)
        self._token = token
        self._node = node_id
        self._root = root
        self._job = job_id
        self._corrupt = contract.TEST_CORRUPT_TRANSFER.get()
        self._stopping = False
        self._seq = 1
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
            seq = store.add(_k(self._token, "req", self._node, "n"), 1)
            _put(store, self._token, STOP, "req", self._node, seq)
        except Exception:
            pass  # the store is gone: the thread's wait fails on its own
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping:
            key = _k(self._token, "req", self._node, self._seq)
            try:
                self._store.wait([key], timedelta(seconds=3600))
                raw = self._store.get(key)
            except Exception:  # timeout, or the store went away with the job
                if self._stopping or not self._alive():
                    return
                continue
            self._seq += 1
            req = auth.of(self._token).open(key, raw, f"replica request {self._seq - 1} to this node")
            if req == STOP:
                return
            if req is None or auth.reject_if("replica request", REQUEST.problem(req)):
                continue
            try:
                self._serve(req)
            except Exception as e:  # tell the fetcher instead of leaving it waiting
                try:
                    send_failed(self._store, self._token, req.get("id"), f"{type(e).__name__}: {e}")
                except Exception:
                    return

    def _alive(self) -> bool:
        try:
            self._store.check([_k(self._token, "alive")])
            return True
        except Exception:
            return False

    def _serve(self, req: dict) -> None:
        tid = req["id"]
        path = layout.replica_dir(self._root, int(req["step"]), str(req["shard"]), int(req["rank"]))
        ok = layout.verify(path, self._job)
        if not isinstance(ok, layout.Replica):
            raise TransferError(f"replica {path} on node {self._node} is not usable: {ok}")
        files = [layout.MANIFEST, *sorted(json.loads((path / layout.MANIFEST).read_text())["files"])]
        send_files(self._store, self._token, tid, [(rel, path / rel) for rel in files],
                   corrupt=(lambda rel: rel != layout.MANIFEST) if self._corrupt else None)
        self.served += 1


def send_files(store, token: str, tid: str, files: list[tuple[str, Path]], *,
               corrupt: Callable[[str], bool] | None = None, ack_timeout_s: float = 120.0) -> int:
    """Announce ``files`` (name, path) under transfer ``tid`` and send them in chunks,
    at most WINDOW unacknowledged; returns the bytes sent. ``corrupt``: test hook, the
    first chunk of the first file it selects goes out with a flipped byte."""
    sizes = [[rel, path.stat().st_size] for rel, path in files]
    _put(store, token, {"ok": True, "files": sizes}, "data", tid, "meta")
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
                store.set(_k(token, "data", tid, "c", n), data)
                sent += len(data)
                n += 1
    return sent


def _wait_ack(store, token: str, tid: str, n: int, timeout_s: float, sent: int) -> None:
    """Chunk ``n`` was taken; TransferError when the receiver gave up on the transfer
    (``abort``, e.g. a manifest that did not match: it then acknowledges what the
    sender may wait for) or took nothing for ``timeout_s``."""
    try:
        store.wait([_k(token, "data", tid, "ack", n)], timedelta(seconds=timeout_s))
    except Exception:
        raise TransferError(f"the receiver took nothing more within {timeout_s:.0f}s ({sent} bytes sent)") from None
    if store.check([_k(token, "data", tid, "abort")]):
        raise TransferError(f"the receiver gave up on the transfer ({sent} bytes sent)")


def send_failed(store, token: str, tid: str, why: str) -> None:
    """Tell the receiver of ``tid`` that nothing will come, and why."""
    _put(store, token, {"ok": False, "why": why}, "data", tid, "meta")


def wait_meta(store, token: str, tid: str, timeout_s: float) -> dict:
    """The sender's announcement of ``tid``; TransferError if it refused, never came,
    or does not verify."""
    key = _k(token, "data", tid, "meta")
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except Exception:
        raise TransferError(f"did not answer within {timeout_s:.0f}s") from None
    meta = auth.of(token).open(key, store.get(key), f"announcement of transfer {tid}", META)
    if meta is None:
        raise TransferError("its announcement does not verify under the job token")
    if not meta["ok"]:
        raise TransferError(f"refused: {meta.get('why')}")
    return meta


class _Chunks:
    """Chunk after chunk of transfer ``tid`` from the store, acknowledged and deleted,
    each within what is left of ``deadline`` (monotonic)."""

    def __init__(self, store, token: str, tid: str, deadline: float) -> None:
        self.store, self.token, self.tid, self.deadline = store, token, tid, deadline
        self.n = 0

    def read(self, rel: str, left: int) -> bytes:
        key = _k(self.token, "data", self.tid, "c", self.n)
        wait = self.deadline - time.monotonic()
        try:
            if wait <= 0:
                raise TimeoutError
            self.store.wait([key], timedelta(seconds=wait))
        except Exception:
            raise TransferError(f"chunk {self.n} of {rel} did not come before the transfer's deadline") from None
        data = self.store.get(key)
        self.store.delete_key(key)
        self.store.set(_k(self.token, "data", self.tid, "ack", self.n), b"")
        self.n += 1
        if len(data) > left:
            raise TransferError(f"chunk {self.n - 1} of {rel}: {len(data)} bytes, {left} announced")
        return data


def recv_files(store, token: str, tid: str, files: list[tuple[str, int]], base: Path, deadline: float) -> None:
    """Receive what :func:`send_files` announced (``files``, checked names and sizes)
    into new files under ``base`` (0600, fsynced), acknowledging and deleting every
    chunk, all before ``deadline`` (monotonic)."""
    _write_files(files, base, _Chunks(store, token, tid, deadline).read)


def _write_files(files: list[tuple[str, int]], base: Path, read: Callable[[str, int], bytes]) -> None:
    """Each (name, size) of ``files`` into a new file ``base/name`` (0600, fsynced),
    its bytes from ``read(name, bytes left)``."""
    for rel, size in files:
        fd = peer_files.open_new(base, rel)
        with os.fdopen(fd, "wb") as out:
            left = size
            while left > 0:
                data = read(rel, left)
                out.write(data)
                left -= len(data)
            out.flush()
            os.fsync(out.fileno())


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


def fetch(store, token: str, *, source: dict, step: int, shard: str, root: Path,
          timeout_s: float = 120.0) -> Path:
    """Copy ``source``'s replica of (step, shard) into ``root``; return its path."""
    tid = uuid.uuid4().hex
    seq = store.add(_k(token, "req", source["node_id"], "n"), 1)
    _put(store, token, {"id": tid, "step": step, "shard": shard, "rank": int(source["rank"])},
         "req", source["node_id"], seq)
    final = layout.replica_dir(root, step, shard, int(source["rank"]))
    layout.makedirs_private(final.parent)
    tmp = final.parent / f".tmp-rank-{source['rank']}-fetch-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp, layout.DIR_MODE)
    t0 = time.monotonic()
    chunks: _Chunks | None = None
    ok = False
    try:
        try:
            meta = wait_meta(store, token, tid, timeout_s)
            files = peer_files.file_list(meta.get("files"), where=tmp)
        except (TransferError, peer_files.RefusedFile) as e:
            raise TransferError(f"node {source['node_id']} {e}") from None
        if not files or files[0][0] != layout.MANIFEST or files[0][1] > MAX_MANIFEST:
            raise TransferError(f"node {source['node_id']} announced no manifest first (or one over "
                                f"{MAX_MANIFEST} bytes)")
        chunks = _Chunks(store, token, tid, t0 + timeout_s + sum(size for _, size in files) / MIN_RATE)
        _write_files(files[:1], tmp, chunks.read)
        if files != _manifest_files(tmp, source["manifest_sha256"]):
            raise TransferError(f"node {source['node_id']} announced files that are not its manifest's")
        _write_files(files[1:], tmp, chunks.read)
        checked = layout.verify(tmp, None)
        if not isinstance(checked, layout.Replica) or checked.step != step or checked.shard != shard:
            raise TransferError(f"replica from node {source['node_id']} failed verification: {checked}")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        layout.fsync_dir(final.parent)
        ok = True
        return final
    except peer_files.RefusedFile as e:
        raise TransferError(f"node {source['node_id']}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when it became ``final``
        if not ok and chunks is not None:
            try:  # a sender waiting for acknowledgements stops now, not after its timeout
                store.set(_k(token, "data", tid, "abort"), b"")
                for n in range(chunks.n, chunks.n + WINDOW + 1):
                    store.set(_k(token, "data", tid, "ack", n), b"")
            except Exception:
                pass


def ensure_local(store, token: str, *, root: Path, job_id: str, step: int, shard: str, sources: list[dict],
                 self_node: str, timeout_s: float = 120.0) -> tuple[Path | None, list[str], str | None]:
    """A verified local replica of (step, shard): found on disk, or fetched
    from the first source that delivers a good copy. Returns (path, errors of
    failed sources, the node fetched from or None)."""
    good, _ = layout.scan(root, job_id)
    for r in good:
        if r.step == step and r.shard == shard:
            return r.path, [], None
    errors = []
    for src in sorted(sources, key=lambda s: s["node_id"] == self_node):
        if src["node_id"] == self_node:
            continue  # ours was listed but is no longer verifiable here
        try:
            path = fetch(store, token, source=src, step=step, shard=shard, root=root, timeout_s=timeout_s)
            return path, errors, src["node_id"]
        except TransferError as e:
            errors.append(str(e))
    return None, errors, None
