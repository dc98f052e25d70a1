"""Peer transfer of replica checkpoints between nodes, through the job's store.

Nodes have their own disks. When the restore decision names a step whose
replica of a shard this node lacks, the agent fetches it from a node that has
it before its workers start, so ``get_checkpoint_path()`` finds it locally.

Transport: the coordination store (the rendezvous endpoint's TCPStore, see
``rdzv``), under the job's secret token namespace: no new listening port, and
only holders of the token can name the keys. Files move in chunks with a
bounded window (the store holds at most ``WINDOW`` chunks of one transfer at
a time; the reader deletes each chunk once written to disk).

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
import hmac
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from jitckpt import layout
from jitckpt.report import namespace

CHUNK = 4 << 20
WINDOW = 4
# Test hook: a node whose agent has this set corrupts what it serves (proves
# that a corrupted transfer is detected and retried from another source).
CORRUPT_ENV = "JITCKPT_TEST_CORRUPT_TRANSFER"


class TransferError(RuntimeError):
    pass


def _k(token: str, *parts: object) -> str:
    return "/".join([namespace(token), "xfer", *map(str, parts)])


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
        self._corrupt = bool(os.environ.get(CORRUPT_ENV))
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
            store.set(_k(self._token, "req", self._node, seq), json.dumps({"stop": True}))
        except Exception:
            pass  # the store is gone: the thread's wait fails on its own
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping:
            key = _k(self._token, "req", self._node, self._seq)
            try:
                self._store.wait([key], timedelta(seconds=3600))
                req = json.loads(self._store.get(key))
            except Exception:  # timeout, or the store went away with the job
                if self._stopping or not self._alive():
                    return
                continue
            self._seq += 1
            if req.get("stop"):
                return
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
    sizes = [(rel, path.stat().st_size) for rel, path in files]
    store.set(_k(token, "data", tid, "meta"), json.dumps({"ok": True, "files": sizes}))
    n = sent = 0
    for rel, path in files:
        with open(path, "rb") as fh:
            while True:
                data = fh.read(CHUNK)
                if not data:
                    break
                if n >= WINDOW:
                    try:
                        store.wait([_k(token, "data", tid, "ack", n - WINDOW)], timedelta(seconds=ack_timeout_s))
                    except Exception:
                        raise TransferError(f"the receiver took nothing more within {ack_timeout_s:.0f}s "
                                            f"({sent} bytes sent)") from None
                if corrupt is not None and corrupt(rel):
                    corrupt = None
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                store.set(_k(token, "data", tid, "c", n), data)
                sent += len(data)
                n += 1
    return sent


def send_failed(store, token: str, tid: str, why: str) -> None:
    """Tell the receiver of ``tid`` that nothing will come, and why."""
    store.set(_k(token, "data", tid, "meta"), json.dumps({"ok": False, "why": why}))


def wait_meta(store, token: str, tid: str, timeout_s: float) -> dict:
    """The sender's announcement of ``tid``; TransferError if it refused or never came."""
    try:
        store.wait([_k(token, "data", tid, "meta")], timedelta(seconds=timeout_s))
    except Exception:
        raise TransferError(f"did not answer within {timeout_s:.0f}s") from None
    meta = json.loads(store.get(_k(token, "data", tid, "meta")))
    if not meta.get("ok"):
        raise TransferError(f"refused: {meta.get('why')}")
    return meta


def recv_files(store, token: str, tid: str, meta: dict, place: Callable[[str], Path], timeout_s: float) -> None:
    """Receive what :func:`send_files` announced in ``meta`` into ``place(name)`` (a new
    file each, 0600, fsynced), acknowledging and deleting every chunk."""
    wait = timedelta(seconds=timeout_s)
    n = 0

    def read(rel: str, left: int) -> bytes:
        nonlocal n
        key = _k(token, "data", tid, "c", n)
        try:
            store.wait([key], wait)
        except Exception:
            raise TransferError(f"chunk {n} of {rel} did not come within {timeout_s:.0f}s") from None
        data = store.get(key)
        store.delete_key(key)
        store.set(_k(token, "data", tid, "ack", n), b"")
        n += 1
        return data

    _write_files(meta["files"], place, read)


def _write_files(files: list, place: Callable[[str], Path], read: Callable[[str, int], bytes]) -> None:
    """Each (name, size) of ``files`` into a new file ``place(name)`` (0600, fsynced),
    its bytes from ``read(name, bytes left)``."""
    for rel, size in files:
        dest = place(rel)
        layout.makedirs_private(dest.parent)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, layout.FILE_MODE)
        with os.fdopen(fd, "wb") as out:
            left = size
            while left > 0:
                data = read(rel, left)
                out.write(data)
                left -= len(data)
            out.flush()
            os.fsync(out.fileno())


