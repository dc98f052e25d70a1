"""JitAgent: torchrun's LocalElasticAgent with JIT-aware failure handling.

torchrun stops the world on the first worker failure (SIGTERM, 30 s grace,
SIGKILL) and restarts. That would kill the healthy replicas while they save.
JitAgent instead, on the first failure signal (a worker exit or a worker's
failure report through the store):

1. asks every live worker to save now (SIGTERM; the worker runtime turns it
   into a JIT save at the next consistent point),
2. waits until every shard has a complete checkpoint from this failure, all
   savers are done, or ``timeout + save_timeout`` passed,
3. SIGKILLs whatever is still running (stopped or hung ranks) at once,
4. posts its node's inventory of replicas and takes the job-wide restore
   decision (``decide``: one for the whole job, made through the rendezvous
   store once every node has answered), asks the scheduler hook where to run,
   and hands back to torchrun's restart loop (which honours --max-restarts);
5. before starting workers, fetches any replica of the chosen step that this
   node lacks from a node that has it (``transfer``).

Runs in the agent's main thread, except ``transfer.ReplicaServer`` (its own
thread and store connection, reading replica files only); no shared state
between them, so no locks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from jitckpt import layout
from jitckpt.config import EXIT_DIVERGED, EXIT_SAVED
from jitckpt.report import ReportReader, connect

from . import criu, decide, device_loss, migrate, migrate_agent, rdzv, scheduler, transfer, warm
from .events import EventLog
from .wakeup import Wakeup


@dataclass
class JitOptions:
    root: Path
    job_id: str
    token: str
    timeout_s: float
    save_timeout_s: float
    scheduler: str
    command: list[str] = field(default_factory=list)  # this agent's argv, to start a replacement
    health_interval_s: float = 0.0  # NVML checks while the job runs (0: only before each start)


@dataclass
class _Proc:
    pid: int  # 0: runs on another node (migrated), reached through send
    poll: Callable[[], int | None]
    wait: Callable[[], object]
    send: Callable[[int], None] | None = None

    def signal(self, sig: int) -> None:
        if self.send is not None:
            self.send(sig)
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


def _host_name() -> str:
    # under Slurm the scheduler's name for this node (several slurmd may share a host)
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename


def _mp_poll(p) -> Callable[[], int | None]:
    return lambda: p.exitcode


def _cpu_ticks(pid: int) -> int | None:
    """utime + stime of a process, in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            f = fh.read().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])
    except (OSError, IndexError, ValueError):
        return None


