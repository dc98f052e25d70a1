"""A rank's status record, which its agent reads every tick without any
store traffic: a small memory-mapped file per rank in the jit dir (0700).

Written by the rank (the main thread's collective hooks, and the watcher
thread's heartbeat), read by the agent on the same node
(launcher/recovery/hang.py). Times are CLOCK_MONOTONIC, one clock for every
process of a node.

Fields: the rank's PID and attempt (a record of an earlier attempt is not
this one's); ``seq``, the collectives the rank entered; ``steps``, its
minibatches done; ``wait_since``, when its current outermost collective wait
began (0: not waiting); ``bound_s``, the hang bound it learned
(jitckpt/hang/bound.py); ``delay_until``, the end of a delay the script
announced (``jitckpt.expect_delay``); ``heartbeat``, the watcher thread's last
beat (0: none yet): a rank that holds the GIL and never lets go stops beating.

The main thread's fields are written under a sequence lock (``gen`` odd while
writing), so a reader never takes half of an update; the heartbeat has its
own slot and one writer.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"JHS1"
_HEAD = struct.Struct("<4sII")  # magic, pid, attempt
_GEN = struct.Struct("<Q")
_BODY = struct.Struct("<QQdddd")  # seq, steps, wait_since, bound_s, delay_until, typical_s
_BEAT = struct.Struct("<d")
_GEN_AT = _HEAD.size
_BODY_AT = _GEN_AT + _GEN.size
_BEAT_AT = _BODY_AT + _BODY.size
SIZE = _BEAT_AT + _BEAT.size
DIRNAME = "status"


def path_of(root: Path, rank: int) -> Path:
    return Path(root) / DIRNAME / f"rank-{int(rank)}"


@dataclass(frozen=True)
class Status:
    pid: int
    attempt: int
    seq: int
    steps: int
    wait_since: float
    bound_s: float
    delay_until: float
    typical_s: float
    heartbeat: float

    def waiting_s(self, now: float) -> float:
        """How long the rank has been in its current collective (0: not in one)."""
        return now - self.wait_since if self.wait_since > 0 else 0.0


class StatusWriter:
    """The rank's side. Not thread-safe for the body: the main thread writes
    it; ``beat`` may come from any one other thread. Raises OSError when the
    record cannot be created with its blocks allocated (a full disk)."""

    def __init__(self, root: Path, rank: int, attempt: int) -> None:
        p = path_of(root, rank)
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # the blocks allocated now (not a sparse ftruncate): a store into a mapped page that the
            # disk cannot back is a SIGBUS, which on a full tmpfs would end the rank
            os.posix_fallocate(fd, 0, SIZE)
            self._m = mmap.mmap(fd, SIZE)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        _HEAD.pack_into(self._m, 0, MAGIC, os.getpid() & 0xFFFFFFFF, attempt)
        self._gen = 0
        self.seq = 0
        self.steps = 0
        self.wait_since = 0.0
        self.bound_s = 0.0
        self.delay_until = 0.0
        self.typical_s = 0.0
        self.flush()
        _BEAT.pack_into(self._m, _BEAT_AT, 0.0)  # 0: no heartbeat thread (yet): the agent cannot call it deaf
        os.replace(tmp, p)  # the agent never sees a record without its header

    def flush(self) -> None:
        m = self._m
        self._gen += 1
        _GEN.pack_into(m, _GEN_AT, self._gen)
        _BODY.pack_into(m, _BODY_AT, self.seq, self.steps, self.wait_since, self.bound_s, self.delay_until,
                        self.typical_s)
        self._gen += 1
        _GEN.pack_into(m, _GEN_AT, self._gen)

    def beat(self) -> None:
        _BEAT.pack_into(self._m, _BEAT_AT, time.monotonic())


class StatusReader:
    """The agent's side: one open mapping per rank, re-opened when the file is replaced."""

    def __init__(self, root: Path, rank: int) -> None:
        self._path = path_of(root, rank)
        self._m: mmap.mmap | None = None
        self._ino: int | None = None

    def _open(self) -> mmap.mmap | None:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        if self._m is not None and st.st_ino == self._ino:
            return self._m
        self.close()
        try:
            fd = os.open(self._path, os.O_RDONLY)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size < SIZE:
                return None
            self._m = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
            self._ino = st.st_ino
        finally:
            os.close(fd)
        return self._m

    def read(self) -> Status | None:
        """The record, or None (none yet, not one of ours, or being written
        every time it was looked at)."""
        m = self._open()
        if m is None:
            return None
        magic, pid, attempt = _HEAD.unpack_from(m, 0)
        if magic != MAGIC:
            return None
        for _ in range(100):
            g1 = _GEN.unpack_from(m, _GEN_AT)[0]
            body = _BODY.unpack_from(m, _BODY_AT)
            g2 = _GEN.unpack_from(m, _GEN_AT)[0]
            if g1 == g2 and not g1 & 1:
                return Status(pid, attempt, *body, _BEAT.unpack_from(m, _BEAT_AT)[0])
        return None

    def close(self) -> None:
        if self._m is not None:
            self._m.close()
        self._m = None
        self._ino = None
