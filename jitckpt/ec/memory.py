"""The memory cap of EC snapshots (``--jit-ec-max-mem``): parsing sizes, what
this node has (MemAvailable, the size of /dev/shm), what each node needs for a
version, and the message when a node is over its cap. No torch."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from ..wire import contract
from . import pack as ec_pack
from .files import VERSIONS_HELD, shm_base

DEFAULT_MAX_MEM_FRACTION = 0.25  # default cap: this fraction of MemAvailable (and at most the /dev/shm size)

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as --jit-ec-max-mem reads them)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def parse_size(text: str) -> int:
    """``"512M"`` -> 536870912: a number of bytes with an optional K/M/G/T suffix (powers of 1024; "KB",
    "KiB" mean the same). ValueError with the expected form."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGTkmgt]?)(?:i?[Bb])?\s*", text or "")
    if not m:
        raise ValueError(f"{text!r} is not a size: expected bytes with an optional K/M/G/T suffix "
                         "(powers of 1024), e.g. 512M or 2G, or a percentage of MemAvailable, e.g. 25%")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError(f"{text!r}: the cap must be more than 0 bytes")
    return value


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of this node in bytes (None if the kernel does not say)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                parts = line.split()
                return int(parts[1]) * (1024 if len(parts) > 2 and parts[2].lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def shm_size(base: Path | None = None) -> int | None:
    """Total size of the file system that holds the chunks (/dev/shm, a tmpfs), None if unknown."""
    try:
        st = os.statvfs(base or shm_base())
        return st.f_blocks * st.f_frsize
    except OSError:
        return None


def resolve_max_mem(text: str | None, avail: int | None = None, shm: int | None = None) -> tuple[int, str]:
    """The per-node cap in bytes for ``--jit-ec-max-mem`` (``None``: the default) and how it was derived.

    Checks what can be checked before the first snapshot: the value parses and is at most MemAvailable and
    the size of /dev/shm (the chunks live there). ``avail`` / ``shm``: the node's numbers (read when None).
    Raises ValueError naming the numbers and the fix."""
    avail = mem_available() if avail is None else avail
    shm = shm_size() if shm is None else shm
    where = f"/dev/shm ({shm_base()})" if contract.EC_SHM.get() else "/dev/shm"
    if text is None or text.strip() in ("", "auto"):
        if avail is None:
            raise ValueError("no MemAvailable in /proc/meminfo to derive the default cap from; "
                             "pass --jit-ec-max-mem SIZE (e.g. 2G)")
        cap = int(avail * DEFAULT_MAX_MEM_FRACTION)
        how = f"default: {DEFAULT_MAX_MEM_FRACTION:.0%} of MemAvailable {fmt_bytes(avail)}"
        if shm is not None and shm < cap:
            cap, how = shm, f"default: the size of {where}, {fmt_bytes(shm)} (< 25% of MemAvailable)"
        return cap, how
    t = text.strip()
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            raise ValueError(f"{text!r}: a percentage of MemAvailable must be in (0, 100], e.g. 25%")
        if avail is None:
            raise ValueError(f"{text!r}: no MemAvailable in /proc/meminfo; pass a size instead (e.g. 2G)")
        cap, how = int(avail * pct / 100), f"--jit-ec-max-mem {t} of MemAvailable {fmt_bytes(avail)}"
    else:
        cap, how = parse_size(t), f"--jit-ec-max-mem {t}"
    if avail is not None and cap > avail:
        raise ValueError(f"{text!r} = {fmt_bytes(cap)} is more than this node's MemAvailable "
                         f"({fmt_bytes(avail)}): the snapshots would push the node into swap or the OOM killer; "
                         f"pass at most {fmt_bytes(avail)} (default {DEFAULT_MAX_MEM_FRACTION:.0%} of it)")
    if shm is not None and cap > shm:
        raise ValueError(f"{text!r} = {fmt_bytes(cap)} is more than {where} can hold ({fmt_bytes(shm)}): "
                         f"the chunks live there; pass at most {fmt_bytes(shm)} or enlarge the tmpfs "
                         "(mount -o remount,size=... /dev/shm; docker run --shm-size)")
    return cap, how


def node_needs(node_of: Sequence[int], stripe_sizes: Sequence[int], plan: Sequence[tuple[int, int, int]],
               chunk_size) -> dict[int, dict]:
    """Bytes of /dev/shm each node needs for the EC files of this job at one version's peak:
    ``VERSIONS_HELD`` x (the chunks it holds, headers included) + its own ranks' staged save_fn output
    (about the packed size). ``plan``: (owner rank, chunk index, writer rank) as ``Snapshotter._plan``;
    ``chunk_size(stripe size)``: the codec's. Pure: every rank computes the same from all-gathered sizes."""
    out: dict[int, dict] = {}
    for n in sorted(set(node_of)):
        out[n] = {"chunks": 0, "chunk_bytes": 0, "largest_chunk": 0, "staged_bytes": 0,
                  "ranks": [r for r, x in enumerate(node_of) if x == n]}
    for r, _i, dst in plan:
        c = ec_pack.CHUNK_HEADER_SIZE + chunk_size(stripe_sizes[r])
        o = out[node_of[dst]]
        o["chunks"] += 1
        o["chunk_bytes"] += c
        o["largest_chunk"] = max(o["largest_chunk"], c)
    for r, n in enumerate(node_of):
        out[n]["staged_bytes"] += stripe_sizes[r]
    for o in out.values():
        o["need_bytes"] = VERSIONS_HELD * o["chunk_bytes"] + o["staged_bytes"]
    return out


def over_cap_message(step: int, node: int, need: dict, cap: int, how: str) -> str:
    """The loud line when a node's share does not fit under its cap: the numbers and the flags to change."""
    each = (f"{fmt_bytes(need['largest_chunk'])} each" if need["chunks"] * need["largest_chunk"] == need["chunk_bytes"]
            else f"{fmt_bytes(need['chunk_bytes'])} in all")
    return (f"EC snapshots DISABLED for this job at step {step}: node {node} (rank(s) "
            f"{','.join(map(str, need['ranks'][:8]))}{',...' if len(need['ranks']) > 8 else ''}) would hold "
            f"{VERSIONS_HELD} versions x {need['chunks']} chunk(s) ({each}) + {fmt_bytes(need['staged_bytes'])} "
            f"staged = {fmt_bytes(need['need_bytes'])} in /dev/shm, over its cap of {fmt_bytes(cap)} ({how}). "
            f"Raise --jit-ec-max-mem to at least {fmt_bytes(need['need_bytes'])} (at most the node's MemAvailable), "
            "or spread the chunks thinner (more nodes, a larger K in --jit-ec-code), or snapshot less state; "
            "--jit-ec-every 0 turns snapshots off. "
            "Training goes on without EC snapshots (JIT checkpoints are unaffected).")
