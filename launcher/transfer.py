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

import errno
import hashlib
import json
import os
import selectors
import shutil
import socket
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


# -- direct streams (CRIU images: hundreds of MB, one sender, one receiver) ------------------
#
# Through the store every byte would pass the rendezvous host's process twice. The
# receiver listens on its node's job address (--local-addr) and announces the port in
# the store; the sender connects and sends one JSON header line, {"tid", "files":
# [[name, size], ...], "mac"} (the MAC under the job token, never the token), then the
# files' bytes back to back. The receiver knows the file list already (from the sealed
# request); a connection whose header does not verify, names another transfer or
# another list is closed and the wait goes on. Headers are read from every connection
# at once, so an idle one cannot hold the listener, and the whole transfer has one
# deadline, so a sender that trickles is cut off at it.

STREAM_BUF = 8 << 20
# Both ends run as threads of an agent (on one node, the same agent): Python's
# timeout sockets are non-blocking underneath, so a send or a receive then takes
# thousands of small calls, each taking the GIL back, and two such threads in one
# process held a 240 MB transfer at ~300 MB/s. Instead the socket blocks, with the
# kernel's own timeouts (SO_SNDTIMEO / SO_RCVTIMEO: a stalled peer still fails the
# call), a file goes out in one sendfile() and comes in by splice() a MiB at a time
# (_recv_files; STREAM_BUF bytes per recv(MSG_WAITALL) where splice is refused).


def _kernel_timeouts(conn: socket.socket, timeout_s: float) -> None:
    conn.settimeout(None)
    usec = max(int(timeout_s * 1e6), 1000)
    sec, usec = divmod(usec, 1_000_000)
    tv = sec.to_bytes(8, "little", signed=True) + usec.to_bytes(8, "little", signed=True)  # struct timeval
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def listen(addr: str) -> socket.socket:
    """A listening socket on the job's address of this node (never a wildcard)."""
    srv = socket.create_server((addr, 0), family=socket.AF_INET6 if ":" in addr else socket.AF_INET, backlog=8)
    srv.settimeout(1.0)
    return srv


def _header(token: str, tid: str, files: list) -> dict:
    body = {"tid": tid, "files": [[rel, size] for rel, size in files]}
    return {**body, "mac": auth.of(token).mac(f"stream/{tid}", body)}


def send_stream(addr: str, port: int, token: str, tid: str, files: list[tuple[str, Path]],
                timeout_s: float) -> int:
    """Send ``files`` (name, path) to a receiver's :func:`recv_stream`; returns bytes sent."""
    sizes = [(rel, path.stat().st_size) for rel, path in files]
    header = json.dumps(_header(token, tid, sizes)).encode() + b"\n"
    try:
        with socket.create_connection((addr, port), timeout=timeout_s) as conn:
            _kernel_timeouts(conn, timeout_s)
            conn.sendall(header)
            sent = 0
            for rel, path in files:
                with open(path, "rb") as fh:
                    size, off = os.fstat(fh.fileno()).st_size, 0
                    while off < size:
                        n = os.sendfile(conn.fileno(), fh.fileno(), off, size - off)
                        if n == 0:
                            raise OSError(f"{rel} shrank while it was sent")
                        off += n
                    sent += off
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # the receiver closes once it has everything on disk
            return sent
    except OSError as e:
        raise TransferError(f"streaming to {addr}:{port} failed: {e}") from None


HEADER_LIMIT = 1 << 20
MAX_PENDING = 32  # connections whose header is still coming; the oldest goes first beyond it


def _accept_sender(srv: socket.socket, token: str, tid: str, files: list[tuple[str, int]],
                   deadline: float) -> tuple[socket.socket, bytes]:
    """The connection whose header announces ``files`` for ``tid`` under the job token,
    and what of the files came with the header. Every connection's header is read as
    it comes (non-blocking), so a peer that connects and sends nothing delays no one."""
    want = _header(token, tid, files)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    pending: dict[socket.socket, bytearray] = {}

    def drop(c: socket.socket) -> None:
        sel.unregister(c)
        del pending[c]
        c.close()

    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(f"no sender of transfer {tid} before its deadline")
            for key, _ in sel.select(min(left, 1.0)):
                if key.fileobj is srv:
                    try:
                        conn, _ = srv.accept()
                    except OSError:
                        continue
                    if len(pending) >= MAX_PENDING:
                        drop(next(iter(pending)))
                    conn.setblocking(False)
                    pending[conn] = bytearray()
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj  # type: ignore[assignment]
                try:
                    piece = conn.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    piece = b""
                buf = pending[conn]
                buf += piece
                if b"\n" not in buf:
                    if not piece or len(buf) > HEADER_LIMIT:
                        drop(conn)
                    continue
                line, _, rest = bytes(buf).partition(b"\n")
                try:
                    head = json.loads(line)
                except ValueError:
                    head = None
                ours = (isinstance(head, dict) and head.get("tid") == tid and head.get("files") == want["files"]
                        and set(head) == set(want) and auth.of(token).check_mac(
                            f"stream/{tid}", {"tid": tid, "files": want["files"]}, head.get("mac")))
                if not ours:
                    drop(conn)  # not ours: wrong job, wrong transfer, or a stray connection
                    continue
                sel.unregister(conn)
                del pending[conn]
                conn.setblocking(True)
                return conn, rest
    finally:
        for c in list(pending):
            c.close()
        sel.close()


