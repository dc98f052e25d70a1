"""Per-thread cost of a launcher's process tree, for the overhead benches: CPU time,
voluntary and involuntary context switches and minor page faults of every thread,
grouped by role (the launcher, its workers, helpers such as the fork server) and
thread name, read from /proc at two points and divided by the steps between them.
A launcher that costs the training nothing shows the same per-step figures as
plain torchrun's for every group; an extra thread that wakes often shows as
switches, work it takes from the training as CPU, memory it touches as faults."""

from __future__ import annotations

import os
import re

Key = tuple[str, str]  # (role, thread)
TICK = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            kids.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(int(d))
    return kids


def _role(pid: int, root: int, marker: str) -> str:
    if pid == root:
        return "launcher"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
    except OSError:
        return "gone"
    return "worker" if marker in cmd or cmd.startswith("jitrun[rank") else "helper"


def snapshot(root: int, marker: str) -> dict[Key, list[int]]:
    """(role, thread) -> [cpu ticks, voluntary, involuntary switches, minor faults], summed over
    the tree of ``root``; ``marker``: a string of the workers' command lines (the script)."""
    kids, out, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        role = _role(pid, root, marker)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                with open(f"{base}/stat", "rb") as f:
                    stat = f.read()
                with open(f"{base}/status") as f:
                    status = f.read()
            except OSError:
                continue
            comm = stat[stat.index(b"(") + 1:stat.rindex(b")")].decode(errors="replace")
            rest = stat[stat.rindex(b")") + 2:].split()
            name = "main" if int(tid) == pid else re.sub(r"[\d/ ]+$", "", comm) or comm
            sw = [int(x) for x in re.findall(r"^(?:non)?voluntary_ctxt_switches:\s*(\d+)", status, re.M)]
            row = out.setdefault((role, name), [0, 0, 0, 0])
            for i, v in enumerate((int(rest[11]) + int(rest[12]), *sw, int(rest[7]))):
                row[i] += v
    return out


def per_step(a: dict[Key, list[int]], b: dict[Key, list[int]], steps: int) -> dict[str, dict[str, float]]:
    """``role/thread`` -> cpu_ms, vol, invol, minflt per step between snapshots ``a`` and ``b``
    (a thread started in between counts from zero)."""
    out = {}
    for key, row in b.items():
        r0 = a.get(key, [0, 0, 0, 0])
        d = [x - y for x, y in zip(row, r0, strict=True)]
        out["/".join(key)] = {"cpu_ms": d[0] / TICK * 1e3 / steps, "vol": d[1] / steps, "invol": d[2] / steps,
                              "minflt": d[3] / steps}
    return out
