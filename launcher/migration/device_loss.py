"""Moves a rank whose device died while its process lived (paper §4.3).

The shim (``JITCKPT_ON_HANG=recover`` + ``JITCKPT_ON_DEVICE_LOSS=migrate``,
``libintercept/src/shim_device.c``) parks such a process at a consistent
point: its communicators aborted, its device given up (no device memory in
its address space), its store connection closed, its minibatch's replay log
in host memory. It then writes ``device-lost-<rank>-<epoch>.json`` into its
``JITCKPT_DEVICE_DIR`` and polls for ``device-resume-<rank>-<epoch>.json``.
The other ranks wait in place inside the same recovery epoch.

This module is the other half, run by jitrun's agent on its main thread
(``JitAgent._on_device_lost``, every monitor tick, for its own ranks):
:func:`pending` finds requests; the scheduler hook is asked where the process
goes (``device_lost``; :func:`spare_devices` lists this node's unused healthy
devices for it); :func:`move` dumps the process with CRIU (images checksummed)
and restores it here on a spare device (``python -m jitrun.migration.criu restore``: the
restored process is that helper's child and its exit status the helper's), or
:func:`devices.watch.move_to_node` ships the images to another node's agent
(``migrate_agent.Target``), which restores it there; either way :func:`answer`
writes the resume file with the new device's identity. After that the shim
attaches the device, re-makes every allocation at its old address, joins the
epoch, gets its buffers from a replica and replays (or, for a fault in the
optimizer step, takes the replica's post-update state). When the process cannot
be moved, :func:`refuse` tells it so and every rank falls back to the JIT
checkpoint path at once; a process never answered (its agent gone) gives up
after ``JITCKPT_RECOVER_TIMEOUT``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import criu

LOST = "device-lost-{rank}-{epoch}.json"
RESUME = "device-resume-{rank}-{epoch}.json"


def control_dir(root: str | os.PathLike) -> Path:
    """Where this node's parked workers write their requests (``<jit dir>``: node-local)."""
    return Path(root) / "migrate" / "device"


def reset(control_dir: str | os.PathLike) -> None:
    """Before an attempt's workers start: no request or answer of an earlier attempt
    survives (epochs count from 1 again in new processes: an old answer would be
    taken for theirs)."""
    d = Path(control_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for p in d.glob("device-*.json*"):
        p.unlink(missing_ok=True)


def spare_devices(devices: list, visible: list[str], used: int, bad: set[str]) -> list[str]:
    """UUIDs of this node's healthy devices (``health.check()``) that no local rank
    uses: not among the first ``used`` of ``visible`` (indices or UUIDs, local-rank
    order) and not known bad."""
    taken = set(visible[:used]) | bad
    return [d.uuid for d in devices if d.ok and d.uuid and str(d.index) not in taken and d.uuid not in taken]


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
    return _write_answer(control_dir, req, {"uuid": new_device, "t": time.time()})


def _write_answer(control_dir: str | os.PathLike, req: Request, body: dict) -> Path:
    path = Path(control_dir) / RESUME.format(rank=req.rank, epoch=req.epoch)
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def is_local(to: str | None, node_addr: str) -> bool:
    return to in (node_addr, "localhost", "127.0.0.1")


def refusal(placement, node_addr: str, host_pid: int | None, can_ship: bool) -> str | None:
    """Why the scheduler hook's ``placement`` cannot be carried out here, or None."""
    if placement.action != "migrate":
        return f"the scheduler hook answered {placement.action!r} (no spare device to move it to)"
    if not host_pid:
        return "the worker was not started migratable (no PID namespace recorded for it)"
    if not is_local(placement.to, node_addr) and not can_ship:
        return f"cannot reach node {placement.to}: the job has no coordination store (static rendezvous)"
    return None


def refuse(control_dir: str | os.PathLike, req: Request, why: str) -> Path:
    """Nobody will move the parked process: it falls back at once (the JIT
    checkpoint path) instead of after ``JITCKPT_RECOVER_TIMEOUT``."""
    return _write_answer(control_dir, req, {"fallback": why.replace('"', "'")[:190], "t": time.time()})


@dataclass
class Moved:
    """A restored process: ``helper`` is the restore helper (wait on it: it
    exits as the process does), ``pid`` the process's new host PID."""

    helper: subprocess.Popen
    pid: int
    dump_s: float
    restore_s: float
    image_bytes: int

    # the agent's view of a worker process (launcher/agent.py _Proc)
    def poll(self) -> int | None:
        return self.helper.poll()

    def wait(self, timeout_s: float = 30.0) -> int | None:
        try:
            return self.helper.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def send(self, sig: int) -> None:
        # the helper forwards catchable signals; SIGKILL would end only the helper
        try:
            if sig == 9:
                os.kill(self.pid, sig)
            else:
                self.helper.send_signal(sig)
        except ProcessLookupError:
            pass


def move(req: Request, host_pid: int, images_dir: str | os.PathLike, new_device: str,
         control_dir: str | os.PathLike, *, restore_timeout: float = 60.0) -> Moved:
    """Dump the parked process (host PID ``host_pid``; the dump ends it), restore
    it from ``images_dir`` (removed afterwards: tmpfs is memory) and answer it with
    ``new_device``. Raises :class:`jitrun.migration.criu.CriuError` when the dump or the
    restore fails: the process is then not answered (after a failed dump it still
    runs, parked: tell it with :func:`refuse`)."""
    images = Path(images_dir)
    try:
        d = criu.dump_with_test_faults(host_pid, images, tcp_established=False)
        t0 = time.monotonic()
        helper = subprocess.Popen(criu.restore_and_wait_command(images), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = helper.stdout.readline().split() if helper.stdout else []
        if len(line) < 2 or line[0] != "RESTORED":
            helper.wait(timeout=restore_timeout)
            raise criu.CriuError(f"restore of rank {req.rank} from {images} failed: "
                                 f"{' '.join(line) or 'no output'}")
    finally:
        shutil.rmtree(images, ignore_errors=True)
    moved = Moved(helper, int(line[1]), d.seconds, time.monotonic() - t0, d.image_bytes)
    answer(control_dir, req, new_device)
    return moved
