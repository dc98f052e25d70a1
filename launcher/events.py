"""The job timeline, ``<jit dir>/events.jsonl``: one JSON object per line.

Events (all carry ``t``, unix seconds): job_start, started (a worker is up),
fault_injected,
failure_detected, worker_exit, save_started, checkpoint_saved,
checkpoint_failed, checkpoint_skipped, ranks_killed, no_jit_checkpoint,
restart, job_abort, resumed, recovery (the per-failure summary: detection_s,
checkpoint_s, restart_to_resumed_s, failure_to_resumed_s, restore_step,
progress_step, redone_minibatches, minibatch_s, and ``stages``: detection,
checkpoint, stop, decision, rendezvous, process_start, import_and_init,
checkpoint_load, first_minibatch seconds, consecutive), job_end; and for the
job-wide path: rendezvous (round, group rank, this node's ranks),
restore_decision (the job's step, the nodes holding it, lost nodes),
replica_fetched (with ``via``: stream or store) / replica_fetch_failed /
replica_fetch_fallback (peer transfer; the last: why a source's bytes went
through the store instead of the direct stream), loaded (the step a
rank actually loaded, and the state digest its replicas verified:
``fingerprint``), state_divergence, spare_waiting. The replicas' state checks
(jitckpt/verify/verifier.py): state_mismatch (replicas hold different states: after a
restore, refused; during training, rolled back), sdc_suspect (the rank outside
the majority), state_repaired (taken from the majority in place), verify_off
(replicas that differ by nature: checks off for the job). preempted: SIGTERM
or SIGINT stopped the job (launcher/preempt.py: signal, who got it, the step
saved, the ranks' progress, whether nothing was lost, ranks killed; reports_unread
if the store was gone by then). A ``recovery``
record also carries ``fingerprint``: shard -> the digest its replicas agreed on.
error_file_unusable: a failed worker's error file that was empty, torn,
unreadable or malformed (``state``), reported without it (error_files.py).

Every record written by an agent names its ``node``; each node writes its own
ranks' reports only, and ``jitrun events DIR...`` merges several nodes' logs
into one job order.

A line is one ``write`` (O_APPEND): agents sharing a log never interleave. A
write the disk cuts short (full, failing) is truncated away again, the
failure said once on stderr and the record kept in memory (the summary at the
end has it); a line torn anyway (a crash mid-write, a concurrent appender) is
skipped by the reader with a warning, and the next writer starts a new line
after it.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path


class EventLog:
    def __init__(self, path: Path | None, node: str | None = None) -> None:
        self.path = path
        self.node = node  # every record names the node that wrote it
        self.events: list[dict] = []
        self.write_error: OSError | None = None  # the last write's failure, said once until a write works

    def emit(self, event: str, **fields) -> dict:
        rec = {"event": event, "t": fields.pop("t", None) or time.time(), **fields}
        if self.node is not None:
            rec.setdefault("node", self.node)
        self.events.append(rec)
        if self.path is not None:
            try:
                append_line(self.path, (json.dumps(rec, sort_keys=True) + "\n").encode())
                self.write_error = None
            except OSError as e:
                if self.write_error is None:
                    print(f"jitrun: warning: could not write {self.path} ({e.strerror or e}); its events are kept "
                          "in memory and printed at the end until a write works", file=sys.stderr, flush=True)
                self.write_error = e
        return rec


def append_line(path: Path, data: bytes) -> None:
    """Append one line with one write; a write cut short is undone (OSError)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        start = os.fstat(fd).st_size
        if start and os.pread(fd, 1, start - 1) != b"\n":
            data = b"\n" + data  # after a torn line: never glued to it
        n = os.write(fd, data)
        if n != len(data):
            if os.fstat(fd).st_size == start + n:  # nobody appended since: the torn part goes
                os.ftruncate(fd, start)
            raise OSError(errno.ENOSPC, f"short write ({n} of {len(data)} bytes): the disk is full")
    finally:
        os.close(fd)