def recv_stream(srv: socket.socket, token: str, tid: str, files: list[tuple[str, int]], base: Path,
                timeout_s: float) -> list[tuple[str, int]]:
    """Accept the sender of ``tid`` on ``srv`` and write ``files`` (the list the receiver
    expects, names and sizes already checked with ``peer_files``) to new files under
    ``base`` (0600), all within ``timeout_s``. Returns ``files``.

    Not fsynced: these are CRIU images, restored at once and deleted; a node that
    crashes meanwhile fails the migration whatever is on its disk. An fsync would
    write every page to a disk-backed jit dir (0.6 s for 240 MB here) and the
    deletion right after the restore would have made that write useless."""
    deadline = time.monotonic() + timeout_s
    conn, rest = _accept_sender(srv, token, tid, files, deadline)
    with conn:
        _recv_files(conn, tid, files, rest, base, deadline)
    return files


def _recv_files(conn: socket.socket, tid: str, files: list, early_bytes: bytes, base: Path, deadline: float) -> None:
    """The announced ``files`` from ``conn`` into new files (0600, unsynced: see
    recv_stream): first what came with the header, then the socket's bytes moved by
    splice() through a pipe (no copy through Python, one GIL hand-over per MiB), or,
    where splice is missing, recv(MSG_WAITALL) of STREAM_BUF bytes at a time. Every
    read waits at most until ``deadline`` (monotonic)."""
    early = memoryview(early_bytes)  # small files: several can come with the header's first recv
    pipe = _splice_pipe()
    view = memoryview(bytearray(STREAM_BUF)) if pipe is None else None
    try:
        for rel, size in files:
            fd = peer_files.open_new(base, rel)
            try:
                left = size
                if len(early) and left:
                    piece, early = early[:left], early[left:]
                    _write_all(fd, piece)
                    left -= len(piece)
                while left > 0:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TransferError(f"transfer {tid}: not complete by its deadline ({left} bytes of "
                                            f"{rel} missing)")
                    _kernel_timeouts(conn, remaining)
                    try:
                        if pipe is not None:
                            n, spliced = _splice_some(conn, pipe, fd, min(left, _PIPE_BYTES))
                            if not spliced:  # a socket or file system without splice: recv from here on
                                _close_pipe(pipe)
                                pipe, view = None, memoryview(bytearray(STREAM_BUF))
                                if n < 0:
                                    continue
                        else:
                            assert view is not None
                            n = conn.recv_into(view, min(left, STREAM_BUF), socket.MSG_WAITALL)
                            _write_all(fd, view[:n])
                    except OSError as e:
                        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):  # SO_RCVTIMEO: the deadline came
                            raise TransferError(f"transfer {tid}: not complete by its deadline ({left} bytes of "
                                                f"{rel} missing)") from None
                        raise TransferError(f"transfer {tid}: receiving {rel} failed ({e})") from None
                    if not n:
                        raise TransferError(f"transfer {tid}: the sender stopped {left} bytes short in {rel}")
                    left -= n
            finally:
                os.close(fd)
    finally:
        if pipe is not None:
            _close_pipe(pipe)


_PIPE_BYTES = 1 << 20  # the default /proc/sys/fs/pipe-max-size


def _splice_some(conn: socket.socket, pipe: tuple[int, int], fd: int, want: int) -> tuple[int, bool]:
    """Up to ``want`` bytes socket -> pipe -> ``fd``. Returns (bytes moved, spliced);
    (-1, False) when the socket cannot splice (nothing was read), (n, False) when the
    file cannot: the n bytes already in the pipe were copied by read/write."""
    try:
        n = os.splice(conn.fileno(), pipe[1], want)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return -1, False
    moved = 0
    while moved < n:
        try:
            moved += os.splice(pipe[0], fd, n - moved)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            while moved < n:
                chunk = os.read(pipe[0], n - moved)
                _write_all(fd, chunk)
                moved += len(chunk)
            return n, False
    return n, True


def _close_pipe(pipe: tuple[int, int]) -> None:
    os.close(pipe[0])
    os.close(pipe[1])


def _splice_pipe() -> tuple[int, int] | None:
    if not hasattr(os, "splice"):
        return None
    r, w = os.pipe()
    try:
        import fcntl

        fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)
    except OSError:  # a lower pipe-max-size: splice then moves 64 KiB at a time, still correct
        pass
    return r, w


def _write_all(fd: int, data) -> None:
    data = memoryview(data)
    while len(data):
        data = data[os.write(fd, data):]
