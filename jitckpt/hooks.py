"""Attach a Runtime to torch without user changes.

What is hooked, and why each is needed:
* global optimizer pre/post step hooks: minibatch boundaries (phase OPT/POST,
  step count);
* DistributedDataParallel forward pre-hook (added by a wrapped ``__init__``):
  the start of a minibatch, before its first collective; deferred saves run here;
* ``DistributedDataParallel.forward``: where DDP's own collectives in forward
  fail (the buffer broadcast, a C++ call no ``torch.distributed`` function
  wraps, and the join hooks' all-reduces);
* ``torch.autograd.backward``: phase BWD, and the place where a failed
  gradient all-reduce (peer died, or the process-group timeout fired) surfaces;
* ``torch.distributed`` collective functions: explicit collectives, same two
  roles;
* ``Work.wait``: an asynchronous collective (``async_op=True``, FSDP2's
  all-gathers and reduce-scatters) fails where it is waited on;
* the default process-group timeout: with a fixed ``--jit-timeout`` set to it,
  so that a hung gloo/nccl collective raises after that many seconds instead
  of 30 min; with the learned bound set past the ceiling (a backstop: the
  agent confirms a hang and ends the hung rank, launcher/recovery/hang.py);
* the same places, and DDP's forward and the backward pass, time the rank's
  collective waits for that watch (hang/waits.py);
* ``sys.excepthook`` (and the end of the script, _bootstrap.py): a collective
  error raised where none of the above sees it still leads to a save when it
  ends the process, also through ``raise ... from`` or a ``sys.exit`` in an
  ``except`` clause.

Every place above that sees a collective error hands it to the runtime before
re-raising it: the JIT save (or the decision that this rank cannot save) is
taken there, before any ``except`` of the user or a framework (Hydra,
Lightning, a ``try: main() except: sys.exit(1)``) can catch the exception.
Each hook costs one attribute check and a function call on the hot path.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref
from datetime import timedelta

from . import torch_compat
from .collective_errors import find_collective_error, is_collective_error
from .listeners import Event
from .runtime import Phase, Runtime
from .torch_compat import set_pg_timeout
from .torch_compat.worker import patch_ddp_pre_forward, patch_env_rendezvous, process_groups
from .wire import contract
from .wire.config import shim_preloaded

_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
    "all_to_all_single", "barrier", "send", "recv", "broadcast_object_list",
    "all_gather_object", "gather_object", "scatter_object_list",
    "all_gather_single", "reduce_scatter_single",  # FSDP2's (torch 2.13)
)


def _waiting(rt: Runtime, group: object = None) -> bool:
    """Enter a collective wait of the agent's hang watch (hang/waits.py):
    from the first minibatch on, where a rank's peers can keep it waiting."""
    w = rt.waits
    if w is None or rt.phase is Phase.INIT:
        return False
    w.enter(group)
    return True


def _group_index(fn) -> int | None:
    """Where ``group`` sits among ``fn``'s positional parameters (None: not there)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("group") if "group" in names else None


def _guard(rt: Runtime, fn):
    at = _group_index(fn)  # once, here: a call's group may be passed by position

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rt.on_collective()
        group = kwargs.get("group")
        if group is None and at is not None and len(args) > at:
            group = args[at]
        timed = _waiting(rt, group)
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if is_collective_error(e):
                rt.on_collective_error(e)
            raise
        finally:
            if timed:
                rt.waits.leave()

    return wrapper


def _raise_guard(rt: Runtime, fn):
    """``fn`` (which starts no collective of its own but can surface a failed
    one), with that failure handed to the runtime before it propagates."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        timed = _waiting(rt)
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if is_collective_error(e):
                rt.on_collective_error(e)
            raise
        finally:
            if timed:
                rt.waits.leave()

    return wrapper


def _wait_guard(rt: Runtime, fn):
    """``Work.wait``: the completion of a collective, in the main thread once
    training started, is a collective like a ``torch.distributed`` call. Not
    elsewhere: jitckpt's own erasure-coding group waits in a thread of its own
    and at start-up (ec/snapshot.py, ec/restore.py) and handles its errors."""
    main = threading.main_thread()

    @functools.wraps(fn)
    def wait(self, *args, **kwargs):
        if rt.phase is Phase.INIT or threading.current_thread() is not main:
            return fn(self, *args, **kwargs)
        rt.on_collective()
        timed = _waiting(rt)
        try:
            return fn(self, *args, **kwargs)
        except RuntimeError as e:
            if is_collective_error(e):
                rt.on_collective_error(e)
            raise
        finally:
            if timed:
                rt.waits.leave()

    return wait


def _backward_guard(rt: Runtime, fn, detect: bool):
    """``torch.autograd.backward`` (``Tensor.backward`` calls it): the backward phase; with
    ``detect``, a failed collective inside it (DDP's all-reduces) handed to the runtime."""
    @functools.wraps(fn)
    def backward(tensors, *args, **kwargs):
        rt.on_backward(tensors)
        timed = detect and _waiting(rt)  # DDP's gradient all-reduces are waited for inside
        try:
            return fn(tensors, *args, **kwargs)
        except RuntimeError as e:
            if detect and is_collective_error(e):
                rt.on_collective_error(e)
            raise
        finally:
            if timed:
                rt.waits.leave()

    return backward


