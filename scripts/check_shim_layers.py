#!/usr/bin/env python3
"""Checks the direction of the calls and includes between the shim's modules.

Every ``libintercept/src/shim_*.c`` belongs to one layer below, and each layer
has one header, ``shim_<layer>.h``. Calls, on the object files: a module may
reference (``nm``: undefined symbol) only symbols defined by a module of a
lower layer, or of its own layer listed before it; entry modules (the
application's calls) may also reference each other. So the watchdog calls the
recovery and the recovery the replay, and no call goes back up. Each source is
compiled on its own (``cc -c``, the shim's flags) into a temporary directory.

Includes, on the sources (``#include "..."`` lines): a module includes the
header of its own layer and no header of a layer above it (so only the entry
modules see ``shim_entry.h``, the hooks' hot-path inline functions); a layer's
header includes only headers of lower layers; and no header of ``src`` is
part of an include circle. Headers of ``src`` that belong to no layer
(``NEUTRAL``) may be included from anywhere.

    python3 scripts/check_shim_layers.py [--src libintercept/src]

Exit 0 when every reference and include points down; 1 with one line per
offending reference or include otherwise; 2 when a source or a header of
``src`` is not placed (LAYERS, NEUTRAL) or a source does not compile.
"""

from __future__ import annotations

import argparse
import os
import re
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
# Headers of src outside the layers: includable from any module or header.
NEUTRAL = {"shim_table.h"}
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
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


def _header_layer(name: str) -> int | None:
    """Index in LAYERS of the layer whose header is ``name``, else None."""
    for li, (layer, _, _) in enumerate(LAYERS):
        if name == f"shim_{layer}.h":
            return li
    return None


def _includes(path: Path) -> list[str]:
    return INCLUDE.findall(path.read_text(errors="replace"))


def _circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Each include circle among graph's headers, once (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    found: list[list[str]] = []

    def visit(h: str) -> None:
        state[h] = 1
        path.append(h)
        for nxt in graph.get(h, []):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt in graph and not state.get(nxt):
                visit(nxt)
        path.pop()
        state[h] = 2

    for h in sorted(graph):
        if not state.get(h):
            visit(h)
    return found


def check_includes(src: Path) -> tuple[int, list[str]]:
    """The include rules of the module docstring, on the sources of src."""
    headers = sorted(src.glob("*.h"))
    unplaced = [h.name for h in headers if h.name.startswith("shim_") and h.name not in NEUTRAL
                and _header_layer(h.name) is None]
    if unplaced:
        return 2, [f"{src}/{h} is no layer's header (shim_<layer>.h) and not in {Path(__file__).name}'s "
                   "NEUTRAL: rename or place it" for h in unplaced]
    bad = []
    for s in sorted(src.glob("shim_*.c")):
        pos = _position(s.stem)
        if pos is None:
            continue  # reported by check()
        layer = LAYERS[pos[0]][0]
        incs = _includes(s)
        if f"shim_{layer}.h" not in incs:
            bad.append(f"{s.stem} ({layer}) does not include shim_{layer}.h, its layer's header")
        for inc in incs:
            li = _header_layer(inc)
            if li is not None and li > pos[0]:
                bad.append(f"{s.stem} ({layer}) includes {inc} ({LAYERS[li][0]}), a layer above its own")
    graph = {h.name: [i for i in _includes(h) if (src / i).is_file()] for h in headers}
    for h, incs in sorted(graph.items()):
        lh = _header_layer(h)
        for inc in incs:
            li = _header_layer(inc)
            if lh is not None and li is not None and li >= lh:
                bad.append(f"{h} ({LAYERS[lh][0]}) includes {inc} ({LAYERS[li][0]}), not a lower layer's header")
    bad += ["include circle: " + " -> ".join(c) for c in _circles(graph)]
    return (1 if bad else 0), bad


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
    src = args.src.resolve()
    rc_inc, inc_lines = check_includes(src)
    rc_sym, sym_lines = check(src)
    for line in inc_lines + sym_lines:
        print(line, file=sys.stderr)
    rc = max(rc_inc, rc_sym)
    if rc == 0:
        print(f"shim layers: every reference and include between modules of {args.src} points down")
    elif rc == 1:
        print(f"{len(inc_lines)} include(s) and {len(sym_lines)} reference(s) point up a layer or go round (see "
              f"the LAYERS table in {Path(__file__).name} and the layer comment in shim_base.h)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
