"""Device health and lost devices for one agent.

Before every (re)start, devices NVML reports failing are left out of
CUDA_VISIBLE_DEVICES when enough remain (the scheduler hook decides); while
the job runs a monitor thread checks every ``--jit-health-interval`` seconds
and a failing device's ranks are moved live (``migrate``) or stopped with a
JIT checkpoint (``restart``). A device that died under a live process (the
shim parked it and asked in ``<jit dir>/migrate/device``) is replaced by
moving the process with CRIU, or the process is told to fall back.

Threads: the health monitor's thread only appends to ``_unhealthy`` and
wakes the main thread; everything else runs in the agent's main thread.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.agent.server.api import WorkerGroup

from jitckpt.wire import contract

from .. import worker_env
from ..migration import agents as migrate_agent
from ..migration import control as migrate
from ..migration import criu, device_loss
from ..workers import Proc, Whereabouts
from . import health, scheduler
from .describe import describe


class DeviceWatch:
    def __init__(self, jit, node, events, poke: Callable[[], None], where: Whereabouts) -> None:
        self._jit = jit
        self._node = node
        self._events = events
        self._poke = poke
        self._where = where
        self._unhealthy: list = []  # appended by the monitor thread, taken by the main thread
        self.bad: set[str] = set()  # left out of CUDA_VISIBLE_DEVICES at the next start
        self._monitor: health.HealthMonitor | None = None
        self._nvml_count = 0
        dd = contract.DEVICE_DIR.get()
        self._device_dir: Path | None = Path(dd) if dd and contract.ON_DEVICE_LOSS.get() == "migrate" else None
        self._device_dir_warned = False

    def names(self, wg: WorkerGroup) -> list[str]:
        """The devices the workers see, in local-rank order: CUDA_VISIBLE_DEVICES, else
        every device NVML counted (else one per local rank)."""
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        return vis.split(",") if vis else [str(i) for i in range(self._nvml_count or wg.spec.local_world_size)]

    def before_start(self, wg: WorkerGroup) -> None:
        """Leave failing devices out, then keep watching on a period (once per agent)."""
        devs = health.check()
        self._nvml_count = len(devs)
        bad = [d for d in devs if not d.ok]
        names = self.names(wg)
        failing = sorted({n for d in bad for n in names if n in (str(d.index), d.uuid)} | self.bad)
        if failing:
            self._events.emit("device_unhealthy", stage="start", devices=failing,
                              reasons={str(d.index): d.reason for d in bad})
            placement = scheduler.place(self._jit.scheduler, describe(
                self._jit.job_id, self._node, event="device_unhealthy", failed_devices=failing,
                devices=",".join(names), nproc_per_node=wg.spec.local_world_size, ranks=[]))
            if placement.visible_devices is not None:
                worker_env.placement({}, placement.visible_devices)
                print(f"jitrun: device(s) {', '.join(failing)} failing: starting on CUDA_VISIBLE_DEVICES="
                      f"{placement.visible_devices}", file=sys.stderr, flush=True)
        if self._monitor is None and self._jit.health_interval_s > 0 and health.available():
            def failing_now(devs: list) -> None:  # the monitor's thread: hand over, wake the main thread
                self._unhealthy.extend(devs)
                self._poke()

            self._monitor = health.HealthMonitor(self._jit.health_interval_s, failing_now, self._events.emit)
            self._monitor.start()
        if self._device_dir is not None:
            device_loss.reset(self._device_dir)

    def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.stop()

    def tick(self, wg: WorkerGroup, procs: dict[int, Proc], local_ranks: set[int], coord_store,
             worker_store: Callable[[], object], on_moved: Callable[[], None]) -> None:
        """One look from the monitor loop: devices gone bad under running ranks,
        parked ranks asking for a new device."""
        if self._unhealthy:
            self._on_unhealthy(wg, procs, worker_store)
        if self._device_dir is not None:
            self._on_device_lost(wg, procs, local_ranks, coord_store, on_moved)

    def _on_unhealthy(self, wg: WorkerGroup, procs: dict[int, Proc], worker_store: Callable[[], object]) -> None:
        """A device failed while its rank runs: ask the scheduler hook whether to move
        the rank live (``migrate``) or to stop it with a JIT checkpoint and restart
        without the device (``restart``, what ``local`` answers)."""
        devs, self._unhealthy[:] = list(self._unhealthy), []
        names = self.names(wg)
        failing = {n for d in devs for n in names if n in (str(d.index), d.uuid)}
        ranks = sorted(w.global_rank for w in wg.workers if w.local_rank < len(names)
                       and names[w.local_rank] in failing and w.global_rank not in self._where.moved)
        if not ranks:
            return
        self.bad |= failing
        failure = describe(self._jit.job_id, self._node, event="device_unhealthy", failed_devices=sorted(failing),
                           ranks=ranks, reasons={str(d.index): d.reason for d in devs}, devices=",".join(names),
                           nproc_per_node=wg.spec.local_world_size)
        placement = scheduler.place_or_default(self._jit.scheduler, failure, "restarting without the device instead")
        if placement.action == "migrate" and migrate.enabled() and migrate.pausable():
            gen = migrate.request(worker_store(), self._jit.token, ranks, str(placement.to))
            self._events.emit("migration_requested", gen=gen, ranks=ranks, to=placement.to, why="device_unhealthy",
                              devices=sorted(failing))
            print(f"jitrun: device(s) {', '.join(sorted(failing))} failing: moving rank(s) {ranks} to "
                  f"{placement.to}", file=sys.stderr, flush=True)
            return
        if placement.action == "migrate":
            why = ("its workers run without jitckpt's runtime (--no-python): no minibatch start to pause at"
                   if migrate.enabled() else "the job runs without --jit-migratable on")
            print(f"jitrun: the scheduler hook asked to migrate, but {why}; restarting without the device instead",
                  file=sys.stderr, flush=True)
        # the ranks take their JIT checkpoint and exit; the failure path restarts the job
        for r in ranks:
            procs[r].signal(signal.SIGTERM)
        self._events.emit("device_restart", ranks=ranks, devices=sorted(failing))

    def _on_device_lost(self, wg: WorkerGroup, procs: dict[int, Proc], local_ranks: set[int], coord_store,
                        on_moved: Callable[[], None]) -> None:
        """A local rank's device died under its live process, which the shim parked
        (launcher/migration/device_loss.py): the scheduler hook says where it goes; it is
        moved with CRIU and attaches the new device there, or told to fall back."""
        assert self._device_dir is not None
        try:
            reqs = [r for r in device_loss.pending(self._device_dir)
                    if r.rank in local_ranks and r.rank not in self._where.moved]
        except ValueError as e:
            if not self._device_dir_warned:
                self._device_dir_warned = True
                print(f"jitrun: {e}", file=sys.stderr, flush=True)
            return
        for req in reqs:
            why = self._move_lost(wg, req, coord_store, procs.get(req.rank))
            if why is None:
                on_moved()
                continue
            # answered whether or not its process is known here (a worker that was not
            # started migratable has no namespace PID): the parked process falls back at
            # once, and an answered request is not pending again on the next tick
            device_loss.refuse(self._device_dir, req, why)
            self._events.emit("device_move_refused", rank=req.rank, epoch=req.epoch, why=why)
            print(f"jitrun: rank {req.rank}'s device {req.device} was lost and its process is not moved ({why}); "
                  "it falls back to the JIT checkpoint path", file=sys.stderr, flush=True)

    def _move_lost(self, wg: WorkerGroup, req, coord_store, proc: Proc | None) -> str | None:
        """Move one parked rank to the device the hook names; None when it
        moved, else why not."""
        t0 = time.monotonic()
        names = self.names(wg)
        lr = {w.global_rank: w.local_rank for w in wg.workers}[req.rank]
        lost = names[lr] if lr < len(names) else req.device
        self.bad.add(lost)
        spares = device_loss.spare_devices(health.check(), names, wg.spec.local_world_size, self.bad | {req.device})
        self._events.emit("device_lost", rank=req.rank, device=req.device, epoch=req.epoch, spares=spares)
        failure = describe(self._jit.job_id, self._node, event="device_lost", rank=req.rank, failed_devices=[lost],
                           device_uuid=req.device, spare_devices=spares, devices=",".join(names),
                           nproc_per_node=wg.spec.local_world_size)
        placement = scheduler.place_or_default(self._jit.scheduler, failure, "the process falls back instead")
        pids = self._where.ns_pids
        why = device_loss.refusal(placement, self._node.addr, pids.get(req.rank), coord_store is not None)
        if why is not None:
            return why
        images = self._jit.root / "migrate" / "img" / f"device-rank{req.rank}-e{req.epoch}"
        try:
            if device_loss.is_local(placement.to, self._node.addr):
                moved = device_loss.move(req, pids[req.rank], images, str(placement.device), self._device_dir)
                pids[req.rank] = moved.pid
            else:
                moved = move_to_node(
                    req, pids[req.rank], images, str(placement.device), self._device_dir, to=str(placement.to),
                    coord_store=coord_store, token=self._jit.token, output=self._where.outputs.get(req.rank))
        except (criu.CriuError, migrate_agent.MigrationError, OSError) as e:
            err = str(e)
            if proc is not None and proc.pid:  # what it runs now, should the dumped PID be the wrong one
                err += f"; rank {req.rank}'s wrapper (PID {proc.pid}): {criu.pid_facts(proc.pid)}"
            self._events.emit("device_move_failed", rank=req.rank, epoch=req.epoch, to=placement.to, error=err)
            return f"the move failed: {err}"
        self._where.moved[req.rank] = moved if isinstance(moved, device_loss.Moved) else moved.remote
        self._events.emit("device_moved", rank=req.rank, epoch=req.epoch, to=placement.to,
                          device=placement.device, old_device=req.device,
                          dump_s=round(moved.dump_s, 4), restore_s=round(moved.restore_s, 4),
                          image_bytes=moved.image_bytes, pause_s=round(time.monotonic() - t0, 4))
        print(f"jitrun: rank {req.rank}'s device {req.device} was lost: moved the live process to "
              f"device {placement.device} on {placement.to} (dump {moved.dump_s:.2f}s, restore "
              f"{moved.restore_s:.2f}s, {moved.image_bytes >> 20} MiB)", flush=True)
        return None


@dataclass
class Shipped:
    """A process restored on another node: ``remote`` reaches it (exit code, signals)."""

    remote: object  # migrate_agent.Remote
    dump_s: float
    transfer_s: float
    restore_s: float
    image_bytes: int


def move_to_node(req: device_loss.Request, host_pid: int, images_dir: str | os.PathLike, new_device: str,
                 control_dir: str | os.PathLike, *, to: str, coord_store, token: str,
                 output: str | None) -> Shipped:
    """As ``device_loss.move``, to node ``to``: the images (and the output file the process
    holds open on this node's disk) go to that node's jitrun agent (its
    ``migrate_agent.Target``), which restores the process and writes the answer at
    ``control_dir``'s path there. Raises CriuError / MigrationError on failure."""
    images = Path(images_dir)
    try:
        d = criu.dump_with_test_faults(host_pid, images, tcp_established=False)
        t0 = time.monotonic()
        got = migrate_agent.ship(coord_store, token, images, output, to, {
            "rank": req.rank, "device": {"dir": str(control_dir), "epoch": req.epoch, "uuid": new_device}})
    finally:
        shutil.rmtree(images, ignore_errors=True)
    if got.got is None:
        raise migrate_agent.MigrationError("restore", f"node {to} did not restore rank {req.rank} in time")
    if not got.got.get("ok"):
        raise migrate_agent.MigrationError("restore", f"node {to}: {got.got.get('why')}")
    return Shipped(migrate_agent.Remote(coord_store, token, got.tid, to), d.seconds, got.t_sent - t0,
                   float(got.got.get("restore_s") or 0.0), d.image_bytes)
