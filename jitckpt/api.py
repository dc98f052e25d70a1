"""The public surface: ``register``, ``get_checkpoint_path``,
``checkpoint_step`` and ``expect_delay``."""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from .listeners import Event
from .runtime import Runtime, SaveFn
from .verify.consistency import FRESH
from .wire import config, layout

_runtime: Runtime | None = None
_registered_at: str | None = None


def _get_runtime() -> Runtime:
    global _runtime
    if _runtime is None:
        _runtime = Runtime(config.from_env())
    return _runtime


def install() -> Runtime:
    """Attach the runtime to torch (jitrun's bootstrap calls this before the
    user's script runs; ``register`` calls it when the bootstrap did not)."""
    rt = _get_runtime()
    if getattr(rt, "_installed", False):
        return rt
    from . import hooks

    if rt.cfg.managed:
        rt.connect()
        hooks.install(rt)
        rt.install_signal_watch()
        _attach_intercept(rt)
        from .ec import snapshot as ec_snapshot  # --jit-ec-every N: nothing happens when N is 0

        ec_snapshot.install(rt)
        from .verify import verifier  # the replicas' state checks: at the start, and every N minibatches

        verifier.install(rt)
    elif rt.cfg.fault_spec:
        # Fault injection alone, e.g. a plain torchrun baseline started with
        # `torchrun ... -m jitckpt._bootstrap train.py`: no detection, no saves.
        hooks.install(rt, detect=False)
    rt._installed = True
    return rt


def _attach_intercept(rt: Runtime) -> None:
    # With libintercept preloaded (GPU path) its watchdog detects NCCL hangs
    # and calls back into the runtime holding the GIL.
    if not config.shim_preloaded():
        return
    try:
        from . import intercept
    except ImportError:
        return
    if intercept.loaded():
        intercept.set_hang_handler(rt._on_hang)
        rt.listeners.add(Event.MINIBATCH_BEGIN, intercept.minibatch_begin)
        begin, end = intercept.optimizer_marks()
        rt.listeners.add(Event.OPTIMIZER_BEGIN, begin)
        rt.listeners.add(Event.OPTIMIZER_END, end)


def register(save_fn: SaveFn, *, shard: str | int | None = None) -> None:
    """Register the function that writes this rank's state for a JIT save.

    ``save_fn(ckpt_dir)`` must write everything needed to redo the current
    minibatch exactly into ``ckpt_dir`` (see README, "The save_fn contract"),
    without collectives. ``shard`` names the part of the model state this rank
    holds; ranks with equal ``shard`` are data-parallel replicas (default: all
    ranks are replicas). Outside jitrun this only records the function.
    """
    global _registered_at
    if not callable(save_fn):
        raise TypeError(
            f"jitckpt.register: save_fn must be a callable taking the checkpoint directory "
            f"(str), got {type(save_fn).__name__} {save_fn!r}"
        )
    if _registered_at is not None:
        raise RuntimeError(
            f"jitckpt.register was already called at {_registered_at}; register one save_fn "
            "per process (combine your state into one function)"
        )
    shard_name = "0" if shard is None else str(shard)
    layout.shard_dirname(shard_name)  # validates, with a clear message
    caller = traceback.extract_stack(limit=2)[0]
    _registered_at = f"{caller.filename}:{caller.lineno}"
    rt = install()
    rt.save_fn = save_fn
    rt.shard = shard_name
    rt.report("registered", shard=shard_name, pid=os.getpid())


def checkpoint_step() -> int:
    """The minibatch a JIT checkpoint being saved describes: its state is that
    at the start of this minibatch (the number of optimizer steps done). Call
    it from save_fn and save it as your step counter: it is always right, also
    when the save is taken at a collective after the training loop."""
    rt = _get_runtime()
    rt.step_read = True
    return rt.steps_done


@contextmanager
def expect_delay(seconds: float) -> Iterator[None]:
    """Say that this rank is slow on purpose for up to ``seconds`` (while the
    ``with`` block runs), so its peers' long wait for it is not taken for a
    hang. Rarely needed: a rank that is alive and busy outside collectives
    (evaluating, saving, waiting for data) is already told apart from a hung
    one. For what the liveness check cannot see, e.g. a rank that holds the
    GIL in one long C call without using CPU::

        with jitckpt.expect_delay(seconds=600):
            blocking_call_that_holds_the_gil()

    The block's time, and the first collective wait after it, are not learned
    into the hang bound; call it on every rank (around an ``if rank == 0:``
    save, say) so that no rank learns the others' catching up either. The
    process groups' own timeout (twice ``--jit-timeout`` plus 30 s) still
    applies. Outside jitrun, or with ``--jit-timeout fixed:S``, it
    does nothing."""
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"jitckpt.expect_delay: seconds must be a finite number > 0, got {seconds!r}")
    w = _get_runtime().waits
    if w is None:
        yield
        return
    with w.delay(float(seconds)):
        yield


