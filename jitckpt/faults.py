"""Fault injection for users and tests: ``JITCKPT_FAULT``.

Format: one or more specs separated by ``;``, each a comma list of key=value::

    JITCKPT_FAULT="rank=1,step=3,phase=backward,kind=sigkill"
    JITCKPT_FAULT="rank=2,step=4,phase=forward,kind=sigkill;rank=0,phase=save,kind=exit"

keys:
  rank     global rank that fails (required)
  step     minibatch index (0-based global step) at which it fires; not used
           for phase=save (fires on that rank's first JIT save) nor
           phase=exit (fires when the script has returned and the rank
           reported it finished, as the process ends). Default 0.
  phase    forward | backward | allreduce | optimizer | save | restore | exit
  kind     sigkill | sigstop | sigterm | sigint | sigsegv | abort | exception |
           hang | lose | exit | errfile | stale | swap | bitflip
           (signals are sent by the rank to itself; abort = os.abort();
           errfile = leaves its error file (TORCHELASTIC_ERROR_FILE) empty, as
           a worker killed while torch's handler writes it does, then sigkill;
           hang = blocks forever while holding the GIL; lose = waits in a
           collective nobody completes (a recv from the next rank, which
           never sends: on every rank at the same step, a lost collective);
           exit = os._exit(13);
           stale, only with phase=restore: get_checkpoint_path() returns the
           newest replica *older* than the chosen step, which the job-wide
           consistency check must refuse; swap, only with phase=restore: the
           same replica, but reported as the chosen step, a wrong restore only
           the replicas' state check can see; bitflip, with phase=optimizer (the
           default for it): flips one bit of the state right after minibatch
           ``step``'s optimizer step, silent corruption the replicas' state
           checks must catch)
  target   bitflip only: param (default: the first element of the optimizer's
           first parameter) | optim (the first element of that parameter's
           first optimizer-state tensor, e.g. Adam's exp_avg)
  bit      bitflip only: which bit of that element's bytes (default 20: a
           float32's mantissa, a small change that training carries on with)
  attempt  job-wide attempt on which it fires (the rendezvous round under
           jitrun, the same on every node; TORCHELASTIC_RESTART_COUNT
           otherwise); default 0, so a recovered job does not fail again at
           the same point.

Each spec fires at most once per process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

PHASES = ("forward", "backward", "allreduce", "optimizer", "save", "restore", "exit")
KINDS = ("sigkill", "sigstop", "sigterm", "sigint", "sigsegv", "abort", "exception", "hang", "lose", "exit",
         "errfile", "stale", "swap", "bitflip")
TARGETS = ("param", "optim")
EXIT_INJECTED = 13


class InjectedFault(RuntimeError):
    """Raised by kind=exception; never mistaken for a collective failure."""


@dataclass
class Fault:
    rank: int
    step: int
    phase: str
    kind: str
    attempt: int = 0
    fired: bool = False
    target: str = "param"  # bitflip: what it flips
    bit: int = 20


def _split(part: str) -> dict[str, str]:
    kv: dict[str, str] = {}
    for item in part.split(","):
        if "=" not in item:
            raise ValueError(f"JITCKPT_FAULT: {item!r} in {part!r} is not key=value")
        k, v = item.split("=", 1)
        kv[k.strip()] = v.strip()
    unknown = set(kv) - {"rank", "step", "phase", "kind", "attempt", "target", "bit"}
    if unknown:
        raise ValueError(f"JITCKPT_FAULT: unknown keys {sorted(unknown)} in {part!r}")
    if kv.get("kind") == "bitflip":
        kv.setdefault("phase", "optimizer")
    return kv


def _check_kind(kv: dict[str, str], part: str) -> None:
    if (kv["kind"] in ("stale", "swap")) != (kv["phase"] == "restore"):
        raise ValueError(f"JITCKPT_FAULT: kind=stale or swap goes with phase=restore and only with it, in {part!r}")
    if kv["kind"] == "bitflip" and kv["phase"] != "optimizer":
        raise ValueError(f"JITCKPT_FAULT: kind=bitflip fires after an optimizer step: phase=optimizer, in {part!r}")
    if kv["kind"] != "bitflip" and ("target" in kv or "bit" in kv):
        raise ValueError(f"JITCKPT_FAULT: target= and bit= go with kind=bitflip only, in {part!r}")
    if kv.get("target", "param") not in TARGETS:
        raise ValueError(f"JITCKPT_FAULT: target {kv['target']!r} not one of {TARGETS}, in {part!r}")


def parse(spec: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kv = _split(part)
        if "rank" not in kv or "phase" not in kv or "kind" not in kv:
            raise ValueError(f"JITCKPT_FAULT: {part!r} needs rank=, phase= and kind=")
        if kv["phase"] not in PHASES:
            raise ValueError(f"JITCKPT_FAULT: phase {kv['phase']!r} not one of {PHASES}")
        if kv["kind"] not in KINDS:
            raise ValueError(f"JITCKPT_FAULT: kind {kv['kind']!r} not one of {KINDS}")
        nums = {}
        for key, default in (("rank", None), ("step", "0"), ("attempt", "0"), ("bit", "20")):
            raw = kv.get(key, default)
            if not raw.isdigit():
                raise ValueError(f"JITCKPT_FAULT: {key}={raw!r} in {part!r} must be a non-negative integer")
            nums[key] = int(raw)
        _check_kind(kv, part)
        faults.append(Fault(phase=kv["phase"], kind=kv["kind"], target=kv.get("target", "param"), **nums))
    return faults


def flip_bit(opt, target: str, bit: int) -> str:
    """Flip ``bit`` of the first element of ``opt``'s first parameter (``param``) or of that
    parameter's first optimizer-state tensor (``optim``), in place; what was flipped."""
    import torch

    p = next(p for g in opt.param_groups for p in g["params"])
    name, t = "parameter 0", p
    if target == "optim":
        st = opt.state.get(p, {})
        tensors = [(k, v) for k, v in sorted(st.items(), key=lambda kv: str(kv[0]))
                   if isinstance(v, torch.Tensor) and v.numel() > 0]
        if not tensors:
            raise InjectedFault("bitflip target=optim: the optimizer holds no state for its first parameter yet")
        name, t = f"optimizer state {tensors[0][0]!r} of parameter 0", tensors[0][1]
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    b = t.reshape(-1)[:1].view(torch.uint8)
    if bit >= 8 * b.numel():
        raise InjectedFault(f"bitflip bit={bit}: the element has only {8 * b.numel()} bits")
    b[bit // 8:bit // 8 + 1].bitwise_xor_(1 << (bit % 8))
    return f"bit {bit} of element 0 of {name} ({t.dtype})"


def hang_holding_gil() -> None:
    """Block forever without releasing the GIL, deaf to every catchable signal:
    ctypes.PyDLL keeps the GIL across the call, and sigsuspend with a full mask
    returns for no signal (only SIGKILL/SIGSTOP still act)."""
    libc = ctypes.PyDLL(None)
    mask = ctypes.create_string_buffer(256)
    libc.sigfillset(mask)
    while True:
        libc.sigsuspend(mask)


def execute(kind: str, where: str) -> None:
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind in ("sigterm", "sigint", "sigsegv"):
        os.kill(os.getpid(), {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigsegv": signal.SIGSEGV}[kind])
    elif kind == "abort":
        os.abort()
    elif kind == "exception":
        raise InjectedFault(f"injected fault at {where}")
    elif kind == "hang":
        hang_holding_gil()
    elif kind == "lose":
        import torch
        import torch.distributed as dist

        dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())
    elif kind == "exit":
        os._exit(EXIT_INJECTED)
    elif kind == "errfile":
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))  # open(path, "w"), nothing written
        os.kill(os.getpid(), signal.SIGKILL)


