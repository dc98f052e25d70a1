"""Moves a rank whose device died while its process lived (issue 13 item 4, paper §4.3).

The shim (``JITCKPT_ON_HANG=recover`` + ``JITCKPT_ON_DEVICE_LOSS=migrate``,
``libintercept/src/shim_device.c``) parks such a process at a consistent
point: its communicators aborted, its device given up (no device memory in
its address space), its store connection closed, its minibatch's replay log
in host memory. It then writes ``device-lost-<rank>-<epoch>.json`` into its
``JITCKPT_DEVICE_DIR`` and polls for ``device-resume-<rank>-<epoch>.json``.
The other ranks wait in place inside the same recovery epoch.

This module is the other half: :func:`pending` finds requests, :func:`move`
dumps the process with CRIU (images checksummed), restores it where a healthy
device is (``python -m jitrun.criu restore``: the restored process is that
helper's child and its exit status the helper's), and :func:`answer` writes the
resume file with the new device's identity. After that the shim attaches the
device, re-makes every allocation at its old address, joins the epoch, gets
its buffers from a replica and replays (or, for a fault in the optimizer step,
takes the replica's post-update state). When anything here fails the process
is never answered: the shim gives up after ``JITCKPT_RECOVER_TIMEOUT`` and
every rank falls back to the JIT checkpoint path.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import criu

LOST = "device-lost-{rank}-{epoch}.json"
RESUME = "device-resume-{rank}-{epoch}.json"


@dataclass(frozen=True)
class Request:
    """One parked process: ``rank``, host ``pid`` (as the shim saw it: inside
    its PID namespace it is 1, so :func:`move` takes the host PID from the
    caller), recovery ``epoch``, the lost ``device``."""

    rank: int
    pid: int
    epoch: int
    device: str
    path: Path


def pending(control_dir: str | os.PathLike) -> list[Request]:
    """Requests in ``control_dir`` not answered yet, oldest epoch first."""
    d = Path(control_dir)
    out = []
    for p in sorted(d.glob("device-lost-*-*.json")):
        try:
            j = json.loads(p.read_text())
            req = Request(int(j["rank"]), int(j["pid"]), int(j["epoch"]), str(j["device"]), p)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{p}: not a device-lost request written by the shim ({e})") from None
        if not (d / RESUME.format(rank=req.rank, epoch=req.epoch)).exists():
            out.append(req)
    return sorted(out, key=lambda r: (r.epoch, r.rank))


def answer(control_dir: str | os.PathLike, req: Request, new_device: str) -> Path:
    """The resume file (atomic, 0600): the parked process attaches ``new_device``."""
    if not new_device or '"' in new_device or len(new_device) >= 64:
        raise ValueError(f"device identity {new_device!r}: give a non-empty name under 64 characters, no quotes")
    path = Path(control_dir) / RESUME.format(rank=req.rank, epoch=req.epoch)
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"uuid": new_device, "t": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


@dataclass
class Moved:
    """A restored process: ``helper`` is the restore helper (wait on it: it
    exits as the process does), ``pid`` the process's new host PID."""

    helper: subprocess.Popen
    pid: int
    dump_s: float
    restore_s: float
    image_bytes: int


def move(req: Request, host_pid: int, images_dir: str | os.PathLike, new_device: str,
         control_dir: str | os.PathLike, *, restore_timeout: float = 60.0) -> Moved:
    """Dump the parked process (host PID ``host_pid``; the dump ends it), restore
    it from ``images_dir`` and answer it with ``new_device``. Raises
    :class:`jitrun.criu.CriuError` when the dump or the restore fails (the
    process is then not answered and falls back on its own)."""
    d = criu.dump(host_pid, images_dir, tcp_established=False)
    t0 = time.monotonic()
    helper = subprocess.Popen(criu.restore_and_wait_command(images_dir), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = helper.stdout.readline().split() if helper.stdout else []
    if len(line) < 2 or line[0] != "RESTORED":
        helper.wait(timeout=restore_timeout)
        raise criu.CriuError(f"restore of rank {req.rank} from {images_dir} failed: {' '.join(line) or 'no output'}")
    moved = Moved(helper, int(line[1]), d.seconds, time.monotonic() - t0, d.image_bytes)
    answer(control_dir, req, new_device)
    return moved