def get_checkpoint_path() -> str | None:
    """Directory of the newest complete replica checkpoint for this rank's
    shard, verified against its manifest checksums, or None."""
    rt = _get_runtime()
    if rt.query_t is None:
        rt.query_t = time.time()
    rt.loaded = FRESH  # asked; replaced by the step below when one is found
    cfg = rt.cfg
    if cfg.root is None or not cfg.root.is_dir():
        return None
    if rt.plan.ec_step is not None:
        # the job chose an EC snapshot: decode it into the layout here (collective over the
        # ranks), then the normal path below with its step, or with the fallback
        from .ec import restore as ec_restore

        rt.plan = ec_restore.restore(rt, rt.plan)
    replicas, rejected = layout.scan(cfg.root, cfg.job_id or None, cfg.identity or None)
    for path, why in rejected:
        print(f"[jitckpt] rank {cfg.rank}: ignoring {path}: {why}", file=sys.stderr)
    plan = rt.plan
    if plan.decided and plan.step is None:
        return None
    step = plan.step if plan.decided else layout.select_step(replicas, {r.shard for r in replicas})

    def older(s: int) -> int | None:
        return layout.select_step(replicas, {rt.shard}, max_step=s - 1)

    claimed = None
    fault = rt.injector.take_restore_fault() if step is not None else None
    if fault is not None:
        # test faults: an older replica, which the step check must refuse ("stale"), or
        # passed off as the chosen step, which only the replicas' state check sees ("swap")
        claimed, step = (step if fault == "swap" else None), older(step)
    if step is None:
        return None
    rep = layout.pick_replica(replicas, step, rt.shard, prefer_rank=cfg.rank)
    if rep is None and plan.decided:
        # The job chose a step whose replica here failed verification after
        # the choice (corrupted since): the newest valid older one, loudly.
        # If other ranks did load the chosen step, the job-wide consistency
        # check stops the job before any training step.
        used = older(step)
        why = "; ".join(w for p, w in rejected if f"step-{step}" in str(p)) or "absent"
        print(f"[jitckpt] rank {cfg.rank}: WARNING: no valid replica of the chosen step {step} for shard "
              f"{rt.shard} on this node ({why}); falling back to "
              f"{'step ' + str(used) if used is not None else 'a fresh start'}", file=sys.stderr, flush=True)
        rt.report("restore_fallback", chosen=step, used=used)
        if used is None:
            return None
        rep = layout.pick_replica(replicas, used, rt.shard, prefer_rank=cfg.rank)
    if rep is None:
        return None
    if rep.rank != cfg.rank and not rt.keeps_rank_state:
        _warn_other_ranks_files(rep, cfg.rank)
    rt.steps_done = rep.step if claimed is None else claimed
    rt.restored = True
    rt.loaded = rt.steps_done
    rt.loaded_path = str(rep.path)
    return rt.loaded_path


def _warn_other_ranks_files(rep: layout.Replica, rank: int) -> None:
    """This rank's own replica did not survive (it failed): it restores from a peer's, where
    files the save_fn wrote for that peer alone are the peer's, not this rank's."""
    theirs = layout.named_for_rank(rep, rep.rank)
    if not theirs:
        return
    shown = ", ".join(theirs[:4]) + (f" and {len(theirs) - 4} more" if len(theirs) > 4 else "")
    print(f"[jitckpt] rank {rank}: WARNING: restoring from rank {rep.rank}'s replica (this rank's own did not "
          f"survive); {shown} there look like rank {rep.rank}'s own files, so state this rank keeps for itself "
          f"(its RNG, say) comes from rank {rep.rank} or not at all. Make such state the same on every rank, or "
          f"(with transformers' Trainer) use JitCallback, which keeps each rank's own on its node",
          file=sys.stderr, flush=True)


def keeps_rank_state() -> None:
    """Said by a save function of jitckpt's own (``JitCallback``) that keeps each rank's own
    state on its node and restores it from there: no warning about a peer's files."""
    _get_runtime().keeps_rank_state = True