class Injector:
    """Holds this rank's pending faults; ``maybe_fire`` is called from the phase
    hooks and costs one list check when nothing is armed."""

    def __init__(self, spec: str, rank: int, attempt: int,
                 announce: Callable[[Fault], None] | None = None) -> None:
        self.pending = [f for f in parse(spec) if f.rank == rank and f.attempt == attempt]
        self._announce = announce

    def armed(self, phase: str, step: int) -> Fault | None:
        for f in self.pending:
            if f.fired or f.kind == "bitflip" or f.phase != phase:
                continue  # a bitflip fires after the optimizer step (maybe_flip), not at its start
            if phase in ("save", "restore", "exit") or f.step == step:
                return f
        return None

    def take_restore_fault(self) -> str | None:
        """kind=stale or kind=swap at phase=restore, once: which (None when none is armed)."""
        f = self.armed("restore", 0) if self.pending else None
        if f is None or f.kind not in ("stale", "swap"):
            return None
        f.fired = True
        if self._announce is not None:
            self._announce(f)
        return f.kind

    def fire(self, f: Fault, step: int) -> None:
        f.fired = True
        if self._announce is not None:
            self._announce(f)
        execute(f.kind, f"rank {f.rank} step {step} phase {f.phase}")

    def maybe_flip(self, step: int, opt) -> None:
        """Called after every optimizer step (``step``: the minibatch whose step it was)."""
        for f in self.pending:
            if not f.fired and f.kind == "bitflip" and f.step == step:
                f.fired = True
                if self._announce is not None:
                    self._announce(f)
                what = flip_bit(opt, f.target, f.bit)
                print(f"[jitckpt] rank {f.rank}: injected fault: flipped {what} after step {step}'s optimizer "
                      "step", file=sys.stderr, flush=True)

    def maybe_fire(self, phase: str, step: int) -> None:
        if self.pending:
            f = self.armed(phase, step)
            if f is not None:
                self.fire(f, step)
