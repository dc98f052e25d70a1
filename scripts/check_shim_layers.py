#!/usr/bin/env python3
"""Checks the call direction between the shim's modules on its object files.

Every ``libintercept/src/shim_*.c`` belongs to one layer below. A module may
reference (``nm``: undefined symbol) only symbols defined by a module of a
lower layer, or of its own layer listed before it; entry modules (the
application's calls) may also reference each other. So the watchdog calls the
recovery and the recovery the replay, and no call goes back up. Each source is
compiled on its own (``cc -c``, the shim's flags) into a temporary directory.

    python3 scripts/check_shim_layers.py [--src libintercept/src]

Exit 0 when every reference points down; 1 with one line per offending
reference otherwise; 2 when a source is not in the table (place it) or does
not compile.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Lowest layer first; within an ordered layer, a module may use those listed before it.
LAYERS: list[tuple[str, list[str], bool]] = [
    ("base", ["shim_core", "shim_vh", "shim_store", "shim_gil", "shim_pool", "shim_comms", "shim_trigger",
              "shim_watchlist"], True),
    ("replay", ["shim_replay"], True),
    ("recovery", ["shim_device", "shim_recover", "shim_transparent"], True),
    ("watchdog", ["shim_watchdog"], True),
    ("entry", ["shim_phases", "shim_cuda", "shim_nccl", "shim_v12"], False),
]
CFLAGS = ["-O2", "-std=gnu11", "-fPIC", "-pthread", "-fvisibility=hidden", "-ftls-model=initial-exec",
          "-Wall", "-Wextra", "-Werror"]


def _position(module: str) -> tuple[int, int, bool] | None:
    for li, (_, mods, ordered) in enumerate(LAYERS):
        if module in mods:
            return li, mods.index(module), ordered
    return None


def _allowed(user: str, owner: str) -> bool:
    u, o = _position(user), _position(owner)
    assert u is not None and o is not None
    if o[0] != u[0]:
        return o[0] < u[0]
    return not u[2] or o[1] < u[1]


def _symbols(obj: Path) -> tuple[set[str], set[str]]:
    out = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRVW" and parts[1].isupper():
            defined.add(parts[2])
    return defined, undefined


def check(src: Path) -> tuple[int, list[str]]:
    lib = src.parent
    sources = sorted(src.glob("shim_*.c"))
    unplaced = [s.stem for s in sources if _position(s.stem) is None]
    if unplaced:
        return 2, [f"{src}/{m}.c is in no layer of {Path(__file__).name}'s LAYERS: place it" for m in unplaced]
    cc = os.environ.get("CC", "cc")
    defs: dict[str, str] = {}
    uses: dict[str, set[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in sources:
            obj = Path(tmp) / f"{s.stem}.o"
            inc = ["-I", str(lib / "abi"), "-I", str(lib / "include"), "-I", str(src)]
            r = subprocess.run([cc, *CFLAGS, *inc, "-c", str(s), "-o", str(obj)], capture_output=True, text=True)
            if r.returncode:
                return 2, [f"{s} does not compile:\n{r.stderr}"]
            defined, undefined = _symbols(obj)
            for d in defined:
                defs[d] = s.stem
            uses[s.stem] = undefined
    bad = []
    for user, syms in sorted(uses.items()):
        for sym in sorted(syms):
            owner = defs.get(sym)
            if owner and owner != user and not _allowed(user, owner):
                lu, lo = LAYERS[_position(user)[0]][0], LAYERS[_position(owner)[0]][0]  # type: ignore[index]
                bad.append(f"{user} ({lu}) -> {owner} ({lo}): {sym}")
    return (1 if bad else 0), bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=REPO / "libintercept" / "src")
    args = ap.parse_args()
    rc, lines = check(args.src.resolve())
    for line in lines:
        print(line, file=sys.stderr)
    if rc == 0:
        print(f"shim layers: every reference between modules of {args.src} points down")
    elif rc == 1:
        print(f"{len(lines)} reference(s) point up a layer (see the LAYERS table in {Path(__file__).name} and "
              "the layer comment in shim_internal.h)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
