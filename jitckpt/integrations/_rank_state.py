"""A rank's own small state at the last minibatch start (RNG states and a few counters), kept
in a node-local file that outlives the process.

A JIT checkpoint is written by the ranks that are still alive; a rank that died (SIGKILL,
SIGSTOP) wrote none, and after the restart it restores from a replica of another rank. For
the model and optimizer that is exact (the replicas are equal), but some state is the rank's
own: its RNG streams and, in Hugging Face's Trainer, the loss it summed since the last log.
Each rank rewrites this file at every minibatch start, so the page cache keeps it past the
process's death; a restarted rank on the same node reads its own, for the step restored.

The format is raw bytes with a JSON header and a SHA-256 of the whole (no pickle: a file in
the job directory is data, never code); a file that fails the check is not used. Written
with 0600 into a 0700 directory. No fsync: it only has to survive the
process, and a node that lost its page cache lost the ranks' other state too.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from pathlib import Path
from typing import Any

import torch

_MAGIC = b"JITRANK1"


def path_for(root: Path, rank: int) -> Path:
    return root / "rank-state" / f"rank-{rank}.bin"


def _encode_rng(snap: dict, meta: dict, blobs: list[bytes]) -> None:
    """``snap``: resume_data._portable's form (torch/cuda tensors, random's tuple, numpy's)."""
    def add(t: torch.Tensor) -> int:
        blobs.append(t.contiguous().view(torch.uint8).numpy().tobytes())
        return len(blobs) - 1

    version, state, gauss = snap["random"]
    rng: dict[str, Any] = {"torch": add(snap["torch"])}
    blobs.append(array("Q", state).tobytes())
    rng["random"] = [version, len(blobs) - 1, gauss]
    if "numpy" in snap:
        name, keys, pos, has_gauss, g = snap["numpy"]
        rng["numpy"] = [name, add(keys), pos, has_gauss, g]
    if "cuda" in snap:
        rng["cuda"] = [add(t) for t in snap["cuda"]]
    meta["rng"] = rng


def _decode_rng(rng: dict, blobs: list[bytes]) -> dict:
    def tensor(i: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(bytearray(blobs[i]), dtype=torch.uint8).view(dtype).clone()

    version, i, gauss = rng["random"]
    snap: dict[str, Any] = {"torch": tensor(rng["torch"], torch.uint8),
                            "random": (version, tuple(array("Q", blobs[i])), gauss)}
    if "numpy" in rng:
        name, k, pos, has_gauss, g = rng["numpy"]
        snap["numpy"] = (name, tensor(k, torch.int64), pos, has_gauss, g)
    if "cuda" in rng:
        snap["cuda"] = [tensor(k, torch.uint8) for k in rng["cuda"]]
    return snap


class Writer:
    """This rank's file, kept open: each minibatch start rewrites it with one ``pwrite`` at
    offset 0 (a write to a regular file is not cut short by the process's death, and the
    checksum covers a shorter record left over a longer one). ~10 KiB, tens of microseconds."""

    def __init__(self, path: Path) -> None:
        if not path.parent.is_dir():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)

    def write(self, *, job: str, step: int, rng: dict, scalars: dict[str, float | int | None]) -> None:
        os.pwrite(self.fd, encode(job=job, step=step, rng=rng, scalars=scalars), 0)

    def close(self) -> None:
        os.close(self.fd)


def encode(*, job: str, step: int, rng: dict, scalars: dict[str, float | int | None]) -> bytes:
    meta: dict[str, Any] = {"job": job, "step": step, "scalars": scalars}
    blobs: list[bytes] = []
    _encode_rng(rng, meta, blobs)
    meta["sizes"] = [len(b) for b in blobs]
    head = json.dumps(meta).encode()
    body = b"".join([len(head).to_bytes(8, "little"), head, *blobs])
    return _MAGIC + len(body).to_bytes(8, "little") + hashlib.sha256(body).digest() + body


def read(path: Path, *, job: str, step: int) -> dict | None:
    """{"rng": ..., "scalars": ...} written by this job for ``step``, or None (absent, another
    job's or step's, or failing its checksum)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    m = len(_MAGIC)
    size = int.from_bytes(data[m:m + 8], "little")
    body = data[m + 40:m + 40 + size]
    if not data.startswith(_MAGIC) or len(body) != size or hashlib.sha256(body).digest() != data[m + 8:m + 40]:
        return None
    n = int.from_bytes(body[:8], "little")
    try:
        meta = json.loads(body[8:8 + n])
        if meta.get("job") != job or meta.get("step") != step:
            return None
        blobs, off = [], 8 + n
        for size in meta["sizes"]:
            blobs.append(body[off:off + size])
            off += size
        return {"rng": _decode_rng(meta["rng"], blobs), "scalars": meta["scalars"]}
    except (ValueError, KeyError, TypeError, IndexError):
        return None
