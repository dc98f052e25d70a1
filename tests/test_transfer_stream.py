"""The direct image stream between agents (launcher/peers/transfer.py send_stream / recv_stream):
what jitrun migrate moves a worker's CRIU images with."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from jitrun.peers import stream, transfer

TOKEN = "t0ken-0123456789abcdef"


def _files(tmp: Path) -> list[tuple[str, Path]]:
    src = tmp / "src"
    src.mkdir()
    spec = {"empty": b"", "one": b"x", "small.json": b'{"a": 1}\n', "big.img": os.urandom((20 << 20) + 3),
            "tail": os.urandom(70_000)}  # several small files arrive with the header's first recv
    out = []
    for name, data in spec.items():
        (src / name).write_bytes(data)
        out.append((f"img/{name}", src / name))
    return out


def _receive(srv, tid, dest: Path, result: dict, files: list[tuple[str, int]]) -> None:
    try:
        result["got"] = stream.recv_stream(srv, TOKEN, tid, files, dest, 20.0)
    except Exception as e:  # noqa: BLE001 (reported to the test)
        result["error"] = e


def _splice_refused_by(side: str):
    real = os.splice

    def splice(src, dst, count, *a, **kw):
        # the pipe's ends are the only fds that are not the socket or the file
        if (side == "socket" and stat.S_ISSOCK(os.fstat(src).st_mode)) or \
                (side == "file" and stat.S_ISREG(os.fstat(dst).st_mode)):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(src, dst, count, *a, **kw)
    return splice


@pytest.mark.parametrize("splice", ["yes", "missing", "socket-refuses", "file-refuses"])
def test_stream_delivers_every_file_and_skips_strangers(tmp_path, monkeypatch, splice):
    if splice == "missing":  # a Python or kernel without splice(): the recv(MSG_WAITALL) path
        monkeypatch.setattr(stream, "_splice_pipe", lambda: None)
    elif splice != "yes":  # EINVAL from splice (socket or file system without it): recv from there on
        monkeypatch.setattr(os, "splice", _splice_refused_by(splice.split("-")[0]))
    files = _files(tmp_path)
    srv = stream.listen("127.0.0.1")
    port = srv.getsockname()[1]
    dest = tmp_path / "dst"
    result: dict = {}
    sizes = [(rel, p.stat().st_size) for rel, p in files]
    th = threading.Thread(target=_receive, args=(srv, "tid-1", dest, result, sizes))
    th.start()
    try:
        # a header sealed under another token, one for another transfer, and one naming other
        # files: closed, the wait goes on
        for head in (stream._header("another-token-0123456789", "tid-1", sizes),
                     stream._header(TOKEN, "tid-other", sizes), stream._header(TOKEN, "tid-1", sizes[:1])):
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(json.dumps(head).encode() + b"\n")
                assert c.recv(1) == b""  # the receiver hung up on it
        sent = stream.send_stream("127.0.0.1", port, TOKEN, "tid-1", files, timeout_s=20.0)
        th.join(30)
    finally:
        srv.close()
    assert "error" not in result, result
    assert sent == sum(p.stat().st_size for _, p in files)
    assert result["got"] == [(rel, p.stat().st_size) for rel, p in files]
    for rel, p in files:
        got = dest / rel
        assert got.read_bytes() == p.read_bytes(), rel
        assert got.stat().st_mode & 0o777 == 0o600


def test_sender_that_stops_short_is_an_error(tmp_path):
    srv = stream.listen("127.0.0.1")
    port = srv.getsockname()[1]
    result: dict = {}
    th = threading.Thread(target=_receive, args=(srv, "tid-2", tmp_path / "dst", result, [("img/a", 1000)]))
    th.start()
    try:
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(json.dumps(stream._header(TOKEN, "tid-2", [("img/a", 1000)])).encode() + b"\n")
            c.sendall(b"y" * 10)
        th.join(30)
    finally:
        srv.close()
    assert isinstance(result.get("error"), transfer.TransferError)
    assert "990 bytes short in img/a" in str(result["error"])


def test_unreachable_receiver_is_a_transfer_error(tmp_path):
    srv = stream.listen("127.0.0.1")
    port = srv.getsockname()[1]
    srv.close()
    (tmp_path / "f").write_bytes(b"z")
    with pytest.raises(transfer.TransferError, match="streaming to 127.0.0.1"):
        stream.send_stream("127.0.0.1", port, TOKEN, "tid-3", [("img/f", tmp_path / "f")], timeout_s=5.0)


def test_port_facts_name_who_listens():
    """What a store connection that timed out adds to its error (transfer.connect_store):
    who listens on the port and its other sockets, so a job that ends on it explains itself."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(1)
    peer = socket.create_connection(mute.getsockname())  # completed by the kernel, never accepted
    try:
        port = mute.getsockname()[1]
        facts = transfer.port_facts(port)
        assert f"port {port}: listening pid {os.getpid()} on 127.0.0.1" in facts, facts
        assert "ESTABLISHED" in facts and f"this process {os.getpid()}" in facts, facts
    finally:
        peer.close()
        mute.close()
    assert "listening nobody" in transfer.port_facts(port)
    # and what a store connection that timed out raises (nobody listens there any more)
    import torch.distributed as dist

    with pytest.raises(dist.DistNetworkError, match=f"port {port}: listening nobody"):
        transfer.connect_store("127.0.0.1", port, timeout_s=1.0)