def summary(events: list[dict]) -> str:
    """Short human summary printed when jitrun ends."""
    lines = []
    t0 = events[0]["t"] if events else 0.0
    multi = len({e.get("node") for e in events}) > 1
    for e in events:
        if e["event"] in ("fault_injected", "failure_detected", "hang_detected", "checkpoint_saved",
                          "checkpoint_failed", "ranks_killed", "no_jit_checkpoint", "restart", "resumed", "job_end",
                          "restore_decision", "replica_fetched", "replica_fetch_failed", "replica_fetch_fallback",
                          "state_divergence", "spare_waiting", "job_abort", "state_mismatch", "sdc_suspect",
                          "state_repaired", "verify_off", "preempted", "refused"):
            detail = {k: v for k, v in e.items() if k not in ("event", "t", "path", "error", "node")}
            where = f"[{e['node']}] " if multi and e.get("node") else ""
            lines.append(f"  +{e['t'] - t0:7.2f}s  {where}{e['event']:<18} {json.dumps(detail, sort_keys=True)}")
    for e in events:
        if e["event"] == "recovery":
            def s(k: str, e: dict = e) -> str:
                return "-" if e.get(k) is None else f"{e[k]:.2f}s"

            lines.append(
                f"  recovery: failure->resumed {s('failure_to_resumed_s')} "
                f"(detect {s('detection_s')}, checkpoint {s('checkpoint_s')}, "
                f"restart->resumed {s('restart_to_resumed_s')}), resumed at step "
                f"{'unknown' if e.get('restore_step') is None else e['restore_step']}, redone minibatches "
                f"{'unknown' if e.get('redone_minibatches') is None else e['redone_minibatches']}"
            )
            if e.get("stages"):
                lines.append("    " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}s" for k, v in e["stages"].items()))
    return "jitrun timeline:\n" + "\n".join(lines) if lines else "jitrun: no failures"


def load(paths: list[Path]) -> list[dict]:
    """Events of several nodes' logs in one job order (by time), each record
    once: a shared jit dir listed twice, or the same file copied off two
    nodes, does not double anything."""
    seen: set[str] = set()
    out: list[dict] = []
    for p in paths:
        f = p / "events.jsonl" if p.is_dir() else p
        if not f.exists():
            raise FileNotFoundError(f"{f}: no such event log (pass a jit dir or an events.jsonl file)")
        text = f.read_text(errors="replace")
        lines = text.splitlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError
            except ValueError:
                # cut short by a failed write: the last line without its newline, or a line
                # that starts a record and never ends it (the writer starts anew after it)
                if line.startswith("{") and (n == len(lines) and not text.endswith("\n")
                                             or not line.rstrip().endswith("}")):
                    print(f"jitrun events: warning: {f}:{n}: a torn line (a write cut short, e.g. by a full "
                          "disk) skipped", file=sys.stderr, flush=True)
                    continue
                raise ValueError(f"{f}:{n}: not a JSON line; is this a jitrun events.jsonl?") from None
            key = json.dumps(rec, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(rec)
    out.sort(key=lambda e: e.get("t", 0.0))
    return out


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="jitrun events",
                                 description="Merge the event logs of a job's nodes into one timeline.")
    ap.add_argument("paths", nargs="*", help="jit dirs or events.jsonl files, one per node")
    ap.add_argument("--jit-dir", action="append", default=[], help="a node's jit dir (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the merged events as JSON lines")
    a = ap.parse_args(argv)
    if any(not p.strip() for p in [*a.jit_dir, *a.paths]):  # Path("") would read ./events.jsonl
        print("jitrun events: error: an empty path; pass a jit dir or an events.jsonl file", file=sys.stderr)
        return 2
    paths = [Path(p) for p in [*a.jit_dir, *a.paths]]
    if not paths:
        print("jitrun events: error: give at least one jit dir or events.jsonl", file=sys.stderr)
        return 2
    try:
        evs = load(paths)
    except (OSError, ValueError) as e:
        print(f"jitrun events: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        for e in evs:
            print(json.dumps(e, sort_keys=True))
    else:
        print(summary(evs))
    return 0
