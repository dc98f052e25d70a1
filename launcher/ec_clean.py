"""``jitrun clean --jit-dir DIR``: free this node's EC snapshot memory and a jit dir's stale temp files; and the
same freeing when a job ends (``free_at_end``, called by ``launch``).

What is removed, on the node it runs on:

* this job's directory in /dev/shm (``/dev/shm/jitckpt-<job key>/``: chunks, commit records, staging),
  named after the job id in ``DIR/job.json``; another job's directory is never touched (the job key is in
  the name, and every chunk header carries it too, ``ec_pack.read_chunk``);
* stale temp files under DIR: ``.tmp-rank-*`` staging and fetch directories of saves that never finished,
  ``.old-rank-*`` leftovers of a replaced replica, ``.*.tmp-*`` half-written files, ``.probe-*``;
* with ``--all`` only: the complete checkpoints too (``DIR/ckpt``, ``DIR/previous``). Without it a complete
  checkpoint is never removed. ``job.json`` and ``events.jsonl`` always stay.

It refuses while the job is running on this node (its jitrun process, from events.jsonl, is alive):
``--force`` overrides. ``--dry-run`` lists without removing. Exit 0, or 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from jitckpt.ec import files as ec_files
from jitckpt.ec import memory as ec_memory
from jitckpt.wire import layout

PROG = "jitrun clean"


def _size(p: Path) -> tuple[int, int]:
    """(files, bytes) under ``p`` (a file or a directory), not following symlinks."""
    try:
        if p.is_symlink() or p.is_file():
            return 1, p.lstat().st_size
    except OSError:
        return 0, 0
    files = size = 0
    for cur, _dirs, names in os.walk(p):
        for n in names:
            try:
                size += os.lstat(os.path.join(cur, n)).st_size
                files += 1
            except OSError:
                pass
    return files, size


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def free_node(job_id: str, base: Path | None = None, dry_run: bool = False) -> tuple[Path, int, int]:
    """Remove this job's EC directory in /dev/shm (``base``: instead of /dev/shm). Returns (dir, files, bytes)."""
    d = ec_files.job_root(job_id, base)
    if not d.exists() or not layout.is_own_private_dir(d):
        return d, 0, 0  # someone else's directory is not ours to remove
    files, size = _size(d)
    if not dry_run:
        _remove(d)
    return d, files, size


def free_at_end(job_id: str, events=None) -> None:
    """The job ended on this node (normally, after giving up, or stopped by a signal): its EC chunks are of
    no further use and hold RAM until reboot, so they go. Never raises (the exit code is already decided)."""
    try:
        d, files, size = free_node(job_id)
    except Exception as e:  # pragma: no cover - best effort
        print(f"jitrun: warning: could not free the EC snapshots of this job: {e}", file=sys.stderr, flush=True)
        return
    if files:
        print(f"jitrun: freed {ec_memory.fmt_bytes(size)} of EC snapshots ({files} file(s)) in {d}", flush=True)
        if events is not None:
            events.emit("ec_freed", dir=str(d), files=files, bytes=size)


def _is_temp(name: str) -> bool:
    return (name.startswith((".tmp-rank-", ".old-rank-", ".probe-"))
            or (name.startswith(".") and ".tmp-" in name))


def stale_temp_files(root: Path) -> list[Path]:
    """Temp files and directories a save, fetch or atomic write left under ``root`` (outermost only)."""
    out: list[Path] = []
    for cur, dirs, names in os.walk(root):
        keep = []
        for d in dirs:
            (out.append(Path(cur) / d) if _is_temp(d) else keep.append(d))
        dirs[:] = keep  # do not descend into what goes anyway
        out.extend(Path(cur) / n for n in names if _is_temp(n))
    return sorted(out)


def _running(root: Path) -> int | None:
    """The pid of a jitrun of this jit dir that is still alive on this node (from events.jsonl), or None."""
    pid = None
    try:
        with open(root / "events.jsonl", encoding="utf-8") as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("event") == "job_start":
                    pid = ev.get("pid")
                elif ev.get("event") == "job_end":
                    pid = None
    except OSError:
        return None
    if not isinstance(pid, int) or pid <= 0:
        return None
    import psutil

    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return None  # gone (or not visible here)
    return pid if "jitrun" in cmd or "launcher" in cmd else None


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Remove this node's EC snapshot chunks (in /dev/shm) of the job whose jit dir is given and "
                    "the jit dir's stale temp files; never a complete checkpoint unless --all. Run it on every "
                    "node of the job (each holds its own chunks).")
    p.add_argument("--jit-dir", required=True, metavar="DIR", help="the job's jit dir (holds job.json)")
    p.add_argument("--all", action="store_true",
                   help="also remove the complete checkpoints (DIR/ckpt and DIR/previous)")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    p.add_argument("--force", action="store_true", help="clean even though the job's jitrun seems to be running")
    return p


def main(argv: list[str], stdout=None, stderr=None) -> int:
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if not args.jit_dir.strip():  # Path("") is the current directory, whose temp files are not ours
        print(f"{PROG}: error: --jit-dir {args.jit_dir!r}: an empty path; pass the job's jit dir", file=err)
        return 2
    root = Path(args.jit_dir).resolve()
    if not root.is_dir():
        print(f"{PROG}: error: --jit-dir {args.jit_dir}: no such directory", file=err)
        return 2
    job_id = layout.read_job_id(root)
    if job_id is None:
        print(f"{PROG}: error: {root} has no readable {layout.JOB_FILE}: not a jit dir (nothing removed)", file=err)
        return 2
    pid = _running(root)
    if pid is not None and not args.force:
        print(f"{PROG}: error: job {job_id!r} is still running on this node (jitrun pid {pid}); its chunks and "
              "temp files are in use. Stop it first, or pass --force", file=err)
        return 2
    verb = "would remove" if args.dry_run else "removed"
    total_files = total_bytes = 0

    def say(what: str, path: Path, files: int, size: int) -> None:
        nonlocal total_files, total_bytes
        total_files += files
        total_bytes += size
        print(f"{PROG}: {verb} {what}: {path} ({files} file(s), {ec_memory.fmt_bytes(size)})", file=out)

    d, files, size = free_node(job_id, dry_run=args.dry_run)
    if files or d.exists():
        say("EC snapshot chunks of this job", d, files, size)
    else:
        print(f"{PROG}: no EC snapshot chunks of job {job_id!r} on this node ({d})", file=out)
    for p in stale_temp_files(root):
        files, size = _size(p)
        what = "stale temp directory" if p.is_dir() else "stale temp file"
        if not args.dry_run:
            _remove(p)
        say(what, p, files, size)
    replicas, _bad = layout.scan(root, job_id, layout.read_identity(root))
    steps = sorted({r.step for r in replicas})
    if args.all:
        for sub in ("ckpt", "previous"):
            p = root / sub
            if p.exists():
                files, size = _size(p)
                if not args.dry_run:
                    _remove(p)
                say("checkpoints (--all)", p, files, size)
    print(f"{PROG}: {verb} {total_files} file(s), {ec_memory.fmt_bytes(total_bytes)} in all"
          + ("" if args.all else
             f"; kept {len(replicas)} complete checkpoint(s)"
             + (f" (step(s) {', '.join(map(str, steps[-5:]))})" if steps else "")
             + (" and DIR/previous" if (root / "previous").exists() else "")
             + " (--all removes them)"), file=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
