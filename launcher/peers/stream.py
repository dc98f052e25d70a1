"""The bulk image stream between two agents: one TCP connection from the
source agent to a listener on the target's job address, a header sealed under
the job token naming the transfer and its files (name, size), then the bytes
spliced into place. Used by migration (CRIU images, the worker's output file)
and by the restore path's replica fetch (``transfer``).

The listener reads every connection's header as it comes (non-blocking), so a
peer that connects and sends nothing delays no real sender; names are checked
(``peer_files``) and sizes come from the receiver's own list; one overall
deadline per transfer. Errors raise ``TransferError``.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import socket
import time
from pathlib import Path

from jitckpt.wire import auth

from . import peer_files


class TransferError(RuntimeError):
    """A transfer between agents failed or was refused (the store's chunks or this stream)."""


# Through the store every byte would pass the rendezvous host's process twice. The
# receiver listens on its node's job address (--local-addr) and announces the port in
# the store; the sender connects and sends one JSON header line, {"tid", "files":
# [[name, size], ...], "mac"} (the MAC under the job token, never the token), then the
# files' bytes back to back. The receiver knows the file list already (from the sealed
# request, or for a replica from the source's sealed announcement); a connection whose
# header does not verify, names another transfer or another list is closed and the
# wait goes on. Headers are read from every connection at once, so an idle one cannot
# hold the listener, and the whole transfer has one deadline, so a sender that
# trickles is cut off at it.

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


def connect(addr: str, port: int, timeout_s: float) -> socket.socket:
    """A connection to a receiver's listener, made within ``timeout_s``; TransferError
    when it cannot be made (nothing listens there, a firewall, a wrong address)."""
    try:
        return socket.create_connection((addr, port), timeout=timeout_s)
    except OSError as e:
        raise TransferError(f"streaming to {addr}:{port} failed: cannot connect ({e})") from None


def send_stream(addr: str, port: int, token: str, tid: str, files: list[tuple[str, Path]],
                timeout_s: float) -> int:
    """Send ``files`` (name, path) to a receiver's :func:`recv_stream`; returns bytes sent."""
    return send_on(connect(addr, port, timeout_s), token, tid, files, timeout_s)


def send_on(conn: socket.socket, token: str, tid: str, files: list[tuple[str, Path]], timeout_s: float) -> int:
    """Send ``files`` (name, path) over ``conn`` (from :func:`connect`, closed here) to a
    receiver's :func:`recv_stream` or :class:`Incoming`; returns bytes sent. Every send
    and the final wait for the receiver stall at most ``timeout_s``."""
    with conn:
        try:
            host, port = conn.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "the receiver"
        try:
            sizes = [(rel, path.stat().st_size) for rel, path in files]
            _kernel_timeouts(conn, timeout_s)
            conn.sendall(json.dumps(_header(token, tid, sizes)).encode() + b"\n")
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
            raise TransferError(f"streaming to {peer} failed: {e}") from None


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
                if not _is_ours(line, token, tid, want):
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


def _is_ours(line: bytes, token: str, tid: str, want: dict) -> bool:
    """The header line names transfer ``tid`` and exactly the expected files, sealed under the job token."""
    try:
        head = json.loads(line)
    except ValueError:
        return False
    return (isinstance(head, dict) and head.get("tid") == tid and head.get("files") == want["files"]
            and set(head) == set(want) and auth.of(token).check_mac(
                f"stream/{tid}", {"tid": tid, "files": want["files"]}, head.get("mac")))


def recv_stream(srv: socket.socket, token: str, tid: str, files: list[tuple[str, int]], base: Path,
                timeout_s: float) -> list[tuple[str, int]]:
    """Accept the sender of ``tid`` on ``srv`` and write ``files`` (the list the receiver
    expects, names and sizes already checked with ``peer_files``) to new files under
    ``base`` (0600), all within ``timeout_s``. Returns ``files``.

    Not fsynced: these are CRIU images, restored at once and deleted; a node that
    crashes meanwhile fails the migration whatever is on its disk. An fsync would
    write every page to a disk-backed jit dir (0.6 s for 240 MB here) and the
    deletion right after the restore would have made that write useless."""
    with Incoming(srv, token, tid, files, time.monotonic() + timeout_s) as inc:
        inc.take(files, base)
    return files


class Incoming:
    """The sender of transfer ``tid`` accepted on ``srv`` (its header announcing
    ``files``, as for :func:`recv_stream`), its files then taken in parts, in the
    announced order, so that the receiver can check the first ones (a manifest)
    before it writes the rest. One ``deadline`` (monotonic) for everything; ``sync``:
    fsync every file (what must survive a crash of this node)."""

    def __init__(self, srv: socket.socket, token: str, tid: str, files: list[tuple[str, int]], deadline: float,
                 *, sync: bool = False) -> None:
        self._conn, rest = _accept_sender(srv, token, tid, files, deadline)
        self._early = memoryview(rest)
        self._tid, self._deadline, self._sync = tid, deadline, sync

    def take(self, files: list[tuple[str, int]], base: Path) -> None:
        """The next ``files`` of the announced list into new files under ``base``."""
        self._early = _recv_files(self._conn, self._tid, files, self._early, base, self._deadline, self._sync)

    def close(self) -> None:
        self._conn.close()  # the sender's final wait ends here

    def __enter__(self) -> Incoming:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _recv_files(conn: socket.socket, tid: str, files: list, early: memoryview, base: Path, deadline: float,
                sync: bool) -> memoryview:
    """The announced ``files`` from ``conn`` into new files (0600, fsynced if ``sync``):
    first what came before (``early``; returns what of it is left), then the socket's
    bytes moved by splice() through a pipe (no copy through Python, one GIL hand-over
    per MiB), or, where splice is missing, recv(MSG_WAITALL) of STREAM_BUF bytes at a
    time. Every read waits at most until ``deadline`` (monotonic)."""
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
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        if pipe is not None:
            _close_pipe(pipe)
    return early


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
