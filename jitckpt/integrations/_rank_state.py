"""A rank's own small state at the last minibatch start (RNG states and a few counters), kept
in a node-local file that outlives the process.

A JIT checkpoint is written by the ranks that are still alive; a rank that died (SIGKILL,
SIGSTOP) wrote none, and after the restart it restores from a replica of another rank. For
the model and optimizer that is exact (the replicas are equal), but some state is the rank's
own: its RNG streams and, in Hugging Face's Trainer, the loss it summed since the last log.
Each rank records it at every minibatch start, so the page cache keeps it past the process's
death; a restarted rank on the same node reads its own, for the step restored.

Every minibatch start pays for this, so the record is written in place into a memory-mapped
file (no system call, no allocation of the file's size): two slots used in turn, each a header
(magic, sequence number, length, CRC-32 of sequence number and body) and a body (a JSON head
with the counters, then the RNG states' raw bytes). A process killed while writing a slot
leaves that slot failing its CRC, and the other slot, the record before, is still whole: a
torn record is never used. No pickle: a file in the job directory is data, never code. 0600
in a 0700 directory. No fsync: it only has to survive the process, and a node that lost its
page cache lost the ranks' other state too.

One writer per file (its rank's main thread); read only by the restarted rank, before that
rank writes its first record.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from array import array
from pathlib import Path
from typing import Any

import torch

_MAGIC = b"JITRANK2"
_FILE = struct.Struct("<8sQ")  # magic, slot size
_SLOT = struct.Struct("<8sQII")  # magic, seq, body length, crc32(seq, body)
_MIN_SLOT = 64 << 10


def path_for(root: Path, rank: int) -> Path:
    return root / "rank-state" / f"rank-{rank}.bin"


def _blob(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().numpy()).cast("B")


class _Encoder:
    """Builds a record's body as buffers, without copying the RNG states and without JSON for
    what changes at every minibatch: the body is a JSON head (the layout: the counters' names
    and kinds, the counters that are not numbers, the blobs' sizes), the numbers packed by that
    layout, then the blobs. The head is re-encoded only when the layout or those other counters
    change, and random's 625-word state is re-packed only when it changed (few loops draw
    from ``random``)."""

    def __init__(self) -> None:
        self.key: Any = None
        self.head = b""
        self.fmt = struct.Struct("<")
        self.random: tuple = ()
        self.random_blob = memoryview(b"")

    def parts(self, job: str, step: int, rng: dict, scalars: dict[str, Any]) -> list[Any]:
        nums = {k: v for k, v in scalars.items() if type(v) is float or (type(v) is int and -2**63 <= v < 2**63)}
        other = {k: v for k, v in scalars.items() if k not in nums}
        version, state, gauss = rng["random"]
        if state != self.random:
            self.random, self.random_blob = state, memoryview(array("I", state)).cast("B")
        blobs = [_blob(rng["torch"]), self.random_blob]
        values = [step, *nums.values(), gauss is not None, gauss or 0.0]
        np_meta = None
        if "numpy" in rng:
            name, keys, pos, has_gauss, g = rng["numpy"]
            blobs.append(_blob(keys))
            values += [pos, has_gauss, g]
            np_meta = [name, str(keys.dtype).split(".")[-1]]
        cuda = [_blob(t) for t in rng.get("cuda", [])]
        blobs += cuda
        layout = [[k, "q" if type(v) is int else "d"] for k, v in nums.items()]
        key = (job, layout, other, version, np_meta, [len(b) for b in blobs])
        if key != self.key:
            self.key = key
            self.head = json.dumps({"job": job, "layout": layout, "other": other, "random": version,
                                    "numpy": np_meta, "cuda": len(cuda), "sizes": key[-1]}).encode()
            self.fmt = struct.Struct("<q" + "".join(t for _, t in layout) + "?d" + ("qqd" if np_meta else ""))
        return [len(self.head).to_bytes(8, "little"), self.head, self.fmt.pack(*values), *blobs]


def _decode(body: bytes, job: str, step: int) -> dict | None:
    n = int.from_bytes(body[:8], "little")
    head = json.loads(body[8:8 + n])
    if head["job"] != job:
        return None
    fmt = struct.Struct("<q" + "".join(t for _, t in head["layout"]) + "?d" + ("qqd" if head["numpy"] else ""))
    values = list(fmt.unpack_from(body, 8 + n))
    if values[0] != step:
        return None
    scalars = {k: values[1 + i] for i, (k, _) in enumerate(head["layout"])}
    scalars.update(head["other"])
    rest = values[1 + len(head["layout"]):]
    blobs, off = [], 8 + n + fmt.size
    for size in head["sizes"]:
        blobs.append(body[off:off + size])
        off += size

    def tensor(b: bytes, dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).clone()

    rng: dict[str, Any] = {"torch": tensor(blobs[0], torch.uint8),
                           "random": (head["random"], tuple(array("I", blobs[1])), rest[1] if rest[0] else None)}
    if head["numpy"]:
        name, dtype = head["numpy"]
        rng["numpy"] = (name, tensor(blobs[2], getattr(torch, dtype)), rest[2], rest[3], rest[4])
    if head["cuda"]:
        rng["cuda"] = [tensor(b, torch.uint8) for b in blobs[len(blobs) - head["cuda"]:]]
    return {"rng": rng, "scalars": scalars}


class Writer:
    """This rank's file, mapped on its first record (the restarted rank reads the previous
    attempt's records first: nothing is changed before then)."""

    def __init__(self, path: Path) -> None:
        if not path.parent.is_dir():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.fchmod(self.fd, 0o600)
        self.mm: mmap.mmap | None = None
        self.enc = _Encoder()
        self.slot_size = 0
        self.seq = 0

    def _map(self, need: int) -> None:
        """A file of two slots, each at least ``need`` bytes (grown, never shrunk: a record
        larger than the slots, e.g. a CUDA device added, re-lays the file out once)."""
        size = max(_MIN_SLOT, self.slot_size)
        while size < need:
            size *= 2
        if self.mm is not None:
            self.mm.close()
        os.ftruncate(self.fd, _FILE.size + 2 * size)
        self.mm = mmap.mmap(self.fd, _FILE.size + 2 * size)
        self.mm[_FILE.size:] = bytes(2 * size)  # the old layout's slots are not this one's
        self.mm[:_FILE.size] = _FILE.pack(_MAGIC, size)
        self.slot_size = size

    def write(self, *, job: str, step: int, rng: dict, scalars: dict[str, Any]) -> None:
        parts = self.enc.parts(job, step, rng, scalars)
        n = sum(len(p) for p in parts)  # bytes, and memoryviews cast to bytes
        if n + _SLOT.size > self.slot_size:
            self._map(n + _SLOT.size)
        self.seq += 1
        seq = self.seq
        off = _FILE.size + (seq % 2) * self.slot_size
        mm, at = self.mm, off + _SLOT.size
        crc = zlib.crc32(seq.to_bytes(8, "little"))
        for p in parts:
            end = at + len(p)
            mm[at:end] = p
            crc = zlib.crc32(p, crc)
            at = end
        # the header last: until it is whole the slot's CRC fails, and the other slot holds
        # the previous record
        mm[off:off + _SLOT.size] = _SLOT.pack(_MAGIC, seq, n, crc)

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
        os.close(self.fd)


def _slots(data: bytes) -> list[tuple[int, bytes]]:
    """(seq, body) of each slot that passes its CRC."""
    if len(data) < _FILE.size:
        return []
    magic, size = _FILE.unpack_from(data)
    if magic != _MAGIC or size <= _SLOT.size or len(data) < _FILE.size + 2 * size:
        return []
    out = []
    for i in range(2):
        off = _FILE.size + i * size
        magic, seq, n, crc = _SLOT.unpack_from(data, off)
        body = data[off + _SLOT.size:off + _SLOT.size + n]
        whole = n <= size - _SLOT.size and zlib.crc32(body, zlib.crc32(seq.to_bytes(8, "little"))) == crc
        if magic == _MAGIC and whole:
            out.append((seq, body))
    return sorted(out, reverse=True)


def read(path: Path, *, job: str, step: int) -> dict | None:
    """{"rng": ..., "scalars": ...} written by this job for ``step`` (the newer of the two
    slots that has it), or None (absent, another job's or step's, or failing its CRC)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    for _seq, body in _slots(data):
        try:
            got = _decode(body, job, step)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error):
            continue
        if got is not None:
            return got
    return None
