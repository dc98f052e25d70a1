"""Where a job's EC chunks and commit records live on a node (``/dev/shm/jitckpt-<job>/ec``),
their names, and the node inventory the launcher's decision reads (``scan_node``,
``choose_version``). No torch: the launcher imports it."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from ..wire import contract, layout
from . import pack as ec_pack

VERSIONS_HELD = 2  # while version v+1 is placed, version v is still the committed one

_CHUNK_RE = re.compile(r"^(?P<job>[A-Za-z0-9._-]+)\.s(?P<step>\d+)\.r(?P<rank>\d+)\.t(?P<stripe>\d+)"
                       r"\.c(?P<index>\d+)\.chunk$")
_COMMIT_RE = re.compile(r"^(?P<job>[A-Za-z0-9._-]+)\.s(?P<step>\d+)\.r(?P<rank>\d+)\.commit\.json$")


def shm_base() -> Path:
    return Path(contract.EC_SHM.get() or "/dev/shm")


def job_root(job_id: str, base: Path | None = None) -> Path:
    """This job's private tmpfs directory: the job key in the name, so a job never reads another's chunks."""
    return (base or shm_base()) / f"jitckpt-{ec_pack.job_key(job_id)}"


def private_root(job_id: str, base: Path | None = None) -> Path:
    """:func:`job_root`, created 0700 by us or an existing one of ours (tightened), else
    layout.CheckpointDirError: /dev/shm is shared by every user of the node and the name is
    predictable, so a directory someone else made there could hold chunks of their choosing."""
    root = job_root(job_id, base)
    layout.own_private_dir(root)
    return root


def ec_dir(job_id: str, base: Path | None = None) -> Path:
    return job_root(job_id, base) / "ec"


def commit_name(job_id: str, step: int, rank: int) -> str:
    return f"{ec_pack.job_key(job_id)}.s{step}.r{rank}.commit.json"


# -- node inventory (launcher side: no torch) ------------------------------------------------------------


def scan_node(job_id: str, base: Path | None = None) -> dict:
    """The EC state this node holds: commit records (parsed) and chunk files (from names and sizes only;
    payload checksums are verified by the restarted ranks, a bad chunk then counts as lost)."""
    d = ec_dir(job_id, base)
    key = ec_pack.job_key(job_id)
    commits: dict[int, dict] = {}
    chunks: list[list[int]] = []
    if not layout.is_own_private_dir(job_root(job_id, base)):
        return {"commits": [], "chunks": []}  # none, or someone else's: nothing in it is ours
    try:
        entries = list(os.scandir(d))
    except OSError:
        return {"commits": [], "chunks": []}
    for e in entries:
        if (m := _CHUNK_RE.match(e.name)) and m.group("job") == key:
            try:
                size = e.stat().st_size
            except OSError:
                continue
            chunks.append([int(m.group("step")), int(m.group("rank")), int(m.group("stripe")),
                           int(m.group("index")), size])
        elif (m := _COMMIT_RE.match(e.name)) and m.group("job") == key:
            step = int(m.group("step"))
            if step in commits:
                continue  # one record per step is enough: they describe the same version
            try:
                rec = json.loads(Path(e.path).read_text())
                if rec.get("job") != key or int(rec["step"]) != step:
                    continue
                commits[step] = rec
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return {"commits": [commits[s] for s in sorted(commits)], "chunks": sorted(chunks)}


def choose_version(node_ecs: Sequence[dict], world_size: int | None = None) -> tuple[dict | None, list[str]]:
    """The newest committed version decodable from these nodes' chunks, and why newer ones are not.

    ``node_ecs``: one ``scan_node`` result per surviving node. A version is decodable when some node holds its
    commit record (every chunk was placed, so the record proves completeness) and every rank's stripe has at
    least k distinct chunk indices of the recorded size among the surviving nodes.
    Returns ``({"step", "k", "m", "world_size", "attempt"}, rejected reasons)``.
    """
    commits: dict[int, dict] = {}
    have: dict[tuple[int, int, int], set[int]] = {}  # (step, rank, size) -> chunk indices
    for inv in node_ecs:
        for rec in inv.get("commits", ()):
            commits.setdefault(int(rec["step"]), rec)
        for step, rank, stripe, index, fsize in inv.get("chunks", ()):
            if stripe == 0:
                have.setdefault((step, rank, fsize), set()).add(index)
    rejected: list[str] = []
    for step in sorted(commits, reverse=True):
        rec = commits[step]
        try:
            k, m, ws = int(rec["k"]), int(rec["m"]), int(rec["world_size"])
            stripes = {int(r): s for r, s in rec["stripes"].items()}
        except (KeyError, TypeError, ValueError) as e:
            rejected.append(f"EC step {step}: malformed commit record ({e!r})")
            continue
        if world_size is not None and ws != world_size:
            rejected.append(f"EC step {step}: taken with {ws} ranks, the job now has {world_size}")
            continue
        short = []
        for r in range(ws):
            s = stripes.get(r)
            if s is None:
                short.append(f"rank {r}: not in the commit record")
                continue
            got = len(have.get((step, r, ec_pack.CHUNK_HEADER_SIZE + int(s["csize"])), set()))
            if got < k:
                short.append(f"rank {r}: {got} of the {k} chunks needed survive")
        if short:
            rejected.append(f"EC step {step} ({k}+{m}) is not decodable from the surviving nodes: "
                            + "; ".join(short[:4]) + ("; ..." if len(short) > 4 else ""))
            continue
        return {"step": step, "k": k, "m": m, "world_size": ws, "attempt": rec.get("attempt")}, rejected
    if not commits:
        rejected.append("no committed EC snapshot on the surviving nodes")
    return None, rejected


def versions(job_id: str, d: Path) -> tuple[set[int], list[tuple[int, Path]]]:
    """Committed steps in ``d`` and every (step, path) of this job's EC files."""
    key = ec_pack.job_key(job_id)
    committed, files = set(), []
    for e in os.scandir(d):
        m = _CHUNK_RE.match(e.name) or _COMMIT_RE.match(e.name)
        if m and m.group("job") == key:
            files.append((int(m.group("step")), Path(e.path)))
            if e.name.endswith(".commit.json"):
                committed.add(int(m.group("step")))
    return committed, files


def drop_uncommitted(job_id: str, d: Path) -> None:
    committed, files = versions(job_id, d)
    for step, p in files:
        if step not in committed:
            p.unlink(missing_ok=True)


def drop_other_versions(job_id: str, d: Path, keep: int) -> None:
    """After version ``keep`` is committed everywhere: the older one goes (and any other left over)."""
    _committed, files = versions(job_id, d)
    for step, p in files:
        if step != keep:
            p.unlink(missing_ok=True)


def drop_versions_after(job_id: str, step: int, base: Path | None = None) -> None:
    """Every EC version newer than ``step`` on this node: after the replicas' states were found to differ,
    those snapshots may hold the corrupted state, and a restart must not prefer them to the verified one."""
    d = ec_dir(job_id, base)
    if not layout.is_own_private_dir(job_root(job_id, base)) or not d.is_dir():
        return
    _committed, files = versions(job_id, d)
    for s, p in files:
        if s > step:
            p.unlink(missing_ok=True)