def fetch(store, token: str, *, source: dict, step: int, shard: str, root: Path,
          timeout_s: float = 120.0) -> Path:
    """Copy ``source``'s replica of (step, shard) into ``root``; return its path."""
    tid = uuid.uuid4().hex
    seq = store.add(_k(token, "req", source["node_id"], "n"), 1)
    store.set(_k(token, "req", source["node_id"], seq),
              json.dumps({"id": tid, "step": step, "shard": shard, "rank": source["rank"]}))
    final = layout.replica_dir(root, step, shard, int(source["rank"]))
    layout.makedirs_private(final.parent)
    tmp = final.parent / f".tmp-rank-{source['rank']}-fetch-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp, layout.DIR_MODE)
    try:
        try:
            meta = wait_meta(store, token, tid, timeout_s)
        except TransferError as e:
            raise TransferError(f"node {source['node_id']} {e}") from None
        recv_files(store, token, tid, meta, lambda rel: tmp / rel, timeout_s)
        got = hashlib.sha256((tmp / layout.MANIFEST).read_bytes()).hexdigest()
        if got != source["manifest_sha256"]:
            raise TransferError(f"manifest from node {source['node_id']} does not match the one it announced")
        checked = layout.verify(tmp, None)
        if not isinstance(checked, layout.Replica) or checked.step != step or checked.shard != shard:
            raise TransferError(f"replica from node {source['node_id']} failed verification: {checked}")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        layout.fsync_dir(final.parent)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
# the store; the sender connects and sends one JSON header line, {"token", "tid",
# "files": [[name, size], ...]}, then the files' bytes back to back. A connection whose
# token or transfer id is not the awaited one is closed and the wait goes on.

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
    sec = max(int(timeout_s), 1)
    tv = sec.to_bytes(8, "little", signed=True) + (0).to_bytes(8, "little", signed=True)  # struct timeval
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def listen(addr: str) -> socket.socket:
    """A listening socket on the job's address of this node (never a wildcard)."""
    srv = socket.create_server((addr, 0), family=socket.AF_INET6 if ":" in addr else socket.AF_INET, backlog=8)
    srv.settimeout(1.0)
    return srv


def send_stream(addr: str, port: int, token: str, tid: str, files: list[tuple[str, Path]],
                timeout_s: float) -> int:
    """Send ``files`` (name, path) to a receiver's :func:`recv_stream`; returns bytes sent."""
    sizes = [(rel, path.stat().st_size) for rel, path in files]
    header = json.dumps({"token": token, "tid": tid, "files": sizes}).encode() + b"\n"
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


def _read_header(conn: socket.socket, limit: int = 1 << 16) -> tuple[bytes, bytes]:
    """The header line and whatever of the files came with it."""
    got = b""
    while b"\n" not in got:
        if len(got) > limit:
            raise ValueError("header line too long")
        piece = conn.recv(limit)
        if not piece:
            raise ValueError("closed before the header line")
        got += piece
    line, _, rest = got.partition(b"\n")
    return line, rest


def recv_stream(srv: socket.socket, token: str, tid: str, place: Callable[[str], Path],
                timeout_s: float) -> list[tuple[str, int]]:
    """Accept the sender of ``tid`` on ``srv`` and write its files to ``place(name)``
    (new files, 0600). Returns the (name, size) list it announced.

    Not fsynced: these are CRIU images, restored at once and deleted; a node that
    crashes meanwhile fails the migration whatever is on its disk. An fsync would
    write every page to a disk-backed jit dir (0.6 s for 240 MB here) and the
    deletion right after the restore would have made that write useless."""
    deadline = time.monotonic() + timeout_s
    while True:
        if time.monotonic() > deadline:
            raise TransferError(f"no sender of transfer {tid} within {timeout_s:.0f}s")
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        with conn:
            _kernel_timeouts(conn, max(deadline - time.monotonic(), 1.0))
            try:
                line, rest = _read_header(conn)
                head = json.loads(line)
            except (ValueError, OSError):
                continue
            if not (isinstance(head, dict) and hmac.compare_digest(str(head.get("token", "")), token)
                    and head.get("tid") == tid):
                continue  # not ours: wrong job, wrong transfer, or a stray connection
            _recv_files(conn, tid, head["files"], rest, place)
            return [(rel, size) for rel, size in head["files"]]


def _recv_files(conn: socket.socket, tid: str, files: list, early_bytes: bytes, place: Callable[[str], Path]) -> None:
    """The announced ``files`` from ``conn`` into new files (0600, unsynced: see
    recv_stream): first what came with the header, then the socket's bytes moved by
    splice() through a pipe (no copy through Python, one GIL hand-over per MiB), or,
    where splice is missing, recv(MSG_WAITALL) of STREAM_BUF bytes at a time."""
    early = memoryview(early_bytes)  # small files: several can come with the header's first recv
    pipe = _splice_pipe()
    view = memoryview(bytearray(STREAM_BUF)) if pipe is None else None
    try:
        for rel, size in files:
            dest = place(rel)
            layout.makedirs_private(dest.parent)
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, layout.FILE_MODE)
            try:
                left = size
                if len(early) and left:
                    piece, early = early[:left], early[left:]
                    _write_all(fd, piece)
                    left -= len(piece)
                while left > 0:
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
