"""A fingerprint of a rank's training state: parameters, buffers and optimizer state.

Data-parallel replicas must hold bit-identical state after every optimizer
step; comparing fingerprints is how jitckpt checks it (verify.py). A
fingerprint is computed where the tensors live: each tensor's raw bytes are
read as 64-bit (or 32-bit, or 8-bit) integer words ``x_i`` and reduced on its
device to ``sum((2 i + 1) * x_i) mod 2**64``. The weights are odd, so one
flipped bit anywhere (a change of ``+-2**b`` in one word) always changes the
sum; the weights grow with the position, so swapped words change it too. The
arithmetic is modular, so the result does not depend on the order in which a
parallel reduction adds (the same on every device, in every process). Only the
per-tensor 64-bit sums leave the device, in one transfer; the combined digest
hashes them on the host with each tensor's name, dtype and shape.

The order is fixed: the models' parameters and buffers in ``named_parameters``
/ ``named_buffers`` order, then every optimizer's param groups (their
hyper-parameters, then per parameter its state in key order). Sharded
parameters (DTensor) are fingerprinted by their local shard; two ranks are
compared only when they hold the same shard. This is not a cryptographic hash:
it detects corruption, not a forger (the comparison's records are sealed under
the job token instead).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .. import tracked

CHUNK = 1 << 21  # words per weighted sum: bounds the temporary to 16 MiB
_MASK = (1 << 64) - 1
_weights: dict[torch.device, torch.Tensor] = {}


def _weights_on(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        w = torch.arange(CHUNK, dtype=torch.int64, device=device).mul_(2).add_(1)
        _weights[device] = w
    return w


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor: this rank's shard
        t = t.to_local()
    if t.layout is not torch.strided:
        t = t.to_dense()
    return t if t.is_contiguous() else t.contiguous()


def words(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as a flat integer tensor (a view where possible)."""
    b = _local(t).reshape(-1).view(torch.uint8)
    n = b.numel()
    if n % 8 == 0:
        return b.view(torch.int64)
    if n % 4 == 0:
        return b.view(torch.int32)
    return b


def tensor_sum(t: torch.Tensor) -> torch.Tensor:
    """The position-weighted sum of ``t``'s words mod 2**64: a 0-dim int64 tensor on ``t``'s device."""
    x = words(t)
    n = x.numel()
    w = _weights_on(x.device)
    if n <= CHUNK:
        return (x * w[:n]).sum(dtype=torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for i0 in range(0, n, CHUNK):
        c = x[i0:i0 + CHUNK]
        # sum over the block of (2 (i0 + j) + 1) x_j, from the block-local weights
        total += (c * w[:c.numel()]).sum(dtype=torch.int64) + (2 * i0) * c.sum(dtype=torch.int64)
    return total


def host_sum(value: object) -> int:
    """A non-tensor state value (a hyper-parameter, a Python number): 64 bits of a hash of its repr."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Fingerprint:
    names: tuple[str, ...]
    sums: tuple[str, ...]  # 16 hex digits per entry of names
    digest: str  # 32 hex digits over all of them (names, dtypes, shapes, sums)

    def first_difference(self, other: Fingerprint) -> str | None:
        """The first entry (in the fixed order) where the two differ, or None."""
        for i, (n, s) in enumerate(zip(self.names, self.sums, strict=True)):
            if i >= len(other.names) or other.names[i] != n or other.sums[i] != s:
                return n
        if len(other.names) > len(self.names):
            return other.names[len(self.names)]
        return None if self.digest == other.digest else "(dtype or shape)"


def compute(items: Iterable[tuple[str, Any]]) -> Fingerprint:
    """Fingerprint of ``(name, value)`` pairs in their order; tensors are reduced on their
    device (one transfer per device at the end), everything else on the host."""
    names: list[str] = []
    meta: list[str] = []
    vals: dict[int, int] = {}
    on_dev: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for name, v in items:
        i = len(names)
        names.append(name)
        if isinstance(v, torch.Tensor):
            meta.append(f"{v.dtype}{tuple(v.shape)}")
            s = tensor_sum(v)
            on_dev.setdefault(s.device, []).append((i, s))
        else:
            meta.append(type(v).__name__)
            vals[i] = host_sum(v)
    for sums_of in on_dev.values():
        for (i, _), s in zip(sums_of, torch.stack([s for _, s in sums_of]).tolist(), strict=True):
            vals[i] = s
    sums = tuple(f"{vals[i] & _MASK:016x}" for i in range(len(names)))
    h = hashlib.blake2b(digest_size=16)
    for name, m, s in zip(names, meta, sums, strict=True):
        h.update(f"{name}\0{m}\0{s}\n".encode())
    return Fingerprint(tuple(names), sums, h.hexdigest())


def _buffer_items(model: Any, captured: bool) -> list[tuple[str, Any]] | None:
    """A DDP model's buffers as the replicas hold them in common: with broadcast_buffers, the
    values captured at the minibatch start, after DDP's broadcast (buffers.py; between two
    forwards each rank's live BatchNorm statistics are of its own batch); without it, none
    (they differ per rank by design). None: not a DDP model, its live buffers are taken."""
    if not hasattr(model, "reducer"):
        return None
    if not getattr(model, "broadcast_buffers", False):
        return []
    from .. import buffers

    mirror = buffers.for_model(model)
    if mirror is None or not captured:
        return [(n, b) for n, b in model.named_buffers()]
    return [(f"module.{n}", b) for n, b in mirror.values()]


def state_items(models: Iterable[Any], optimizers: Iterable[Any], captured: bool = True) -> list[tuple[str, Any]]:
    """``(name, value)`` of every model's parameters and buffers, then every optimizer's groups
    and state, in a fixed order; a tensor reached twice (a model's parameter in an optimizer)
    is taken once, named after the model. ``captured``: a DDP model's buffers as captured at
    the minibatch start (the replicas' common values) rather than the live tensors."""
    models = list(models)
    items: list[tuple[str, Any]] = []
    named: dict[int, str] = {}
    for i, m in enumerate(models):
        for n, p in m.named_parameters():
            if id(p) not in named:
                named[id(p)] = f"m{i}.{n}"
                items.append((named[id(p)], p))
        bufs = _buffer_items(m, captured)
        for n, b in (m.named_buffers() if bufs is None else bufs):
            if id(b) not in named:
                named[id(b)] = f"m{i}.{n}"
                items.append((named[id(b)], b))
    for j, opt in enumerate(optimizers):
        # ZeRO: each rank's optimizer state is of its own partition, not a replica (tracked.py)
        sharded = tracked.is_sharded(opt)
        for g, group in enumerate(opt.param_groups):
            items.append((f"o{j}.group{g}", sorted(((k, v) for k, v in group.items() if k != "params"), key=str)))
            for k, p in enumerate(group["params"]):
                if id(p) not in named:
                    named[id(p)] = f"o{j}.g{g}.p{k}"
                    items.append((named[id(p)], p))
                st = {} if sharded else opt.state.get(p, {})
                for key in sorted(st, key=str):
                    items.append((f"o{j}:{named[id(p)]}.{key}", st[key]))
    return items


def tensors_by_name(models: Iterable[Any], optimizers: Iterable[Any]) -> dict[str, torch.Tensor]:
    """The tensors of ``state_items`` by name (for a repair in place)."""
    return {n: v for n, v in state_items(models, optimizers, captured=False) if isinstance(v, torch.Tensor)}
