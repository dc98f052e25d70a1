"""Watching a multi-node job from the host while it runs (scripts/bench_multinode.py): each
node's log as timestamped lines, and the TCP connections in a node's network namespace (nodes
as in tests/netns.py)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


class Tail:
    """New complete lines of a growing log file, timestamped when read."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path, self.pos, self.buf = name, path, 0, b""

    def read(self, final: bool = False) -> list[tuple[float, str, str]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        now = time.time()
        self.pos += len(data)
        *complete, self.buf = (self.buf + data).split(b"\n")
        if final and self.buf:
            complete.append(self.buf)
            self.buf = b""
        return [(now, self.name, raw.decode(errors="replace")) for raw in complete]


def established(node) -> list[tuple[int, str, int]]:
    """(local port, peer address, peer port) of every established TCP
    connection in ``node``'s network namespace."""
    cp = subprocess.run([*node.exec_prefix(), "ss", "-Htn", "state", "established"], capture_output=True,
                        text=True, check=False)
    out = []
    for row in cp.stdout.splitlines():
        cols = row.split()
        if len(cols) >= 4:
            local, peer = cols[-2], cols[-1]
            try:
                addr = peer.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")  # IPv4-mapped (dual stack)
                out.append((int(local.rsplit(":", 1)[1]), addr, int(peer.rsplit(":", 1)[1])))
            except (IndexError, ValueError):
                continue
    return out


def round_complete(node1, node0_addr: str, port: int) -> bool:
    """Node 1 talks to node 0 on a port other than the rendezvous endpoint's:
    its worker's process group (gloo pairs) is up, so the first rendezvous
    round is complete (a node arriving now cannot take part in it)."""
    return any(peer == node0_addr and port not in (lp, pp) for lp, peer, pp in established(node1))


def rdzv_connected(node, node0_addr: str, port: int) -> bool:
    """An agent on ``node`` holds a connection to the rendezvous endpoint."""
    return any(peer == node0_addr and pp == port for _, peer, pp in established(node))