def install(rt: Runtime, detect: bool = True) -> None:
    """Attach ``rt``. With ``detect=False`` only phase tracking and fault
    injection are attached (the process behaves as under plain torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    global _grad_enabled
    _grad_enabled = torch.is_grad_enabled
    register_optimizer_step_pre_hook(lambda opt, a, k: rt.on_optimizer_pre())
    register_optimizer_step_post_hook(functools.partial(_after_step, rt))

    _hook_ddp_init(rt, DDP)
    torch_compat.patch(torch.autograd, "backward", lambda orig: _backward_guard(rt, orig, detect))
    _isolate_attempts(rt.cfg.attempt)
    if not detect:
        return

    for name in _COLLECTIVES:
        torch_compat.patch(dist, name, lambda fn: _guard(rt, fn))
    torch_compat.patch(DDP, "forward", lambda fn: _raise_guard(rt, fn))
    torch_compat.patch(dist.Work, "wait", lambda fn: _wait_guard(rt, fn))

    pg_timeout = contract.pg_timeout_s(rt.cfg.timeout_s, shim_preloaded(), fixed=rt.waits is None)
    rt.listeners.add(Event.TRAINING_START, functools.partial(_arm_timeouts, timedelta(seconds=pg_timeout)))

    prev_hook = sys.excepthook

    def excepthook(tp, exc, tb):
        err = find_collective_error(exc)
        if err is not None:
            rt.on_collective_error(err)
        prev_hook(tp, exc, tb)

    sys.excepthook = excepthook


def _after_step(rt: Runtime, opt, args, kwargs) -> None:
    rt.on_optimizer_post()
    if rt.injector.pending:  # kind=bitflip: silent corruption right after this step
        rt.injector.maybe_flip(rt.steps_done - 1, opt)


def _hook_ddp_init(rt: Runtime, DDP) -> None:
    """Every DDP model gets a forward pre-hook (the minibatch start) and is tracked for migration."""

    def make(orig_init):
        @functools.wraps(orig_init)
        def ddp_init(self, *args, **kwargs):
            orig_init(self, *args, **kwargs)
            from . import buffers, tracked
            from .migrate_worker import track_ddp  # a migration's teardown detaches its reducer

            mirror = buffers.add(self.module, synced_by=self)
            # The minibatch start before DDP's forward (its collectives may fail), the buffers'
            # capture and the rest of the start inside it, after DDP's buffer broadcast (_pre_forward).
            # Closures, not partials of the runtime: a hook is copied with the module (copy.deepcopy,
            # AveragedModel), and the runtime's locks cannot be; nothing is hooked on the wrapped
            # module, which torch.compile would trace differently.
            self.register_forward_pre_hook(lambda mod, inp: _ddp_forward(rt, mod, inp))
            _after_sync[self] = lambda ddp: _module_forward(rt, mirror, ddp.module, None)
            track_ddp(self)
            tracked.add_model(self)  # the state the replicas compare (verify/verifier.py)
            buffers.announce_unsynced(self, rt.cfg.rank)

        return ddp_init

    if torch_compat.patch(DDP, "__init__", make):
        patch_ddp_pre_forward(_synced)


def _synced(ddp) -> None:
    after = _after_sync.get(ddp)
    if after is not None:
        after(ddp)


# DDP model -> what runs once its _pre_forward (the buffer broadcast) returned; weak: never keeps one alive
_after_sync: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_grad_enabled = None  # torch.is_grad_enabled, bound by install(): read at every forward


def _training(mod) -> bool:
    """A forward that can start a minibatch: grad enabled and the module in training mode
    (evaluation passes, EMA evaluation and logging forwards do not)."""
    return mod.training and _grad_enabled()


def _ddp_forward(rt: Runtime, mod, inp) -> None:
    if _training(mod):
        rt.on_forward(body_follows=True)


def _module_forward(rt: Runtime, mirror, mod, inp) -> None:
    if not _training(mod):
        return
    if mirror.captured_at != rt.steps_done:  # the first forward of a minibatch (not a later micro-batch)
        mirror.capture(rt.steps_done)
    rt.on_forward_body()


def _isolate_attempts(attempt: int) -> None:
    """Give each restart attempt its own key space in the agent's store.

    torchrun's c10d rendezvous keeps one TCPStore across restarts and env://
    adds no per-attempt prefix, so a restarted gloo rank can read a dead peer's
    address left by the previous attempt and fail to connect. Wrapping the
    env:// handler's store in a PrefixStore keyed by the restart count removes
    that race without touching the user's init_process_group call.
    """
    import torch.distributed as dist

    def make(orig):
        def env_handler(url, **kwargs):
            for store, rank, world_size in orig(url, **kwargs):
                yield dist.PrefixStore(f"jitckpt/attempt_{attempt}", store), rank, world_size

        return env_handler

    patch_env_rendezvous(make)


def _arm_timeouts(timeout: timedelta) -> None:
    """Set every process group's timeout once training starts (see
    contract.pg_timeout_s): a fixed ``--jit-timeout``, or the backstop.

    Not before: start-up collectives (DDP's parameter verification, barriers
    around data preparation) legitimately wait for slow peers, and a short
    timeout there would turn skew into false failures.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    for pg in process_groups():
        try:
            set_pg_timeout(pg, timeout)
        except (ValueError, AssertionError, RuntimeError):
            pass  # a group this rank is not part of, or a backend without timeouts