def _proc_state(pid: int) -> str | None:
    """The one-letter state from /proc/PID/stat (T = stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class _Failure:
    """Book-keeping for one failure episode."""

    def __init__(self, t: float) -> None:
        self.detected_t = t
        self.fault_t: float | None = None
        self.saved: dict[int, dict] = {}
        self.saving: set[int] = set()
        self.done: set[int] = set()  # ranks that will not save (failed, skipped, exited)
        self.reasons: dict[int, str] = {}
        self.responded: set[int] = set()  # ranks that reported anything since the failure
        # the step each rank last said it is at (failure_detected, save_started):
        # a live rank ahead of the newest saved replica may still save a newer one
        self.rank_step: dict[int, int] = {}
        self.progress = -1
        self.minibatch_s: list[float] = []
        self.killed: list[int] = []
        self.restore_step: int | None = None
        self.restart_t: float | None = None
        self.ckpt_done_t: float | None = None
        self.stopped_t: float | None = None  # every worker of this node gone
        self.rdzv_t: float | None = None  # the next round's rendezvous done
        self.handling_since = time.monotonic()
        self.diverged = False  # ranks loaded different states: never train on


class JitAgent(LocalElasticAgent):
    def __init__(self, *args, jit: JitOptions, events: EventLog, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._jit = jit
        self._events = events
        self._reader: ReportReader | None = None
        self._store_addr: tuple[str, int] | None = None
        self._shards: dict[int, str] = {}  # global rank -> shard, from "registered"
        self._failure: _Failure | None = None
        self._pending: _Failure | None = None  # restarted, waiting for "resumed"
        self._exited: dict[int, int] = {}
        self._fault_t: float | None = None
        self._fault_step = -1  # the step an injected fault announced, read before the failure was seen
        self._jit_env_keys: set[str] = {"JITCKPT_RESTORE_STEP", "CUDA_VISIBLE_DEVICES", "JITCKPT_ATTEMPT"}
        addr = self._worker_group.spec.local_addr or socket.getfqdn()
        self._node = decide.NodeInfo(node_id=f"{addr}-{os.getpid()}", host=_host_name(), addr=addr)
        events.node = self._node.node_id
        self._round = 0
        self._local_ranks: set[int] = set()
        self._coord: decide.Coordinator | None = None
        self._server: transfer.ReplicaServer | None = None
        self._decision: decide.Decision | None = None
        self._spare_seen = False
        self._finished: set[int] = set()  # ranks of the job that finished their script (reports)
        # rank -> (CPU ticks, when they last changed): a failed process's last
        # sign of life, the failure time when no injector stamped it
        self._life: dict[int, tuple[int, float]] = {}
        self._loaded: dict[int, object] = {}  # rank -> step it loaded, this round (reports)
        # this round's start-up milestones per rank (reports): process created,
        # get_checkpoint_path() asked, first training step entered
        self._boot: dict[int, float] = {}
        self._query: dict[int, float] = {}
        self._train: dict[int, float] = {}
        # torchrun sleeps monitor_interval between looks; we block in
        # _monitor_workers until an exit or a report instead (Wakeup), with
        # the interval as the longest wait
        spec = self._worker_group.spec
        self._monitor_s = spec.monitor_interval
        spec.monitor_interval = 1e-6
        self._wakeup = Wakeup()
        handler = self._worker_group.spec.rdzv_handler
        rdzv.install(handler, on_spare=self._on_spare,
                     healthy=lambda: self._failure is None and self._worker_group.state == WorkerState.HEALTHY)
        # issue 13: ranks moved to another node by `jitrun migrate` (launcher/migrate_agent.py)
        # (and a rank whose lost device's process moved to a new device: launcher/device_loss.py)
        self._moved: dict[int, migrate_agent.Remote | device_loss.Moved] = {}
        self._migrating: dict[int, list[dict]] = {}  # gen -> this node's ranks' "migrating" reports
        self._mig_pids: dict[int, int] = {}  # rank -> host PID of its namespace init (what CRIU dumps)
        self._mig_out: dict[int, str] = {}  # rank -> its output file (held open, on this node's disk)
        self._target: migrate_agent.Target | None = None
        # issue 13: devices NVML reports failing (launcher/health.py); the monitor thread
        # appends, the main thread takes them in _monitor_workers
        self._unhealthy: list = []
        self._bad_devices: set[str] = set()  # left out of CUDA_VISIBLE_DEVICES at the next start
        self._health_monitor = None
        self._nvml_count = 0
        # issue 13: where this node's parked workers ask for a new device (device_loss.py)
        dd = os.environ.get(device_loss.DIR_ENV)
        self._device_dir: Path | None = Path(dd) if dd and os.environ.get("JITCKPT_ON_DEVICE_LOSS") == "migrate" \
            else None
        self._device_dir_warned = False
        coord = rdzv.coordination_store(handler)
        if migrate.enabled() and coord is not None:
            # also on a spare: a node waiting to join can take migrated workers
            try:
                self._target = migrate_agent.Target(coord, jit.token, self._node.addr, jit.root, events).start()
            except OSError as e:  # the job trains on; only moving ranks here is off
                print(f"jitrun: this node cannot take migrated workers: listening on {self._node.addr} failed "
                      f"({e}); pass --local-addr with this node's address", file=sys.stderr, flush=True)

    # -- store ----------------------------------------------------------------

    def _poll(self, wg: WorkerGroup, absorb: bool = True, drain: bool = False) -> list[dict]:
        addr = (wg.master_addr, wg.master_port)
        if self._reader is None or addr != self._store_addr:
            self._reader = ReportReader(connect(*addr), self._jit.token,
                                        from_now=self._reader is None and self._round > 0)
            self._store_addr = addr
            self._wakeup.watch(addr, self._jit.token)
        msgs = self._reader.poll(drain=drain)
        if absorb:
            for m in msgs:
                self._absorb(m)
        return msgs

    def _of_this_round(self, m: dict) -> bool:
        """False for a report of an earlier round read late: the reader waits up
        to SLOT_GRACE_S on a slot a killed writer left empty, so reports written
        after it can arrive in the next round. Every use of a report for this
        round's failure, restore or recovery record asks this first."""
        return m.get("attempt", self._round) == self._round

    def _absorb(self, m: dict) -> None:
        ev, rank = m["event"], m.get("rank")
        if ev in ("loaded", "started") and not self._of_this_round(m):
            return  # this round's facts only
        if ev == "registered":
            self._shards[rank] = m["shard"]
            return
        if ev == "finished":
            self._finished.add(rank)
            fresh = self._of_this_round(m)
            if m.get("loaded") is not None and self._loaded.get(rank) is None and fresh:
                self._loaded[rank] = m["loaded"]
            if self._pending is not None and fresh:
                # restored after the last minibatch (e.g. a save at a barrier
                # after the loop): the job ends without another minibatch
                self._on_resumed(m)
        if ev == "loaded":
            self._loaded[rank] = m.get("loaded")
            self._train[rank] = m["t"]
            if m.get("query_t"):
                self._query[rank] = m["query_t"]
        if ev == "started":
            self._boot[rank] = m.get("proc_start_t") or m["t"]
        if ev == "migrating" and rank in self._local_ranks and self._of_this_round(m):
            self._migrating.setdefault(int(m["gen"]), []).append(m)
        # every node reads every rank's reports (the job's decisions need
        # them) but writes only its own ranks' to its timeline
        local = rank is None or rank in self._local_ranks
        # an earlier round's report read late goes to the timeline but says
        # nothing about this round's failure or recovery
        current = self._of_this_round(m)
        if ev == "resumed":
            if local:
                self._events.emit("resumed", t=m["t"], rank=rank, step=m["step"])
            if current:
                self._on_resumed(m)
            return
        if local:
            self._events.emit(ev, **{k: v for k, v in m.items() if k != "event"})
        f = self._failure
        if f is None or not current:
            return
        if rank is not None and ev != "fault_injected":
            f.responded.add(rank)
        if ev == "fault_injected" and f.fault_t is None:
            f.fault_t = m["t"]
        if m.get("minibatch_s"):
            f.minibatch_s.append(m["minibatch_s"])
        if "step" in m:
            f.progress = max(f.progress, int(m["step"]))
            if rank is not None and ev in ("failure_detected", "save_started"):
                f.rank_step[rank] = int(m["step"])
        if ev == "failure_detected":
            f.detected_t = min(f.detected_t, m["t"])
            f.reasons.setdefault(rank, m.get("reason", "?"))
        elif ev == "save_started":
            f.saving.add(rank)
        elif ev == "checkpoint_saved":
            f.saving.discard(rank)
            f.saved[rank] = m
            shards = set(self._shards.values()) or {"0"}
            if f.ckpt_done_t is None and shards <= {s["shard"] for s in f.saved.values()}:
                f.ckpt_done_t = m["t"]
        elif ev in ("checkpoint_failed", "checkpoint_skipped"):
            f.saving.discard(rank)
            f.done.add(rank)

    # -- rendezvous and start -----------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        handler = worker_group.spec.rdzv_handler
        self._round = rdzv.current_round(handler) or 0
        # the job-wide attempt: the same on every node, also on a replacement
        # whose own restart count starts at 0
        os.environ["JITCKPT_ATTEMPT"] = str(self._round)
        self._local_ranks = {w.global_rank for w in worker_group.workers}
        for d in (self._loaded, self._life, self._boot, self._query, self._train):
            d.clear()
        if self._pending is not None:
            self._pending.rdzv_t = time.time()
        store = rdzv.coordination_store(handler)
        if store is not None:
            if self._coord is None:
                # our blocking waits must not share the heartbeat thread's connection
                self._coord = decide.Coordinator(transfer.own_connection(store), self._jit.token, self._node)
                self._server = transfer.ReplicaServer(store, self._jit.token, self._node.node_id,
                                                      self._jit.root, self._jit.job_id).start()
            self._coord.announce(self._round, worker_group.group_rank)
        self._events.emit("rendezvous", round=self._round, group_rank=worker_group.group_rank,
                          group_world_size=worker_group.group_world_size,
                          ranks=sorted(self._local_ranks), host=self._node.host, addr=self._node.addr)
        self._poll(worker_group)  # connect the report reader before this round's workers report

    def _start_workers(self, worker_group: WorkerGroup):
        self._prepare_restore()
        self._check_devices(worker_group)
        if self._device_dir is not None:
            device_loss.reset(self._device_dir)
        pids = super()._start_workers(worker_group)
        if migrate.enabled():  # issue 13: where each migratable rank runs
            ranks = migrate.record_workers(self, worker_group)
            self._mig_pids = {int(r): w["pid"] for r, w in ranks.items() if w["pid"]}
            self._mig_out = {int(r): w["output"] for r, w in ranks.items()}
            self._moved.clear()
            migrate.publish(self._reader_store(worker_group), self._jit.token, self._jit.root, ranks,
                            (worker_group.master_addr, worker_group.master_port))
        return pids

    def _prepare_restore(self) -> None:
        """Make the job's restore step and its replicas present on this node.

        The newest decision in the store is the job's, also for an agent that
        joined after the failure (a replacement or a spare)."""
        if self._coord is None:
            return
        d = self._coord.latest()
        if d is None:
            return
        self._decision = d
        os.environ["JITCKPT_RESTORE_STEP"] = "none" if d.step is None else str(d.step)
        # --- issue 12: an EC version was chosen: the workers decode it, d.step stays their fallback ---
        decide.ec_env(d, os.environ)
        self._jit_env_keys |= {"JITCKPT_RESTORE_SOURCE", "JITCKPT_EC_FALLBACK_STEP"}
        # --- end issue 12 ---
        if d.step is None:
            return
        need = sorted({d.shard_of_rank.get(str(r)) for r in self._local_ranks} - {None}) or d.shards
        for shard in need:
            t0 = time.monotonic()
            path, errors, fetched = transfer.ensure_local(
                self._coord.store, self._jit.token, root=self._jit.root, job_id=self._jit.job_id, step=d.step,
                shard=shard, sources=d.sources.get(shard, []), self_node=self._node.node_id,
                timeout_s=self._jit.save_timeout_s)
            for e in errors:
                self._events.emit("replica_fetch_failed", step=d.step, shard=shard, error=e)
            if path is None:
                print(f"jitrun: no copy of step {d.step} shard {shard} could be brought to this node "
                      f"({'; '.join(errors) or 'no source'}); its ranks will refuse to start", file=sys.stderr,
                      flush=True)
            elif fetched is not None:
                self._events.emit("replica_fetched", step=d.step, shard=shard, path=str(path), source=fetched,
                                  bytes=sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
                                  seconds=round(time.monotonic() - t0, 3))

    def close(self) -> bool:
        """End the replica server thread before the interpreter exits; False
        if it would not stop (the caller then leaves with os._exit)."""
        if self._target is not None:
            self._target.stop()
        if self._health_monitor is not None:
            self._health_monitor.stop()
        woke = self._wakeup.close()
        if self._server is None or self._coord is None:
            return woke
        return self._server.stop(self._coord.store) and woke

    def _on_spare(self, n: int) -> None:
        if not self._spare_seen:
            self._spare_seen = True
            self._events.emit("spare_waiting", nodes=n)
            print(f"jitrun: {n} node(s) waiting to join; kept as spare(s) until a failure", flush=True)

    # -- monitoring -------------------------------------------------------------

    def _procs(self, wg: WorkerGroup) -> dict[int, _Proc]:
        """Global rank -> process, for both of torchrun's process contexts
        (subprocesses, or forkserver children with the warm start)."""
        pc = self._pcontext
        assert pc is not None
        if hasattr(pc, "subprocess_handlers"):
            procs = {wg.workers[lr].global_rank: _Proc(h.proc.pid, h.proc.poll, h.proc.wait)
                     for lr, h in pc.subprocess_handlers.items()}
        else:
            procs = {wg.workers[lr].global_rank: _Proc(p.pid, _mp_poll(p), p.join)
                     for lr, p in enumerate(pc._pc.processes)}  # type: ignore[attr-defined]
        for r, remote in self._moved.items():  # its wrapper here ended with the dump
            procs[r] = _Proc(getattr(remote, "pid", 0), remote.poll, remote.wait, remote.send)
        return procs

    def _mp_progress(self, wg: WorkerGroup) -> RunResult:
        """Success path for forked workers, without MultiprocessContext._poll:
        its ProcessContext.join(-1) answers any failure by terminating every
        other worker and waiting for them, which would hang on a stopped rank
        and race our JIT saves. A forked worker returns its value through a
        queue and then waits until the parent has read them all; a worker
        started through jitckpt's bootstrap ends with os._exit(0) before that
        (see jitckpt._bootstrap), so exit code 0 counts as done."""
        pc = self._pcontext
        for lr in range(pc.nprocs):  # type: ignore[union-attr]
            q = pc._ret_vals[lr]  # type: ignore[union-attr]
            if lr not in pc._return_values and not q.empty():  # type: ignore[union-attr]
                pc._return_values[lr] = q.get()  # type: ignore[union-attr]
            elif lr not in pc._return_values and pc._pc.processes[lr].exitcode == 0:  # type: ignore[union-attr]
                pc._return_values[lr] = None  # type: ignore[union-attr]
        if not pc._is_done():  # type: ignore[union-attr]
            return RunResult(state=WorkerState.HEALTHY)
        pc._worker_finished_event.set()  # type: ignore[union-attr]
        procs = self._procs(wg)
        for p in procs.values():
            p.wait()
        if any(p.poll() != 0 for p in procs.values()):
            return RunResult(state=WorkerState.HEALTHY)  # a failed exit: the next tick handles it
        values = {wg.workers[lr].global_rank: v for lr, v in pc._return_values.items()}  # type: ignore[union-attr]
        pc.close()  # type: ignore[union-attr]
        return RunResult(state=WorkerState.SUCCEEDED, return_values=values)

    # -- device health (issue 13) -------------------------------------------------

    def _devices(self, wg: WorkerGroup) -> list[str]:
        """The devices the workers see, in local-rank order: CUDA_VISIBLE_DEVICES, else
        every device NVML counted (else one per local rank)."""
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        return vis.split(",") if vis else [str(i) for i in range(self._nvml_count or wg.spec.local_world_size)]

    def _check_devices(self, wg: WorkerGroup) -> None:
        """Before every (re)start: leave devices NVML reports failing out of
        CUDA_VISIBLE_DEVICES when enough remain (the scheduler hook decides), then keep
        watching on a period (once per agent)."""
        from . import health

        devs = health.check()
        self._nvml_count = len(devs)
        bad = [d for d in devs if not d.ok]
        names = self._devices(wg)
        failing = sorted({n for d in bad for n in names if n in (str(d.index), d.uuid)} | self._bad_devices)
        if failing:
            self._events.emit("device_unhealthy", stage="start", devices=failing,
                              reasons={str(d.index): d.reason for d in bad})
            placement = scheduler.place(self._jit.scheduler, {
                "event": "device_unhealthy", "job_id": self._jit.job_id, "failed_devices": failing,
                "devices": ",".join(names), "nproc_per_node": wg.spec.local_world_size, "ranks": [],
                "hosts": [self._node.host], "node": {"node_id": self._node.node_id, "addr": self._node.addr}})
            if placement.visible_devices is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = placement.visible_devices
                self._jit_env_keys.add("CUDA_VISIBLE_DEVICES")
                print(f"jitrun: device(s) {', '.join(failing)} failing: starting on CUDA_VISIBLE_DEVICES="
                      f"{placement.visible_devices}", file=sys.stderr, flush=True)
        if self._health_monitor is None and self._jit.health_interval_s > 0 and health.available():
            def failing_now(devs: list) -> None:  # the monitor's thread: hand over, wake the main thread
                self._unhealthy.extend(devs)
                self._wakeup.poke()

            self._health_monitor = health.HealthMonitor(self._jit.health_interval_s, failing_now,
                                                        self._events.emit)
            self._health_monitor.start()

    def _on_unhealthy(self, wg: WorkerGroup) -> None:
        """A device failed while its rank runs: ask the scheduler hook whether to move
        the rank live (``migrate``) or to stop it with a JIT checkpoint and restart
        without the device (``restart``, what ``local`` answers)."""
        devs, self._unhealthy[:] = list(self._unhealthy), []
        names = self._devices(wg)
        failing = {n for d in devs for n in names if n in (str(d.index), d.uuid)}
        ranks = sorted(w.global_rank for w in wg.workers if w.local_rank < len(names)
                       and names[w.local_rank] in failing and w.global_rank not in self._moved)
        if not ranks:
            return
        self._bad_devices |= failing
        failure = {"event": "device_unhealthy", "job_id": self._jit.job_id, "failed_devices": sorted(failing),
                   "ranks": ranks, "reasons": {str(d.index): d.reason for d in devs},
                   "devices": ",".join(names), "nproc_per_node": wg.spec.local_world_size,
                   "hosts": [self._node.host], "node": {"node_id": self._node.node_id, "addr": self._node.addr}}
        try:
            placement = scheduler.place(self._jit.scheduler, failure)
        except scheduler.SchedulerError as e:
            print(f"jitrun: {e}; restarting without the device instead", file=sys.stderr, flush=True)
            placement = scheduler.Placement()
        if placement.action == "migrate" and migrate.enabled() and migrate.pausable():
            gen = migrate.request(self._reader_store(wg), self._jit.token, ranks, str(placement.to))
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
        procs = self._procs(wg)
        for r in ranks:
            procs[r].signal(signal.SIGTERM)
        self._events.emit("device_restart", ranks=ranks, devices=sorted(failing))

    def _on_device_lost(self, wg: WorkerGroup) -> None:
        """A local rank's device died under its live process, which the shim parked
        (launcher/device_loss.py): the scheduler hook says where it goes; it is
        moved with CRIU and attaches the new device there, or told to fall back."""
        from . import health

        try:
            reqs = [r for r in device_loss.pending(self._device_dir)
                    if r.rank in self._local_ranks and r.rank not in self._moved]
        except ValueError as e:
            if not self._device_dir_warned:
                self._device_dir_warned = True
                print(f"jitrun: {e}", file=sys.stderr, flush=True)
            return
        for req in reqs:
            t0 = time.monotonic()
            names = self._devices(wg)
            local_of = {w.global_rank: w.local_rank for w in wg.workers}
            lr = local_of[req.rank]
            lost = names[lr] if lr < len(names) else req.device
            self._bad_devices.add(lost)
            spares = device_loss.spare_devices(health.check(), names, wg.spec.local_world_size,
                                               self._bad_devices | {req.device})
            self._events.emit("device_lost", rank=req.rank, device=req.device, epoch=req.epoch, spares=spares)
            failure = {"event": "device_lost", "job_id": self._jit.job_id, "rank": req.rank,
                       "failed_devices": [lost], "device_uuid": req.device, "spare_devices": spares,
                       "devices": ",".join(names), "nproc_per_node": wg.spec.local_world_size,
                       "hosts": [self._node.host], "node": {"node_id": self._node.node_id, "addr": self._node.addr}}
            try:
                placement = scheduler.place(self._jit.scheduler, failure)
            except scheduler.SchedulerError as e:
                print(f"jitrun: {e}", file=sys.stderr, flush=True)
                placement = scheduler.Placement()
            coord = self._coord.store if self._coord is not None else None
            why = device_loss.refusal(placement, self._node.addr, self._mig_pids.get(req.rank), coord is not None)
            if why is None:
                images = self._jit.root / "migrate" / "img" / f"device-rank{req.rank}-e{req.epoch}"
                try:
                    if device_loss.is_local(placement.to, self._node.addr):
                        moved = device_loss.move(req, self._mig_pids[req.rank], images, str(placement.device),
                                                 self._device_dir)
                        self._mig_pids[req.rank] = moved.pid
                    else:
                        moved = device_loss.move_to_node(
                            req, self._mig_pids[req.rank], images, str(placement.device), self._device_dir,
                            to=str(placement.to), coord_store=coord, token=self._jit.token,
                            output=self._mig_out.get(req.rank))
                except (criu.CriuError, migrate_agent.MigrationError, OSError) as e:
                    why = f"the move failed: {e}"
                    self._events.emit("device_move_failed", rank=req.rank, epoch=req.epoch, to=placement.to,
                                      error=str(e))
                else:
                    self._moved[req.rank] = moved if isinstance(moved, device_loss.Moved) else moved.remote
                    self._events.emit("device_moved", rank=req.rank, epoch=req.epoch, to=placement.to,
                                      device=placement.device, old_device=req.device,
                                      dump_s=round(moved.dump_s, 4), restore_s=round(moved.restore_s, 4),
                                      image_bytes=moved.image_bytes, pause_s=round(time.monotonic() - t0, 4))
                    print(f"jitrun: rank {req.rank}'s device {req.device} was lost: moved the live process to "
                          f"device {placement.device} on {placement.to} (dump {moved.dump_s:.2f}s, restore "
                          f"{moved.restore_s:.2f}s, {moved.image_bytes >> 20} MiB)", flush=True)
                    continue
            if Path(f"/proc/{self._mig_pids.get(req.rank, 0)}").exists():
                device_loss.refuse(self._device_dir, req, why)
            self._events.emit("device_move_refused", rank=req.rank, epoch=req.epoch, why=why)
            print(f"jitrun: rank {req.rank}'s device {req.device} was lost and its process is not moved ({why}); "
                  "it falls back to the JIT checkpoint path", file=sys.stderr, flush=True)

    # -- migration (issue 13) -----------------------------------------------------

    def _reader_store(self, wg: WorkerGroup):
        """The workers' store, on the report reader's connection (main thread only)."""
        if self._reader is None:
            self._poll(wg, absorb=False)
        return self._reader._store  # type: ignore[union-attr]

    def _migrate_out(self, wg: WorkerGroup) -> None:
        """This node's ranks of each requested migration are paused: move them (one at a
        time; the peers wait at their minibatch start meanwhile)."""
        store = self._reader_store(wg)
        coord = self._coord.store if self._coord is not None else None
        for gen, msgs in sorted(self._migrating.items()):
            req = json.loads(store.get(migrate.key(self._jit.token, gen, "req")))
            moving = migrate.moving_ranks(req)
            mine = [int(m["rank"]) for m in msgs]
            resume = None
            for m in msgs:
                rank = int(m["rank"])
                try:
                    if coord is None:
                        raise migrate_agent.MigrationError("setup", "no coordination store (static rendezvous)")
                    done = migrate_agent.migrate_out(
                        coord_store=coord, worker_store=store, token=self._jit.token, root=self._jit.root,
                        gen=gen, req=req, rank=rank, pid=self._mig_pids.get(rank, 0), ctl=Path(m["ctl"]),
                        output=self._mig_out.get(rank),
                        store_addr=(wg.master_addr, wg.master_port), attempt=self._round, events=self._events)
                except migrate_agent.MigrationError as e:
                    print(f"jitrun: migration {gen} of rank {rank} to {req.get('to')} failed at {e.stage}: "
                          f"{e.why}; the job falls back to a JIT checkpoint and a restart", file=sys.stderr,
                          flush=True)
                    for other in msgs:  # this node's other moving ranks wait for a word too
                        if int(other["rank"]) not in self._moved and other is not m:
                            migrate_agent.fail(store, self._jit.token, gen, int(other["rank"]),
                                                Path(other["ctl"]), f"rank {rank}'s migration failed: {e.why}")
                    break
                self._moved[rank] = migrate_agent.Remote(coord, self._jit.token, done["id"], done["to"])
                resume = {"prefix": migrate_agent.prefix(self._jit.token, self._round, gen),
                          "store": [wg.master_addr, wg.master_port]}
                print(f"jitrun: rank {rank} migrated to {done['to']} (dump {done['dump_s']}s, transfer "
                      f"{done['transfer_s']}s, restore {done['restore_s']}s, {done['image_bytes'] >> 20} MiB)",
                      flush=True)
            else:
                if resume is not None:
                    migrate_agent.release_peers(store, self._jit.token, gen, len(moving), len(mine), resume)
        self._migrating.clear()

    def _set_local_rank_env(self, worker_env: dict, local_rank: int, spec) -> None:
        super()._set_local_rank_env(worker_env, local_rank, spec)
        # Forked (warm) workers carry the environment of the fork server's
        # start; what jitrun changed since (the shared job token, restore
        # step, scheduler placement) goes in explicitly.
        for k, v in warm.changed_env().items():
            worker_env.setdefault(k, v)
        for k in self._jit_env_keys:
            if k in os.environ:
                worker_env[k] = os.environ[k]

    def _track_life(self, procs: dict[int, _Proc]) -> None:
        now = time.time()
        for r, p in procs.items():
            ticks = _cpu_ticks(p.pid)
            if ticks is not None and (r not in self._life or self._life[r][0] != ticks):
                self._life[r] = (ticks, now)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._unhealthy:
            self._on_unhealthy(worker_group)
        if self._device_dir is not None:
            self._on_device_lost(worker_group)
        procs = self._procs(worker_group)
        self._wakeup.wait([p.pid for p in procs.values() if p.pid and p.poll() is None], self._monitor_s)
        msgs = self._poll(worker_group, absorb=False)
        self._track_life(procs)
        codes = {r: p.poll() for r, p in procs.items()}
        failed = {r: c for r, c in codes.items() if c not in (None, 0)}
        # An injected fault's announcement only timestamps the failure; detection
        # is the healthy ranks' (or an exit), as it would be for a real fault.
        now = [m for m in msgs if self._of_this_round(m)]
        for m in now:
            if m["event"] == "fault_injected":
                self._fault_t = m["t"] if self._fault_t is None else min(self._fault_t, m["t"])
                self._fault_step = max(self._fault_step, int(m.get("step", -1)))
        reported = any(m["event"] == "failure_detected" for m in now)
        if not failed and not reported and self._coord is not None and self._coord.failed(self._round):
            reported = True  # another node's agent is handling a failure of this round
        self._finished |= {r for m in msgs if m["event"] == "finished" for r in [m["rank"]]}
        if not failed and not reported and self._finished:
            # No collective is left to time out once a peer finished: a rank
            # stopped in its last minibatch would be waited on forever.
            for r, c in codes.items():
                if c is None and _proc_state(procs[r].pid) == "T":
                    failed[r] = -int(signal.SIGSTOP)
                    self._events.emit("failure_detected", rank=r, reason="stopped after peers finished")
        if failed or reported:
            self._failure = _Failure(time.time())
            self._failure.fault_t, self._fault_t = self._fault_t, None
            # the failing rank said its step before it died, possibly a poll earlier: without it a
            # recovery with no surviving reporter (every rank killed) could not say what it redid
            self._failure.progress, self._fault_step = self._fault_step, -1
        for m in msgs:
            self._absorb(m)
        if self._migrating and not failed and not reported:
            self._migrate_out(worker_group)
            return RunResult(state=WorkerState.HEALTHY)
        if not failed and not reported:
            if self._moved and all(c == 0 for c in codes.values()):
                self._poll(worker_group, drain=True)
                return RunResult(state=WorkerState.SUCCEEDED, return_values={r: None for r in codes})
            if hasattr(self._pcontext, "_ret_vals"):
                res = self._mp_progress(worker_group)
            elif all(c == 0 for c in codes.values()):
                res = super()._monitor_workers(worker_group)
            else:
                return RunResult(state=WorkerState.HEALTHY)
            if res.state == WorkerState.SUCCEEDED:
                # the workers' last reports (resumed, finished), written
                # before they exited, may not have been read yet; a slot a
                # killed writer left empty no longer holds them up
                self._poll(worker_group, drain=True)
            return res
        return self._handle_failure(worker_group)

    def _handle_failure(self, wg: WorkerGroup) -> RunResult:
        f = self._failure
        assert f is not None
        deadline = time.monotonic() + self._jit.timeout_s + self._jit.save_timeout_s
        if self._coord is not None:
            self._coord.handling(self._round)
        handlers = self._procs(wg)
        termed: set[int] = set()
        termed_at = time.monotonic()
        grace_until: float | None = None
        while True:
            codes = {r: h.poll() for r, h in handlers.items()}
            for r, c in codes.items():
                if c is not None and r not in self._exited:
                    self._exited[r] = c
                    f.done.add(r)
                    self._events.emit("worker_exit", rank=r, exitcode=c,
                                      signal=signal.Signals(-c).name if c < 0 else None)
                    if c != EXIT_SAVED:
                        f.reasons.setdefault(r, f"exit {c}")
                    if c == EXIT_DIVERGED:
                        f.diverged = True
            alive = [r for r, c in codes.items() if c is None]
            # Ask live workers to save now instead of waiting for their collectives
            # to time out; a stopped rank keeps it pending and is killed below.
            for r in alive:
                if r not in termed:
                    termed.add(r)
                    handlers[r].signal(signal.SIGTERM)
            if not alive:
                break
            shards_needed = set(self._shards.values()) or {"0"}
            complete = shards_needed <= {m["shard"] for m in f.saved.values()}
            if complete:
                if self._newer_may_come(f, alive, handlers, termed_at):
                    pass  # a live replica is ahead of the saved step: its save is the one to restore
                elif not (f.saving & set(alive)):
                    break
                # another replica of the same step is mid-save: give it a moment, it's not needed
                elif grace_until is None:
                    grace_until = time.monotonic() + 1.0
                elif time.monotonic() > grace_until:
                    break
            elif not f.saving & set(alive) and not self._may_still_save(f, alive, handlers, termed_at):
                break  # no complete checkpoint will come; fall back to an older one
            if time.monotonic() > deadline:
                break
            self._wakeup.wait([handlers[r].pid for r in alive if handlers[r].pid], 0.1)
            self._poll(wg)
        # savers that published are exiting on their own; the rest (stopped,
        # hung, still saving an unneeded replica) are killed now
        exit_by = time.monotonic() + 2.0
        while time.monotonic() < exit_by:
            savers = [handlers[r].pid for r in f.saved if r in handlers and handlers[r].poll() is None]
            if not savers:
                break
            if any(savers):
                self._wakeup.wait([p for p in savers if p], exit_by - time.monotonic())
            else:  # only migrated ranks: their exits come through the store
                time.sleep(0.05)
        for r, h in handlers.items():
            if h.poll() is None:
                f.killed.append(r)
                h.signal(signal.SIGKILL)
        if f.killed:
            self._events.emit("ranks_killed", ranks=sorted(f.killed), signal="SIGKILL")
        for h in handlers.values():
            h.wait()
        for r, h in handlers.items():
            c = h.poll()
            if r not in self._exited and c is not None:  # savers that left after the loop, the killed
                self._events.emit("worker_exit", rank=r, exitcode=c, killed=r in f.killed,
                                  signal=signal.Signals(-c).name if c < 0 else None)
        f.stopped_t = time.time()
        self._poll(wg)
        if f.ckpt_done_t is None and f.saved:
            f.ckpt_done_t = f.stopped_t
        if f.diverged:
            self._remaining_restarts = 0
            self._events.emit("job_abort", why="ranks loaded different checkpoint steps")
            print("jitrun: ABORT: the ranks of this job loaded different checkpoint steps (see the workers' "
                  "'state divergence' lines); no training step was taken and the job is not restarted. "
                  "Check that every node sees the same jit dir contents or can reach the others.",
                  file=sys.stderr, flush=True)
        elif self._choose_restore(f, wg):
            # The failure came after the last minibatch of a replica of every
            # shard: the job's result exists; restarting would redo it all.
            self._events.emit("finished_despite_failure", failed_ranks=sorted(f.reasons),
                              finished_ranks=sorted(self._done_ranks()))
            print("jitrun: a rank failed after its replicas finished the job; the finished replicas' result "
                  "stands, nothing to restart", flush=True)
            self._failure = None
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={r: None for r in handlers})
        failures = {}
        local_of = {w.global_rank: w.local_rank for w in wg.workers}
        # the report torchrun prints when restarts run out names the first
        # failure as root cause: the ranks that failed, earliest last sign of
        # life first, not the healthy ones that saved (exit 75)
        codes = {r: h.poll() for r, h in handlers.items()}
        culprits = [r for r, c in codes.items() if c not in (0, EXIT_SAVED)] or \
            [r for r, c in codes.items() if c != 0]
        culprits.sort(key=lambda r: self._life.get(r, (0, float("inf")))[1])
        for r in culprits:
            lr = local_of[r]
            failures[r] = ProcessFailure(local_rank=lr, pid=handlers[r].pid, exitcode=codes[r],
                                         error_file=self._pcontext.error_files[lr])  # type: ignore[union-attr]
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _done_ranks(self) -> set[int]:
        """Ranks that finished the job: reported by any node, or exited 0 here."""
        return self._finished | {k for k, c in self._exited.items() if c == 0}

    def _last_alive(self, f: _Failure) -> float | None:
        """When the first of this node's failed ranks last used CPU."""
        culprits = set(f.killed) | {r for r, c in self._exited.items() if c not in (0, EXIT_SAVED, 76)}
        times = [self._life[r][1] for r in culprits if r in self._life]
        return min(times) if times else None

    UNHEARD_S = 0.5  # a healthy rank answers the SIGTERM from its watcher thread within this

    def _possible_savers(self, f: _Failure, alive: list[int], procs: dict[int, _Proc], since: float,
                         grace: float) -> list[int]:
        """Live ranks that could still publish a checkpoint: not one without a
        save_fn, one already done or saved, one that is stopped, or one that
        has said nothing for ``grace`` since it was asked to save (a healthy
        rank answers at once from its watcher thread; a rank hung holding the
        GIL never does)."""
        now = time.monotonic()
        return [r for r in alive if r in self._shards and r not in f.done and r not in f.saved
                and _proc_state(procs[r].pid) != "T" and (r in f.responded or now - since <= grace)]

    def _newer_may_come(self, f: _Failure, alive: list[int], procs: dict[int, _Proc], since: float) -> bool:
        """Every shard has a replica, but could a live rank still publish a newer
        step? One that is saving (or will save at its next minibatch start) a
        step past the newest saved, or one that has not answered yet: a rank
        whose failure was its own SIGTERM saves at its minibatch start while its
        peer completes that minibatch and moves on; restoring the first replica
        would redo two minibatches."""
        newest = max(int(m["step"]) for m in f.saved.values())
        return any(f.rank_step[r] > newest if r in f.rank_step else r not in f.responded
                   for r in self._possible_savers(f, alive, procs, since, self.UNHEARD_S))

    def _may_still_save(self, f: _Failure, alive: list[int], procs: dict[int, _Proc], since: float) -> bool:
        """Could a live rank still publish a checkpoint (see _possible_savers)?"""
        grace = max(2.0, min(self._jit.timeout_s, 10.0))
        return bool(self._possible_savers(f, alive, procs, since, grace))

    def _choose_restore(self, f: _Failure, wg: WorkerGroup) -> bool:
        """Set the restore step; True when there is nothing to restart (every
        shard has a replica that finished the job before the failure)."""
        jit_steps = {int(m["step"]) for m in f.saved.values()}
        if self._coord is None:  # a backend without a store (static): this node's disk is all we know
            replicas, _bad = layout.scan(self._jit.root, self._jit.job_id)
            shards = set(self._shards.values()) | {r.shard for r in replicas} or {"0"}
            step = layout.select_step(replicas, shards)
            if decide.all_shards_finished({str(k): v for k, v in self._shards.items()}, self._done_ranks(), shards):
                return True
        else:
            d = self._decide(f, wg)
            if d.complete:
                return True
            step = d.step
            # saved after this failure was seen, on any node (this agent may
            # not have read the other nodes' reports yet)
            if step is not None and any(src.get("saved_at", 0.0) >= f.detected_t - 1.0
                                        for srcs in d.sources.values() for src in srcs):
                jit_steps.add(step)
            # --- issue 12: an EC snapshot chosen job-wide replaces an older (or no) replica step ---
            if d.source == "ec":
                step = d.ec_step
            # --- end issue 12 ---
        if step is None and not self._shards:
            # drop-in: the script restarts as it would under torchrun, on its own checkpoints if it has any
            self._events.emit("no_jit_checkpoint", fallback_step=None, why="no save_fn registered")
            print("jitrun: no rank registered a save_fn (jitckpt.register): restarting the script, which resumes "
                  "from its own checkpoints if it keeps any", flush=True)
        elif step is None or step not in jit_steps:
            self._events.emit("no_jit_checkpoint", fallback_step=step,
                              why="no shard-complete checkpoint from this failure")
            print(f"jitrun: no complete JIT checkpoint for every shard after this failure; "
                  f"{'falling back to step ' + str(step) if step is not None else 'the workers restart without one'}",
                  flush=True)
        f.restore_step = step
        os.environ["JITCKPT_RESTORE_STEP"] = "none" if step is None else str(step)
        return False

    def _decide(self, f: _Failure, wg: WorkerGroup) -> decide.Decision:
        """The job-wide decision for this failure: post this node's replicas,
        wait for every node of the round (a node whose agent has not even
        started handling the failure within a few seconds is taken as lost),
        first writer wins."""
        coord = self._coord
        assert coord is not None
        r = self._round
        inv = decide.inventory(self._jit.root, self._jit.job_id, self._node, self._done_ranks())
        inv["last_alive"] = self._last_alive(f)
        coord.post(r, inv)
        nodes = coord.nodes(r, wg.group_world_size)
        # every live agent joins within a monitor tick of the first one (the
        # round's "failed" key); one that has not started by then is gone
        grace = f.handling_since + 3.0
        final = f.handling_since + self._jit.timeout_s + self._jit.save_timeout_s + 5.0
        invs = coord.wait_inventories(r, nodes, grace, final)
        # the other nodes posted after their savers exited: their ranks'
        # reports (checkpoint_saved, the step in progress) are in the store
        # now, and the record this node may write needs them
        self._poll(wg)
        d = decide.compute(r, invs, {str(k): v for k, v in self._shards.items()}, nodes,
                           decided_by=self._node.node_id)
        lives = [i["last_alive"] for i in invs if i.get("last_alive")]
        if f.fault_t is None and lives:
            f.fault_t = min(min(lives), f.detected_t)
        won = coord.publish(d)
        self._decision = won
        self._events.emit("restore_decision", round=r, step=won.step, why=won.why, decided_by=won.decided_by,
                          lost=[n["node_id"] for n in won.lost],
                          sources={sh: [s["node_id"] for s in srcs] for sh, srcs in won.sources.items()})
        if won.lost:
            print(f"jitrun: node(s) {', '.join(n['addr'] for n in won.lost)} did not answer after the failure; "
                  "taken as lost", flush=True)
        # --- issue 12 (EC snapshots): which source the restart uses, why not a better one, steps lost ---
        if not won.complete and won.ec is not None:  # only with --jit-ec-every N > 0
            self._events.emit("restore_source", **decide.source_event(won, f.progress))
            print(f"jitrun: {decide.source_line(won, f.progress)}", flush=True)
        # --- end issue 12 ---
        return won

    # -- restart ----------------------------------------------------------------

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        f = self._failure
        spec = worker_group.spec
        restart_count = spec.max_restarts - self._remaining_restarts
        failed_ranks = sorted(
            ({r for r, c in self._exited.items() if c not in (0, EXIT_SAVED)} | set(f.killed if f else []))
            - set(f.saved if f else []))
        devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        local_of = {w.global_rank: w.local_rank for w in worker_group.workers}
        dev_list = devices.split(",") if devices else []
        failed_devices = sorted({dev_list[local_of[r]] for r in failed_ranks
                                 if r in local_of and local_of[r] < len(dev_list)} | self._bad_devices)
        if self._bad_devices and not devices:  # NVML's indices: make the visible set explicit
            devices = ",".join(self._devices(worker_group))
        failure = {
            "job_id": self._jit.job_id,
            "restart_count": restart_count,
            "failed_ranks": failed_ranks,
            "failed_devices": failed_devices,
            "nproc_per_node": spec.local_world_size,
            "reasons": {str(k): v for k, v in (f.reasons if f else {}).items()},
            "restore_step": f.restore_step if f else None,
            "hosts": [self._node.host],
            "devices": devices,
            "node": {"node_id": self._node.node_id, "host": self._node.host, "addr": self._node.addr},
            "failed_hosts": [self._node.host] if failed_ranks else [],
            "lost_nodes": [],
            "command": self._jit.command,
        }
        d = self._decision
        if d is not None and d.round == self._round and d.decided_by == self._node.node_id:
            # job-wide facts go to one agent's hook only (one drain, one replacement)
            failure["lost_nodes"] = d.lost
            failure["hosts"] = sorted({n["host"] for n in d.nodes if n not in d.lost})
        placement = scheduler.place(self._jit.scheduler, failure)
        if placement.action == "abort":
            self._events.emit("job_abort", why="scheduler hook answered abort")
            self._remaining_restarts = 0
            self._stop_workers(worker_group)
            raise scheduler.JobAborted("jitrun: scheduler hook asked to abort the job")
        os.environ.update(placement.env)
        self._jit_env_keys.update(placement.env)
        if placement.visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = placement.visible_devices
        self._exited.clear()
        if f is not None:
            f.restart_t = time.time()
            self._pending = f
        self._events.emit("restart", restart_count=restart_count,
                          restore_step=f.restore_step if f else None,
                          placement={"action": placement.action, "env": sorted(placement.env),
                                     "visible_devices": placement.visible_devices})
        self._failure = None
        super()._restart_workers(worker_group)

    def _on_resumed(self, m: dict) -> None:
        f = self._pending
        if f is None or f.restart_t is None:
            return
        d = self._decision
        if d is not None and d.decided_by != self._node.node_id:
            self._pending = None  # the deciding node writes the job's recovery line
            return
        self._pending = None
        if f.fault_t is None:
            f.fault_t = self._last_alive(f)
        failure_t = f.fault_t if f.fault_t is not None else f.detected_t
        # what the ranks actually loaded, not the plan
        loaded = {v for v in self._loaded.values() if v is not None}
        restore: int | None
        if len(loaded) == 1:
            got = next(iter(loaded))
            restore = got if isinstance(got, int) else 0  # "fresh": from the start
        else:
            # no rank asked get_checkpoint_path(): the script restored on its
            # own (or not at all); what it redid is not known here
            restore = None
        rec = {
            "failure_t": failure_t,
            "detection_s": round(f.detected_t - failure_t, 3),
            "checkpoint_s": round(f.ckpt_done_t - f.detected_t, 3) if f.ckpt_done_t is not None else None,
            "restart_to_resumed_s": round(m["t"] - f.restart_t, 3),
            "failure_to_resumed_s": round(m["t"] - failure_t, 3),
            "restore_step": restore,
            "progress_step": f.progress,
            # the minibatch in progress at the failure (index f.progress) and
            # every one after the restore step up to it are done again
            # (unknown when no rank reported its step before it stopped)
            "redone_minibatches": (max(f.progress + 1 - restore, 0)
                                   if f.progress >= 0 and restore is not None else None),
            "minibatch_s": statistics.median(f.minibatch_s) if f.minibatch_s else None,
            "stages": self._stages(f, failure_t, m["t"]),
        }
        self._events.emit("recovery", **rec)

    def _stages(self, f: _Failure, failure_t: float, resumed_t: float) -> dict[str, float]:
        """Where the time between the failure and the first minibatch
        finished after the restart went, stage by stage; consecutive, so they
        add up to failure_to_resumed_s. A worker milestone is the slowest
        rank's: the job moves at the pace of its last rank."""
        def last(d: dict[int, float]) -> float | None:
            return max(d.values()) if d else None

        query, train = last(self._query), last(self._train)
        if query is None:  # a script that never asked for a checkpoint: all of it is its start-up
            query, train = train, None
        marks = [("detection", f.detected_t), ("checkpoint", f.ckpt_done_t), ("stop", f.stopped_t),
                 ("decision", f.restart_t), ("rendezvous", f.rdzv_t), ("process_start", last(self._boot)),
                 ("import_and_init", query), ("checkpoint_load", train),
                 ("first_minibatch", resumed_t)]
        out: dict[str, float] = {}
        prev = failure_t
        for name, t in marks:
            if t is None:
                continue  # e.g. no checkpoint was taken, or the script never asked for one
            out[name] = round(max(t - prev, 0.0), 3)
            prev = max(prev, t)
        return out
