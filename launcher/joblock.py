"""One job per jit dir at a time: the lock ``<jit dir>/jitrun.lock``.

Every jitrun agent holds an ``flock`` on that file from before it writes
anything in the jit dir (job.json, events.jsonl, checkpoints) until it
ends; the kernel drops it when the agent dies, however it dies, so a lock is
never stale. Next to it each holder keeps a record of itself,
``<jit dir>/agents/<host>-<pid>.json`` (host, PID, job id and identity,
start time), for the refusal line and to recognise a run that did not end
cleanly: a record nobody holds the lock for is a dead agent's.

* a job of one node takes the lock exclusively: a second jitrun of the same
  job on the dir (the same command started twice) is refused with one line
  naming the running agent's PID and host and its workers' PIDs;
* the agents of a multi-node job take it shared, so the nodes of one job may
  share a jit dir; a one-node job is refused while they hold it, and they
  while a one-node job does (which job a dir belongs to is job.json's
  business, layout.claim_root, checked before and again under the lock);
* an agent that gets the lock alone looks at what the last run left: workers
  of that run still alive on this host (``ranks.json``: PID and start time)
  are a live job too, refused the same way; otherwise a dead agent's record,
  temp files of unfinished saves and old status records are removed and said.

The lock's file descriptor is not inherited by the workers (close-on-exec,
and the fork server is a fresh process). Main thread only.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from jitckpt.hang import status as rank_status
from jitckpt.wire import layout

LOCK_FILE = "jitrun.lock"
AGENTS_DIR = "agents"


class JobBusy(RuntimeError):
    """A live job holds the jit dir: the one line to print."""


def _host() -> str:  # as ranks.json names it (options.this_node)
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename


def _alive_as(pid: object, started: object) -> bool:
    """PID ``pid`` is alive and is the process that started at ``started`` (not a reused PID)."""
    if not isinstance(pid, int) or pid <= 0 or not isinstance(started, (int, float)):
        return False
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return abs(p.create_time() - started) < 0.05
    except (psutil.Error, ValueError):
        return False


def _records(root: Path) -> list[tuple[Path, dict]]:
    out = []
    try:
        entries = sorted((root / AGENTS_DIR).iterdir())
    except OSError:
        return out
    for p in entries:
        try:
            rec = json.loads(p.read_text())
            if isinstance(rec, dict):
                out.append((p, rec))
        except (OSError, ValueError):
            out.append((p, {}))
    return out


def _workers(root: Path, host: str | None = None) -> list[int]:
    """Live PIDs of the ranks in ranks.json (of ``host`` only when given)."""
    try:
        ranks = json.loads((root / layout.RANKS_FILE).read_text())["ranks"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return sorted({v["pid"] for v in ranks.values() if isinstance(v, dict)
                   and (host is None or v.get("host") == host) and _alive_as(v.get("pid"), v.get("started"))})


def _when(t: object) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


def _busy_line(root: Path, job_id: str) -> str:
    held = [r for _, r in _records(root) if r]
    workers = _workers(root, _host())
    agents = "; ".join(f"jitrun PID {r.get('pid')} on host {r.get('host')} since {_when(r.get('started'))}"
                       for r in held) or "a jitrun whose record is missing"
    wk = f" (workers {', '.join(map(str, workers))})" if workers else ""
    pids = " ".join(str(r.get("pid")) for r in held if r.get("host") == _host())
    stop = f"stop it first (kill {pids})" if pids else "stop it first"
    return (f"job {job_id!r} is already running on jit dir {str(root)!r}: {agents}{wk}; wait for it to end or "
            f"{stop}, or pass another --jit-dir")


@dataclass
class JobLock:
    fd: int
    record: Path | None

    def release(self) -> None:
        """The record goes first (a record left behind marks an unclean end), then the lock."""
        if self.fd < 0:
            return
        if self.record is not None:
            self.record.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1


def acquire(root: Path, job_id: str, identity: str, *, exclusive: bool) -> JobLock:
    """Take the jit dir's lock for this agent (JobBusy: a live job has it)."""
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, layout.FILE_MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            if exclusive or not _shared(fd):
                raise JobBusy(_busy_line(root, job_id)) from None
            alone = False
        if alone:
            _leftovers(root, job_id)
            # let the job's other nodes in: not atomic, another node's agent may hold it alone for a moment,
            # and a one-node job that wins it meanwhile keeps it (this agent is refused)
            if not exclusive and not _shared(fd):
                raise JobBusy(_busy_line(root, job_id))
        else:
            for p, rec in _records(root):  # dead agents of this host that shared the lock
                if rec.get("host") == _host() and not _alive_as(rec.get("pid"), rec.get("started_proc")):
                    p.unlink(missing_ok=True)
        record = _write_record(root, job_id, identity)
    except BaseException:
        os.close(fd)
        raise
    return JobLock(fd, record)


SHARE_WAIT_S = 5.0  # another node's agent holds the lock alone while it looks at leftovers, briefly


def _shared(fd: int) -> bool:
    """The shared lock, waiting out another agent's brief exclusive hold."""
    deadline = time.monotonic() + SHARE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def _write_record(root: Path, job_id: str, identity: str) -> Path:
    import psutil

    d = root / AGENTS_DIR
    layout.makedirs_private(d)
    path = d / f"{_host()}-{os.getpid()}.json"
    rec = {"host": _host(), "pid": os.getpid(), "job_id": job_id, "identity": identity, "started": time.time(),
           "started_proc": psutil.Process().create_time()}
    layout.atomic_write_bytes(path, json.dumps(rec).encode())
    return path


def _leftovers(root: Path, job_id: str) -> None:
    """Alone on the dir: the last run's workers still alive here are a live job;
    else what a dead run left is removed, and said."""
    orphans = _workers(root, _host())
    if orphans:
        pids = ", ".join(map(str, orphans))
        raise JobBusy(f"workers of an earlier run of job {job_id!r} on jit dir {str(root)!r} are still running "
                      f"though their jitrun is gone: PIDs {pids} on host {_host()}; stop them "
                      f"(kill {' '.join(map(str, orphans))}) and run again")
    # a jitrun that kept no records (an older one) left an unended job_start at most
    dead = [rec for _, rec in _records(root)] or ([] if (root / AGENTS_DIR).exists() else _unended(root))
    if not dead:
        return
    from .ec_clean import stale_temp_files

    temps = [p for p in stale_temp_files(root) if p.name != LOCK_FILE]
    for p in temps:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    shutil.rmtree(root / AGENTS_DIR, ignore_errors=True)
    shutil.rmtree(root / rank_status.DIRNAME, ignore_errors=True)
    who = ", ".join(f"jitrun PID {r.get('pid')}" + (f" on host {r['host']}" if r.get("host") else "")
                    for r in dead if r) or "a jitrun"
    print(f"jitrun: the last run on this jit dir ({who}) did not end cleanly (killed?); removed its leftovers: "
          f"its lock record, {len(temps)} unfinished temp file(s), its ranks' status records", file=sys.stderr,
          flush=True)


def _unended(root: Path) -> list[dict]:
    """The last job_start in events.jsonl without a job_end after it (a run of a
    jitrun that kept no lock record), as [{"pid": ...}], or []."""
    last: dict | None = None
    try:
        with open(root / "events.jsonl", encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict) and ev.get("event") == "job_start":
                    last = {"pid": ev.get("pid")}
                elif isinstance(ev, dict) and ev.get("event") == "job_end":
                    last = None
    except OSError:
        return []
    return [last] if last else []
