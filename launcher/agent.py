"""JitAgent: torchrun's LocalElasticAgent with JIT-aware failure handling.

torchrun stops the world on the first worker failure (SIGTERM, 30 s grace,
SIGKILL) and restarts, which would kill the healthy replicas while they
save. JitAgent overrides five of the agent's hooks and hands the work to
one collaborator per job, so a failure reads straight through:

failure (``_monitor_workers``: a worker exit, a worker's report, another
node's failure mark) -> save (``recovery.episode``: live workers asked to
save, savers waited for, the rest killed) -> decide (``recovery.restore``:
the job-wide restore step) -> restart (``_restart_workers``: the scheduler
hook, then torchrun's restart loop) -> restore (``_start_workers``: the
chosen replica fetched here if missing; the workers load it).

``recovery.failure`` holds the episode's stage as it moves along this path
(detected, saving, stopped, decided, restarted, resumed) and the agent's
book of episodes (the one handled, the one restarted, this round's exits).

Beside it: ``recovery.reports`` (what the workers' reports say),
``recovery.record`` (the timeline's recovery line), ``devices.watch``
(NVML health, lost devices), ``migration.outbound`` (``jitrun migrate``).
Agent's main thread, except the threads each collaborator documents.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from jitckpt.error_file import State
from jitckpt.torch_compat import elastic
from jitckpt.wire import auth, layout
from jitckpt.wire.report import JOB, Reporter, ReportReader, connect

from . import error_files, rdzv, warm
from . import worker_env as jit_env
from .devices import describe, scheduler
from .devices.watch import DeviceWatch
from .events import EventLog
from .migration import control as migrate
from .migration.inbound import start_target
from .migration.outbound import move_out
from .options import JitOptions, this_node
from .preempt import Preempted, Preemption
from .recovery import alive, episode
from .recovery.detect import Detector
from .recovery.episode import Episode
from .recovery.failure import RecoveryBook
from .recovery.hang import HangWatch
from .recovery.preempted import outcome, stop_workers
from .recovery.record import recovery_record
from .recovery.reports import ReportBook
from .recovery.restore import STATIC_LOST, Restorer
from .wakeup import Cadence, Wakeup
from .workers import Proc, Whereabouts, cpu_seconds, forked_progress, write_ranks

# the longest the monitor loop goes without reading the store (reports and exits wake it: wakeup.Cadence)
STORE_POLL_S = 0.25


class JitAgent(LocalElasticAgent):
    def __init__(self, *args, jit: JitOptions, events: EventLog, preempt: Preemption | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._jit = jit
        self._events = events
        # SIGTERM/SIGINT for the job (launcher/preempt.py); _live: this node's workers run (or
        # are being started), so the handler only notes the signal and the monitor loop stops them
        self._preempt = preempt or Preemption(jit.preempt_grace_s)
        self._live = False
        self.preempt_result: tuple[int, str] | None = None  # (exit code, line), once preempted
        # a record in the store that does not verify under the job token: one line in the timeline
        auth.on_reject(lambda what, why: events.emit("record_rejected", what=what, why=why))
        spec = self._worker_group.spec
        self._node = this_node(spec.local_addr)
        events.node = self._node.node_id
        self._round = 0
        self._local_ranks: set[int] = set()
        jit_env.report_stream(self._node.node_id)  # this node's workers report to this agent only
        self._reader: ReportReader | None = None
        self._store_reads = Cadence(STORE_POLL_S)
        self._store_addr: tuple[str, int] | None = None
        self._recovery = RecoveryBook()  # the failure being handled, the one restarted, this round's exits
        self._spare_seen = False
        # torchrun sleeps monitor_interval between looks; we block in
        # _monitor_workers until an exit or a report instead (Wakeup), with
        # the interval as the longest wait
        self._monitor_s = spec.monitor_interval
        spec.monitor_interval = 1e-6
        self._wakeup = Wakeup()
        self._preempt.poke, self._preempt.interruptible = self._wakeup.poke, lambda: not self._live
        self._preempt.install()
        self._where = Whereabouts()
        self._book = ReportBook(events)
        self._detector = Detector(self._book, events)
        self._hang = HangWatch(jit.root, events, ceiling_s=jit.timeout_s,
                               enabled=not jit.timeout_fixed and not migrate.enabled())
        self._restorer = Restorer(jit, self._node, events)
        self._devices = DeviceWatch(jit, self._node, events, self._wakeup.poke, self._where)
        handler = spec.rdzv_handler
        rdzv.install(handler, on_spare=self._on_spare,
                     healthy=lambda: self._recovery.current is None and self._worker_group.state == WorkerState.HEALTHY)
        self._dropped: set[str] = set()  # rendezvous names of nodes taken as lost (_on_lost)
        rdzv.drop_silent(handler, lambda: self._restorer.silence, self._on_lost)
        self._target = start_target(rdzv.coordination_store(handler), jit, self._node, events)
        self._bad_error_files: set[str] = set()
        error_files.install(self._on_bad_error_file)  # torch's reads of them too (error_files.py)

    # -- reports ------------------------------------------------------------------

    def _poll(self, wg: WorkerGroup, absorb: bool = True, drain: bool = False) -> list[dict]:
        addr = (wg.master_addr, wg.master_port)
        if self._reader is None or addr != self._store_addr:
            self._reader = ReportReader(connect(*addr), self._jit.token, streams=(self._node.node_id, JOB),
                                        from_now=self._reader is None and self._round > 0)
            self._store_addr = addr
            self._wakeup.watch(addr, self._jit.token, self._node.node_id)
        msgs = self._reader.poll(drain=drain)
        if absorb:
            for m in msgs:
                self._book.absorb(m, self._recovery.current, self._on_resumed)
            self._restorer.share(self._book, self._round)
        return msgs

    def _worker_store(self, wg: WorkerGroup):
        """The workers' store, on the report reader's connection (main thread only)."""
        if self._reader is None:
            self._poll(wg, absorb=False)
        return self._reader.store  # type: ignore[union-attr]

    def _procs(self, wg: WorkerGroup) -> dict[int, Proc]:
        return self._where.procs(self._pcontext, wg)

    # -- rendezvous and start -------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        handler = worker_group.spec.rdzv_handler
        self._round = rdzv.job_attempt(handler, worker_group.spec.max_restarts - self._remaining_restarts)
        jit_env.attempt(self._round)
        self._local_ranks = {w.global_rank for w in worker_group.workers}
        self._book.new_round(self._round, self._local_ranks)
        self._where.asked.clear()
        self._hang.new_round(self._round, self._local_ranks, worker_group.workers[0].world_size)
        self._hang.post = lambda fields: Reporter(self._worker_store(worker_group), self._jit.token, None).send(
            "hang_suspect", node=self._node.node_id, attempt=self._round, **fields)
        self._hang.silent_nodes = lambda: self._restorer.silent_peers(self._round, worker_group.group_world_size)
        self._recovery.rendezvous_done(time.time())
        self._restorer.join_round(rdzv.coordination_store(handler), self._round, worker_group.group_rank,
                                  rdzv.node_name(handler))
        self._events.emit("rendezvous", round=self._round, group_rank=worker_group.group_rank,
                          group_world_size=worker_group.group_world_size,
                          ranks=sorted(self._local_ranks), host=self._node.host, addr=self._node.addr)
        self._poll(worker_group)  # connect the report reader before this round's workers report

    def _start_workers(self, worker_group: WorkerGroup):
        self._live = True  # a preemption from here on is handled once they run, none is left behind
        self._restorer.prepare(self._local_ranks)
        self._devices.before_start(worker_group)
        pids = super()._start_workers(worker_group)
        if migrate.enabled():  # where each migratable rank runs
            ranks = migrate.record_workers(self, worker_group)
            self._where.reset(ranks)
            migrate.publish(self._worker_store(worker_group), self._jit.token, self._jit.root, ranks,
                            (worker_group.master_addr, worker_group.master_port))
        self._write_ranks(worker_group)
        return pids

    def _write_ranks(self, wg: WorkerGroup) -> None:
        write_ranks(self._jit.root, self._procs(wg), self._where, self._node, self._round)

    def _set_local_rank_env(self, worker_env: dict, local_rank: int, spec) -> None:
        super()._set_local_rank_env(worker_env, local_rank, spec)
        # Forked (warm) workers carry the environment of the fork server's
        # start; what jitrun changed since (the shared job token, restore
        # step, scheduler placement) goes in explicitly.
        for k, v in warm.changed_env().items():
            worker_env.setdefault(k, v)
        jit_env.into(worker_env)

    def announce_hang_bound(self, when: str) -> None:
        self._hang.announce(when)

    def close(self) -> bool:
        """End our threads before the interpreter exits; False if one would
        not stop (the caller then leaves with os._exit)."""
        if self._target is not None:
            self._target.stop()
        self._devices.stop()
        woke = self._wakeup.close()
        return self._restorer.close() and woke

    def _on_lost(self, names: list[str]) -> None:
        new = [n for n in names if n not in self._dropped]
        self._dropped.update(new)
        if new:
            self._events.emit("node_lost", nodes=new, evidence=f"agent silent for {alive.QUIET_S:g} s")
            print(f"jitrun: node(s) {', '.join(new)} lost: their agents stopped answering the job's store "
                  f"for {alive.QUIET_S:g} s; the job goes on without them", flush=True)

    def _on_bad_error_file(self, local_rank: int, path: str, state: State) -> None:
        """A failed worker's error file that could not be used (empty, torn,
        unreadable): its failure is reported without it; the timeline says why."""
        if path in self._bad_error_files:
            return
        self._bad_error_files.add(path)
        rank = next((w.global_rank for w in self._worker_group.workers if w.local_rank == local_rank), None)
        self._events.emit("error_file_unusable", rank=rank, local_rank=local_rank, path=path, state=state.name,
                          detail=state.detail)
        print(f"jitrun: rank {rank}'s error file {path} is {state.name} ({state.detail}); its failure is reported "
              "from its exit code", file=sys.stderr, flush=True)

    def _on_spare(self, n: int) -> None:
        if not self._spare_seen:
            self._spare_seen = True
            self._events.emit("spare_waiting", nodes=n)
            print(f"jitrun: {n} node(s) waiting to join; kept as spare(s) until a failure", flush=True)

    # -- monitoring ---------------------------------------------------------------

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._preempt.check()
        res = self._look(worker_group)
        if res.state == WorkerState.SUCCEEDED:
            self._live = False
        return res

    def _look(self, worker_group: WorkerGroup) -> RunResult:
        procs = self._procs(worker_group)
        coord = self._restorer.coord
        self._devices.tick(worker_group, procs, self._local_ranks, coord.store if coord else None,
                           lambda: self._worker_store(worker_group), lambda: self._write_ranks(worker_group))
        procs = self._procs(worker_group)
        woken = self._wakeup.wait([p.pid for p in procs.values() if p.pid and p.poll() is None], self._monitor_s)
        self._preempt.check()  # the workers' reports of the same signal are no failure
        codes = {r: p.poll() for r, p in procs.items()}
        woken = woken or any(c is not None for c in codes.values())  # an exit the wait did not see
        read_store = self._store_reads.due(woken, time.monotonic())
        msgs = self._poll(worker_group, absorb=False) if read_store else []
        pids = {r: self._where.ns_pids.get(r, p.pid) for r, p in procs.items()}
        cpu = {r: cpu_seconds(pid) for r, pid in pids.items()}
        self._book.track_life(cpu)
        suspects = [m for m in msgs if m["event"] == "hang_suspect" and m.get("node") != self._node.node_id
                    and self._book.of_this_round(m)]
        hung = (None if any(c not in (None, 0) for c in codes.values())
                else self._hang.tick(procs, pids, cpu, suspects))
        remote = read_store and coord is not None and coord.failed(self._round)
        failed = self._detector.check(msgs, codes, procs, remote, hung,
                                      peers_finished=lambda: coord is not None and coord.some_finished(self._round))
        if failed:
            self._recovery.detected(failed)
        for m in msgs:
            self._book.absorb(m, self._recovery.current, self._on_resumed)
        self._restorer.share(self._book, self._round)
        if failed:
            return self._handle_failure(worker_group)
        started = warm.prepare_next(self._jit.root)
        if started:
            self._events.emit("warm_imports", started=True, modules=len(started),
                              packages=sorted({m.partition(".")[0] for m in started}))
        if self._book.migrating:
            move_out(self._book.migrating, store=self._worker_store(worker_group),
                     coord=coord.store if coord else None, token=self._jit.token, root=self._jit.root,
                     where=self._where, attempt=self._round,
                     store_addr=(worker_group.master_addr, worker_group.master_port), events=self._events,
                     on_moved=lambda: self._write_ranks(worker_group))
            return RunResult(state=WorkerState.HEALTHY)
        if self._where.moved and all(c == 0 for c in codes.values()):
            self._poll(worker_group, drain=True)
            return RunResult(state=WorkerState.SUCCEEDED, return_values={r: None for r in codes})
        if elastic.forked(self._pcontext):
            res = forked_progress(self._pcontext, worker_group, procs)
        elif all(c == 0 for c in codes.values()):
            res = super()._monitor_workers(worker_group)
        else:
            return RunResult(state=WorkerState.HEALTHY)
        if res.state == WorkerState.SUCCEEDED:
            # the workers' last reports (resumed, finished), written before
            # they exited, may not have been read yet; a slot a killed writer
            # left empty no longer holds them up
            self._poll(worker_group, drain=True)
        return res

    # -- the failure episode --------------------------------------------------------

    def _handle_failure(self, wg: WorkerGroup) -> RunResult:
        f = self._recovery.current
        assert f is not None
        coord = self._restorer.coord
        if coord is not None:
            coord.handling(self._round)
        procs = self._procs(wg)
        Episode(f, procs, exited=self._recovery.exited, shards=self._book.local_shards(), timeout_s=self._jit.timeout_s,
                save_timeout_s=self._jit.save_timeout_s, wait=self._wakeup.wait, poll=lambda: self._poll(wg),
                events=self._events, check=self._preempt.check).run()
        # what a rank killed inside its save left (a save that failed removed its own)
        layout.remove_staging(self._jit.root, {r: p.pid for r, p in procs.items() if p.pid})
        self._live = False
        if self._preempt.by_workers(f.stop_reports, self._local_ranks, self._where.asked):
            raise Preempted(self._preempt.name)
        if f.diverged:
            self._abort("ranks loaded different checkpoint steps", episode.DIVERGED)
        elif f.refused:
            self._abort("a worker refused to train", episode.refused_line(self._book.refused))
        elif f.no_space is not None and not f.saved:
            # a full disk cost this failure's checkpoint, and would cost the next one's: stop, keep the last
            self._abort("no space for the JIT checkpoint", episode.no_space_line(f, self._jit))
        else:
            finished, static_lost = self._restorer.choose(
                f, round_=self._round, group_world_size=wg.group_world_size, shards=self._book.shards,
                done_ranks=self._book.done_ranks(self._recovery.exited),
                last_alive=episode.last_alive(f, self._recovery.exited, self._book.life), poll=lambda: self._poll(wg),
                static=rdzv.is_static(wg.spec.rdzv_handler))
            if finished:
                # The failure came after the last minibatch of a replica of every
                # shard: the job's result exists; restarting would redo it all.
                self._events.emit("finished_despite_failure", failed_ranks=sorted(f.reasons),
                                  finished_ranks=sorted(self._book.done_ranks(self._recovery.exited)))
                print("jitrun: a rank failed after its replicas finished the job; the finished replicas' result "
                      "stands, nothing to restart", flush=True)
                self._recovery.finished()
                return RunResult(state=WorkerState.SUCCEEDED, return_values={r: None for r in procs})
            if static_lost:
                self._abort("node lost under the static rendezvous", STATIC_LOST)
        failures = episode.torchrun_failures(procs, {w.global_rank: w.local_rank for w in wg.workers},
                                             self._pcontext.error_files, self._book.life)  # type: ignore[union-attr]
        return RunResult(state=WorkerState.FAILED, failures=failures)

    # -- preemption (launcher/preempt.py) --------------------------------------------

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        # Passed through as given: torch 2.11 has _shutdown(death_sig), 2.12 to 2.14 add timeout.
        if self._preempt.requested and self.preempt_result is None:
            self._stop_preempted(self._worker_group)
        super()._shutdown(*args, **kwargs)

    def _poll_quietly(self, wg: WorkerGroup, drain: bool = False) -> None:
        """The workers' reports, if the store still answers: their exits are what counts now."""
        try:
            self._poll(wg, drain=drain)
        except Exception as e:  # a store hosted by another node's agent, gone with its node
            self._events.emit("reports_unread", error=f"{type(e).__name__}: {e}"[:300])

    def finish_preempted(self) -> tuple[int, str]:
        """(exit code, line) of a preemption; the workers stopped first if the run did not."""
        if self.preempt_result is None:
            self._stop_preempted(self._worker_group)
        assert self.preempt_result is not None
        return self.preempt_result

    def _stop_preempted(self, wg: WorkerGroup) -> None:
        """This node's workers finish their JIT saves within the grace period; then the outcome."""
        self._preempt.handling = True
        f = self._recovery.preempted(time.time())  # what the workers report from here on
        killed: list[int] = []
        if self._pcontext is not None:
            killed = stop_workers(self._preempt, self._procs(wg), f, exited=self._recovery.exited,
                                  wait=self._wakeup.wait, poll=lambda: self._poll_quietly(wg), events=self._events)
            self._poll_quietly(wg, drain=True)
        self.preempt_result = outcome(self._preempt, f, root=self._jit.root,
                                      shards=set(self._book.local_shards().values()), killed=killed,
                                      exited=self._recovery.exited, events=self._events)

    def _abort(self, why: str, line: str) -> None:
        self._remaining_restarts = 0
        self._events.emit("job_abort", why=why)
        print(line, file=sys.stderr, flush=True)

    # -- restart --------------------------------------------------------------------

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._preempt.check()
        self._live = False
        f = self._recovery.current
        spec = worker_group.spec
        restart_count = spec.max_restarts - self._remaining_restarts
        d = self._restorer.decision
        mine = d is not None and d.round == self._round and d.decided_by == self._node.node_id
        failure = describe.restart(
            self._jit.job_id, self._node, restart_count=restart_count,
            failed_ranks=episode.failed_ranks(f, self._recovery.exited),
            local_of={w.global_rank: w.local_rank for w in worker_group.workers}, bad_devices=self._devices.bad,
            all_devices=self._devices.names(worker_group), nproc=spec.local_world_size,
            reasons=f.reasons if f else {}, restore_step=f.restore_step if f else None,
            command=self._jit.command, decision=d if mine else None,
            sdc_suspects=sorted(episode.sdc_suspects(f, self._recovery.exited)))
        placement = scheduler.place_or_default(self._jit.scheduler, failure, "restarting in place")
        if placement.action == "abort":
            self._events.emit("job_abort", why="scheduler hook answered abort")
            self._remaining_restarts = 0
            self._stop_workers(worker_group)
            raise scheduler.JobAborted("jitrun: scheduler hook asked to abort the job")
        jit_env.placement(placement.env, placement.visible_devices)
        if restart_count == 1:  # torchrun counted this restart already
            self._hang.announce("before the first restart")
        self._recovery.restarted(time.time())  # f waits for its first minibatch; this round's exits forgotten
        self._events.emit("restart", restart_count=restart_count,
                          restore_step=f.restore_step if f else None, placement=placement.summary())
        t0 = time.monotonic()
        st = warm.use_next()
        if st is not None:
            self._events.emit("warm_imports", used=True, imported=st.get("imported"), seconds=st.get("seconds"),
                              waited_s=round(time.monotonic() - t0, 3))
        super()._restart_workers(worker_group)

    def _on_resumed(self, m: dict) -> None:
        """The first minibatch after a restart finished (or a rank finished the
        job right after its restore): the deciding node writes the job's
        recovery line."""
        f = self._recovery.resumed()
        if f is None:
            return
        d = self._restorer.decision
        if d is not None and d.decided_by != self._node.node_id:
            return
        f.note_fault_at(episode.last_alive(f, self._recovery.exited, self._book.life))
        self._events.emit("recovery", **recovery_record(f, self._book, m["t"]))

