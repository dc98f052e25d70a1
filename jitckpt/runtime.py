"""The per-worker JIT runtime: minibatch phases, failure triggers, the JIT save.

Phases (paper §3.3): a replica's state is "the start of minibatch i" while it
is in INIT/FWD/BWD of minibatch i (parameters and optimizer state are only
written by the optimizer step). During OPT and POST (after the step, before the
next minibatch's first collective: the user's scheduler.step(), step counter,
data fetch and RNG snapshot still have to run) a save is deferred to the next
consistent point, the next minibatch's forward/backward/collective entry.

Threads and locks
-----------------
* main thread: runs the user's loop and every phase hook below, and
  ``on_collective_error`` where torch raises a collective error (hooks.py), so
  the save starts before any ``except`` above that frame runs; the end of the
  script (``script_ended``, from _bootstrap.py) is the last such point.
* watcher thread (``jitckpt-watcher``, daemon, signal_watch.py): acts on
  SIGTERM and SIGINT through the signal wakeup pipe (``on_stop_signal``),
  also while the main thread is stuck in a collective with the GIL released,
  so a stop signal is acted on at once instead of when the collective returns.
* the libintercept watchdog thread (when the shim is preloaded) calls
  ``_on_hang`` holding the GIL it obtained through the shim's signal-based GIL
  release.

``_exit_lock``: whoever acts on a stop signal holds it (the watcher, or the
main thread at the script's end); an atexit handler takes it for good, so no
store call is in flight on the watcher when the interpreter finalizes
(signal_watch.py). Lock order: _exit_lock, then _lock.

``_lock`` (threading.Lock) guards ``phase``, ``deferred`` and ``saving``; it
is held only for those few reads/writes, never across save_fn or I/O. Whoever
sets ``saving`` owns the save (or the decision that there is none,
``_leave_unsaved``) and ends the process with ``os._exit``; any other
thread that then needs the lock-protected state (the main thread entering the
optimizer step, a second trigger) parks forever on ``_halt`` so parameters are
never written while they are being saved. The Python-level SIGTERM and
SIGINT handlers are empty on purpose (signal_watch.py).
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from enum import Enum

from . import buffers as _buffers
from . import faults as _faults
from . import import_record, parent_death, save_space
from .collective_errors import find_collective_error
from .listeners import Event, Listeners
from .wire import config as _config
from .wire import contract, layout

SaveFn = Callable[[str], None]


class Phase(Enum):
    INIT = "init"  # process started, training loop not entered yet
    FWD = "forward"
    BWD = "backward"
    OPT = "optimizer"
    POST = "post-step"  # step done, user bookkeeping before next minibatch


class Runtime:
    def __init__(self, cfg: _config.WorkerConfig) -> None:
        self.cfg = cfg
        self.save_fn: SaveFn | None = None
        self.shard = "0"
        self.steps_done = 0  # set to the restored step by get_checkpoint_path()
        self.restored = False
        self.phase = Phase.INIT
        self.phase_t = time.monotonic()
        self.deferred: str | None = None
        self.saving = False
        self.collective_exc: BaseException | None = None  # the first collective error seen (main thread)
        self._lock = threading.Lock()
        self._halt = threading.Event()  # never set: parks threads until os._exit
        self._exit_lock = threading.Lock()  # stop signals are acted on only under it; taken for good at exit
        self.signals = None  # signal_watch.SignalWatch, under jitrun
        self.stop_signal: int | None = None  # the first SIGTERM/SIGINT acted on
        self._step_t: float | None = None
        self._step_times: list[float] = []
        self._resumed_reported = False
        self._counted = True
        self._checked = False
        self.reporter = None
        # the parts that act at the minibatch boundary and the optimizer step (listeners.py): the
        # shim's replay log and phase marks, the groups' timeouts, resume, integrations, EC snapshots
        self.listeners = Listeners()
        self.verifier = None  # verifier.Verifier: the replicas' state checks (jitrun only)
        self.plan = cfg.plan  # what to restore; an EC decode turns it into its step or its fallback (api)
        self.loaded: int | str | None = None  # what get_checkpoint_path() gave (consistency)
        self.loaded_path: str | None = None  # and where it was
        self.query_t: float | None = None  # when get_checkpoint_path() was first asked (timeline)
        self.keeps_rank_state = False  # the save_fn is jitckpt's own (api.keeps_rank_state)
        self.step_read = False  # save_fn asked checkpoint_step() during this save
        self.injector = _faults.Injector(cfg.fault_spec, cfg.rank, cfg.attempt,
                                         announce=self._announce_fault)
        # --jit-migratable on: the migration request watch (one store add per minibatch start)
        self._migration = None
        self._provisional = False  # phase FWD entered at a collective after a step, not a forward
        self._definite = False  # the next collective starts a minibatch (expect_minibatch_start)
        self._body_due: tuple[bool] | None = None  # on_forward_body owes the start's tail (post?)
        self.waits = None  # collective_waits.Waits under jitrun: the record the agent's hang watch reads

    # -- reporting --------------------------------------------------------

    def connect(self) -> None:
        if not self.cfg.managed or self.cfg.store_addr is None:
            return
        from .wire.report import for_worker, process_start_time

        self.reporter = for_worker(self.cfg)
        # --jit-migratable: the old fixed rule (a mapped status file cannot move with a CRIU dump)
        if self.cfg.root is not None and not contract.TIMEOUT_FIXED.get() and not contract.MIGRATABLE.get():
            from .hang.waits import open_waits

            self.waits = open_waits(self.cfg.root, self.cfg.rank, self.cfg.attempt, contract.hang_rule())
        self.report("started", pid=os.getpid(), restart_count=self.cfg.restart_count, attempt=self.cfg.attempt,
                    proc_start_t=process_start_time())
        if contract.MIGRATABLE.get():
            from .migrate_worker import Watch

            self._migration = Watch(self.reporter._store, self.cfg.token)

    def report(self, event: str, **fields) -> None:
        if self.reporter is None or parent_death.agent_gone():  # its agent served the store and read it
            return
        fields.setdefault("attempt", self.cfg.attempt)  # the agent keeps per-round facts per attempt
        try:
            self.reporter.send(event, **fields)
        except Exception as e:  # the launcher may be gone; never mask the real failure
            print(f"[jitckpt] rank {self.cfg.rank}: report {event} failed: {e}", file=sys.stderr)

    def _announce_fault(self, f: _faults.Fault) -> None:
        self.report("fault_injected", step=self.steps_done, phase=f.phase, kind=f.kind)

    def _check_same_state(self) -> None:
        """Before the first training step: every rank loaded the same step, or
        the job stops here (exit EXIT_DIVERGED, which jitrun never restarts)."""
        from .verify.consistency import StateDivergence, StateTampered, check_loaded

        try:
            loaded = check_loaded(self.reporter._store, self.cfg.token, self.cfg.attempt, self.cfg.rank,
                                  self.cfg.world_size, self.loaded, timeout_s=max(600.0, self.cfg.timeout_s))
        except StateDivergence as e:
            self.report("state_divergence", loaded={str(k): v for k, v in e.loaded.items()}, error=str(e))
            print(f"[jitckpt] rank {self.cfg.rank}: REFUSING TO TRAIN: {e}", file=sys.stderr, flush=True)
            os._exit(_config.EXIT_DIVERGED)
        except StateTampered as e:
            self.report("state_divergence", error=str(e))
            print(f"[jitckpt] rank {self.cfg.rank}: REFUSING TO TRAIN: {e}", file=sys.stderr, flush=True)
            os._exit(_config.EXIT_DIVERGED)
        # the replicas' states agree (verify/verifier.py), or the job stops here too
        fp = self.verifier.at_start(loaded) if self.verifier is not None else None
        # also when nothing was asked: the recovery timeline's "training started"
        self.report("loaded", loaded=self.loaded, ranks_asked=sum(v is not None for v in loaded.values()),
                    query_t=self.query_t, fingerprint=fp)

    def minibatch_s(self) -> float | None:
        return statistics.median(self._step_times) if self._step_times else None

    # -- phase hooks (main thread) -----------------------------------------

    def _training_started(self) -> None:
        # the shim's replay log starts with the first minibatch, not with the set-up before it
        # (which could overflow it and can never be replayed)
        self.listeners.fire(Event.MINIBATCH_BEGIN)
        if self.reporter is not None and not self._checked:
            self._checked = True
            self._check_same_state()
            import_record.at_training_start(self.cfg.root)
        self.listeners.fire_once(Event.TRAINING_START)

    def _minibatch_start(self, collective: bool, provisional: bool | None = None) -> None:
        """The hooks of the minibatch boundary, for resume (RNG, counters,
        data position) and EC snapshots (after a step only). ``collective``:
        reached at an explicit collective, which may not start a minibatch
        (a barrier after the loop); only reached from POST there."""
        self._start_head(provisional=collective if provisional is None else provisional, collective=collective)
        self._start_tail(post=self.phase is Phase.POST, collective=collective)

    def _start_head(self, provisional: bool = False, collective: bool = False) -> None:
        groups_gone = False
        if self._migration is not None:
            from .migrate_worker import migration_point

            groups_gone = migration_point(self)
        self.listeners.fire(Event.MINIBATCH_START, provisional)
        if groups_gone:
            # A failed migration left no process group and no DDP reducer: what follows (DDP's
            # buffer broadcast in a forward, the replica check, the collective) would raise.
            self._save_deferred(post_step=collective and self.phase is Phase.POST)

    def _start_tail(self, post: bool, collective: bool) -> None:
        if self.verifier is None and (not post or not self.listeners.has(Event.SNAPSHOT)):
            return
        # Inside a DDP forward the phase is already FWD; the checks and the snapshot run as at
        # the start itself, where a trigger (a SIGTERM while the replicas roll back) is deferred.
        with self._lock:
            inside = self.phase is Phase.FWD and not self.saving
            if inside:
                self.phase = Phase.POST
        try:
            if self.verifier is not None:  # before an EC snapshot: it must not stage an unverified state
                self.verifier.at_minibatch_start(collective, post)
            if post:
                self.listeners.fire(Event.SNAPSHOT, collective)
        finally:
            if inside:
                with self._lock:
                    self.phase = Phase.FWD

    def on_forward(self, body_follows: bool = False) -> None:
        """A training forward begins (the hooks call it only with grad enabled and the module
        in training mode: an evaluation pass starts no minibatch). The first one after an
        optimizer step, or after a collective that stood in for the start, is the minibatch
        start. ``body_follows``: a DDP model, whose buffer broadcast runs between this call and
        ``on_forward_body``; what must see the broadcast buffers waits for that call."""
        post = self.phase is Phase.POST or self._provisional
        start = post or self.phase is Phase.INIT
        if self.phase is Phase.INIT:
            self._training_started()
        if start:
            self._provisional = False
            if body_follows:
                self._start_head()
                self._body_due = (post,)
            else:
                self._minibatch_start(collective=False)
        if self.phase is not Phase.FWD:
            with self._lock:
                self.phase, self.phase_t = Phase.FWD, time.monotonic()
        if not body_follows:
            self.on_forward_body()

    def on_forward_body(self) -> None:
        """Inside a training forward, after DDP's buffer broadcast (buffers.py captured them just
        before): the rest of the minibatch start, a deferred save, the forward's faults."""
        due, self._body_due = self._body_due, None
        if due is not None:
            self._start_tail(post=due[0], collective=False)
        if self.deferred is not None:
            self._save_deferred()
        self.injector.maybe_fire("forward", self.steps_done)

    def on_backward(self, tensors) -> None:
        if self.phase is Phase.INIT:
            self._training_started()
        if self.phase is Phase.POST or self.phase is Phase.INIT or self._provisional:
            self._provisional = False
            self._minibatch_start(collective=False)
        elif self._body_due is not None:  # a DDP forward that never reached its module
            self.on_forward_body()
        if self.deferred is not None:
            self._save_deferred()
        with self._lock:
            self.phase, self.phase_t = Phase.BWD, time.monotonic()
        if self.injector.pending:
            self.injector.maybe_fire("backward", self.steps_done)
            f = self.injector.armed("allreduce", self.steps_done)
            if f is not None:
                self._arm_allreduce_fault(f, tensors)

    def _arm_allreduce_fault(self, f: _faults.Fault, tensors) -> None:
        # Fire at the end of this backward pass, while DDP's bucket all-reduces
        # are in flight on the peers: a callback queued from the loss's grad
        # hook runs after the autograd graph, before DDP's finalize waits.
        import torch

        from .torch_compat.worker import queue_backward_callback

        t = tensors[0] if isinstance(tensors, (list, tuple)) else tensors
        step = self.steps_done

        def hook(grad):
            queue_backward_callback(lambda: self.injector.fire(f, step))
            return grad

        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(hook)
        else:
            self.injector.fire(f, step)

    def on_collective(self) -> None:
        # The first collective after an optimizer step is, by contract, the
        # start of the next minibatch (the user's bookkeeping is done). Unless
        # it is not (a barrier after the training loop): such a save is marked
        # so that it is only restored when save_fn labelled its state with
        # checkpoint_step() (see _jit_save).
        # A provisional start: an evaluation pass or the user's bookkeeping between epochs may
        # still follow, so the next training forward takes the minibatch start again.
        definite, self._definite = self._definite, False
        if self.phase is Phase.POST:
            self._minibatch_start(collective=True, provisional=not definite)
        if self.deferred is not None:
            self._save_deferred(post_step=self.phase is Phase.POST)
        if self.phase is Phase.POST:
            self._provisional = not definite
            with self._lock:
                self.phase, self.phase_t = Phase.FWD, time.monotonic()

    def expect_minibatch_start(self) -> None:
        """An integration that knows the next collective starts a minibatch (Lightning's
        per-batch broadcast, before the batch is fetched): that collective is the start
        itself, not a provisional one."""
        if self.phase is Phase.INIT:
            self._training_started()  # what the first forward would do: consistency check, timeouts
        with self._lock:
            if not self.saving and self.phase is not Phase.OPT:
                self.phase, self.phase_t = Phase.POST, time.monotonic()
                self._definite = True

    def on_optimizer_pre(self) -> None:
        # Before the phase becomes OPT: in recover mode the shim waits here for the
        # minibatch's collectives, and a fault it then cannot recover calls _on_hang
        # while the state is still the minibatch start, so the JIT save runs at once.
        self.listeners.fire(Event.OPTIMIZER_BEGIN)
        with self._lock:
            if self.saving:
                parked = True
            else:
                parked = False
                if self.phase is not Phase.OPT and self.phase is not Phase.POST:
                    self._counted = False
                self.phase, self.phase_t = Phase.OPT, time.monotonic()
        if parked:
            self._halt.wait()
        self.injector.maybe_fire("optimizer", self.steps_done)

    def on_optimizer_post(self) -> None:
        self.listeners.fire(Event.OPTIMIZER_END)
        with self._lock:
            if not self._counted:
                self._counted = True
                self.steps_done += 1
            self.phase, self.phase_t = Phase.POST, time.monotonic()
        now = time.monotonic()
        if self._step_t is not None:
            self._step_times.append(now - self._step_t)
            del self._step_times[:-50]
        if self.waits is not None:
            self.waits.minibatch(None if self._step_t is None else now - self._step_t, self.steps_done)
        self._step_t = now
        if not self._resumed_reported:
            self._resumed_reported = True
            if self.cfg.attempt > 0:  # first minibatch done after a restart
                self.report("resumed", step=self.steps_done - 1, restored=self.restored)
        self.listeners.fire(Event.MINIBATCH_BEGIN)
        self.injector.maybe_fire("post-step", self.steps_done - 1)

    # -- triggers ------------------------------------------------------------

    def request_save(self, reason: str, announced: bool = False) -> bool:
        """Ask for a JIT save now or at the next consistent point.

        Returns False if the save was deferred (caller goes on). When the save
        happens in this call, the process exits and this never returns. A
        second trigger while a save is running parks the calling thread.
        """
        with self._lock:
            if self.saving:
                park = True
            elif self.phase in (Phase.OPT, Phase.POST):
                if self.deferred is None:
                    self.deferred = reason
                    if not announced:
                        self.report("failure_detected", reason=reason, phase=self.phase.value,
                                    step=self.steps_done, action="deferred to next minibatch start",
                                    minibatch_s=self.minibatch_s())
                return False
            else:
                park = False
                self.saving = True
                phase = self.phase
        if park:
            self._halt.wait()
        self._save_and_exit(reason, phase, announced=announced)
        return True  # unreachable

    def _save_deferred(self, post_step: bool = False) -> None:
        reason = self.deferred or "deferred"
        self._claim_save()
        self._save_and_exit(reason, Phase.POST if post_step else Phase.FWD, announced=True)

    def _claim_save(self) -> None:
        """Become the thread that saves; a thread that comes second parks forever
        (the first one ends the process)."""
        with self._lock:
            park = self.saving
            self.saving = True
        if park:
            self._halt.wait()

    def on_collective_error(self, exc: BaseException) -> None:
        """A collective failed or timed out: called where torch raised it,
        before the exception can reach any ``except`` of the user or a
        framework. In FWD/BWD (and INIT) this saves (or says why not) and
        ends the process; in OPT the optimizer step was cut short with
        parameters partly written, so this rank has no consistent state and
        leaves at once (a peer's replica is used); in POST the save waits for
        the next minibatch start, or for the script's end (``script_ended``)
        when the exception ends the training instead."""
        if exc is self.collective_exc:
            return  # the same error again, further up the stack
        first = self.collective_exc is None
        if first:
            self.collective_exc = exc
        waited = time.monotonic() - self.phase_t
        if first:
            self.report("failure_detected", reason="collective_error", phase=self.phase.value,
                        step=self.steps_done, waited_s=round(waited, 3), error=str(exc)[:300],
                        minibatch_s=self.minibatch_s())
        if self.phase is Phase.OPT:
            self._leave_unsaved("a collective failed inside the optimizer step: parameters are partly updated")
        self.request_save("collective_error", announced=True)

    def _leave_unsaved(self, why: str) -> None:
        """End the process without a checkpoint (EXIT_NOT_SAVED), unless a
        save is already running (then park until it ends the process)."""
        with self._lock:
            park = self.saving
            self.saving = True
        if park:
            self._halt.wait()
        try:
            self.report("checkpoint_skipped", why=why)
            print(f"[jitckpt] rank {self.cfg.rank}: no JIT checkpoint from this rank: {why}", file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(_config.EXIT_NOT_SAVED)

    def script_ended(self, exc: BaseException | None) -> None:
        """The script returned, raised, or called ``sys.exit`` (``exc``): the
        last chance for a save a collective failure or a stop signal asked
        for. A collective error found in ``exc`` that no hook saw is handled
        as at its raise point; a stop signal not acted on yet, as by the
        watcher. A save deferred after an optimizer step (POST) whose
        minibatch start never came is taken here, at the state after that
        step, with the minibatch-start snapshot (resumable's RNG, counters and
        data position) taken first, as at a collective after the step."""
        if not self.cfg.managed:
            return  # not under jitrun: the process ends as under torchrun
        if self.signals is not None:
            self.signals.take_pending()
        err = find_collective_error(exc)
        if err is not None:
            self.on_collective_error(err)
        if self.deferred is None or (self.collective_exc is None and self.stop_signal is None):
            return
        if self.collective_exc is None:
            self._save_at_script_end()
            return
        self._claim_save()
        reason = self.deferred
        try:
            self.listeners.fire(Event.MINIBATCH_START, True)
        except BaseException as e:
            self.report("checkpoint_failed", step=self.steps_done, error=f"{type(e).__name__}: {e}")
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(_config.EXIT_NOT_SAVED)
        self._save_and_exit(reason, Phase.POST, announced=True)

    def _save_at_script_end(self) -> None:
        """A stop signal's save whose minibatch start never came (a script that catches
        SIGTERM stopped its loop): taken after the last optimizer step; the process then
        ends as the script asked (its exit code; nothing failed here)."""
        self._claim_save()
        step = self.steps_done
        if self.phase is Phase.OPT:
            self.report("checkpoint_skipped", why="the script ended inside an optimizer step")
            return
        try:
            self.listeners.fire(Event.MINIBATCH_START, False)
            if self.save_fn is None:
                self.report("checkpoint_skipped", why="no save_fn registered (jitckpt.register)")
            else:
                self._jit_save("post-step")
        except BaseException as e:  # the script's own end stands
            self.report("checkpoint_failed", step=step, error=f"{type(e).__name__}: {e}")
            traceback.print_exc()

    def _save_and_exit(self, reason: str, phase: Phase, announced: bool = False) -> None:
        code = _config.EXIT_NOT_SAVED
        try:
            if not announced:
                self.report("failure_detected", reason=reason, phase=phase.value,
                            step=self.steps_done, waited_s=round(time.monotonic() - self.phase_t, 3),
                            minibatch_s=self.minibatch_s())
            if phase is Phase.INIT:
                self.report("checkpoint_skipped", why="failure before the training loop started")
            elif self.save_fn is None:
                self.report("checkpoint_skipped", why="no save_fn registered (jitckpt.register)")
            else:
                self._jit_save("post-step" if phase is Phase.POST else "minibatch-start")
                code = _config.EXIT_SAVED
        except save_space.NoSpace as e:  # one line: what, where, how much, the fix (before the agent ends us)
            e.release()
            print(f"[jitckpt] rank {self.cfg.rank}: {e}", file=sys.stderr, flush=True)
            self.report("checkpoint_failed", step=self.steps_done, error=str(e), no_space=e.fields())
        except BaseException as e:  # report, then exit; the launcher uses another replica
            self.report("checkpoint_failed", step=self.steps_done, error=f"{type(e).__name__}: {e}")
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _jit_save(self, point: str = "minibatch-start") -> None:
        cfg = self.cfg
        assert cfg.root is not None and self.save_fn is not None
        t0 = time.monotonic()
        step = self.steps_done
        self.report("save_started", step=step, shard=self.shard)
        old_umask = os.umask(0o077)
        try:
            with save_space.staged(cfg.root, step, self.shard, cfg.rank) as tmp:
                # the model as it was at the minibatch start: buffers a forward wrote are put back
                held = _buffers.rewind_all(step, cfg.rank) if point == "minibatch-start" else {"buffers": "live"}
                self.step_read = False
                self.save_fn(str(tmp))
                self.injector.maybe_fire("save", step)
                extra: dict = {"progress_step": step, "point": point, **held}
                if point == "post-step" and not self.step_read:
                    # After an optimizer step, at a collective no minibatch start followed: the user's step
                    # may still name the minibatch just done (a barrier after the loop); restoring it would redo it.
                    extra["step_unverified"] = True
                    print(f"[jitckpt] rank {cfg.rank}: WARNING: JIT save at a collective after optimizer step "
                          f"{step} with no minibatch start in between; save_fn did not call "
                          "jitckpt.checkpoint_step(), so this checkpoint's step label cannot be trusted and it "
                          "will not be restored. Record jitckpt.checkpoint_step() as your step in save_fn.",
                          file=sys.stderr, flush=True)
                path = layout.publish(tmp, root=cfg.root, step=step, shard=self.shard, rank=cfg.rank,
                                      world_size=cfg.world_size, job_id=cfg.job_id, extra=extra,
                                      identity=cfg.identity or None)
        finally:
            os.umask(old_umask)
        self.report("checkpoint_saved", step=step, shard=self.shard, path=str(path),
                    seconds=round(time.monotonic() - t0, 4), minibatch_s=self.minibatch_s())

    # -- signals -------------------------------------------------------------

    def install_signal_watch(self) -> None:
        from .signal_watch import SignalWatch

        watch = SignalWatch(self)
        if watch.install():
            self.signals = watch

    def on_stop_signal(self, sig: int) -> None:
        """SIGTERM or SIGINT reached this worker (signal_watch.py; the watcher
        thread, or the main thread at the script's end): save now or at the
        next minibatch start. Caller holds ``_exit_lock``."""
        with self._lock:
            if self.saving:
                return  # the save under way ends the process (or the script's end took it)
            if self.stop_signal is None:
                self.stop_signal = sig
        self.request_save("sigint" if sig == signal.SIGINT else "sigterm")

    def _on_hang(self, info: dict) -> None:
        """libintercept watchdog: a collective hung past the timeout."""
        self.report("failure_detected", reason=info.get("event", "hang"), phase=self.phase.value,
                    step=self.steps_done, waited_s=info.get("waited_s"),
                    collective=info.get("collective"), minibatch_s=self.minibatch_s())
        self.request_save(str(info.get("event", "hang")), announced=True)
