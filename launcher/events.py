"""The job timeline, ``<jit dir>/events.jsonl``: one JSON object per line.

Events (all carry ``t``, unix seconds): job_start, started (a worker is up),
fault_injected,
failure_detected, worker_exit, save_started, checkpoint_saved,
checkpoint_failed, checkpoint_skipped, ranks_killed, no_jit_checkpoint,
restart, job_abort, resumed, recovery (the per-failure summary: detection_s,
checkpoint_s, restart_to_resumed_s, failure_to_resumed_s, restore_step,
progress_step, redone_minibatches, minibatch_s), job_end.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class EventLog:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.events: list[dict] = []

    def emit(self, event: str, **fields) -> dict:
        rec = {"event": event, "t": fields.pop("t", None) or time.time(), **fields}
        self.events.append(rec)
        if self.path is not None:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, (json.dumps(rec, sort_keys=True) + "\n").encode())
            finally:
                os.close(fd)
        return rec


def summary(events: list[dict]) -> str:
    """Short human summary printed when jitrun ends."""
    lines = []
    t0 = events[0]["t"] if events else 0.0
    for e in events:
        if e["event"] in ("fault_injected", "failure_detected", "checkpoint_saved", "checkpoint_failed",
                          "ranks_killed", "no_jit_checkpoint", "restart", "resumed", "job_end"):
            detail = {k: v for k, v in e.items() if k not in ("event", "t", "path", "error")}
            lines.append(f"  +{e['t'] - t0:7.2f}s  {e['event']:<18} {json.dumps(detail, sort_keys=True)}")
    for e in events:
        if e["event"] == "recovery":
            lines.append(
                f"  recovery: failure->resumed {e['failure_to_resumed_s']:.2f}s "
                f"(detect {e['detection_s']:.2f}s, checkpoint {e['checkpoint_s']:.2f}s, "
                f"restart->resumed {e['restart_to_resumed_s']:.2f}s), resumed at step "
                f"{e['restore_step']}, redone minibatches {e['redone_minibatches']}"
            )
    return "jitrun timeline:\n" + "\n".join(lines) if lines else "jitrun: no failures"
