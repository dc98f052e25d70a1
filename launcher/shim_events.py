"""The shim's in-place recoveries in the job timeline.

Workers with the shim (``--jit-intercept``) write one ``shim_recovery`` JSON
line per rank per recovery to ``<jit dir>/shim_events.jsonl``
(JITCKPT_SHIM_EVENTS, see libintercept/README.md "In-place recovery").
After the job, :func:`collect` merges the lines of one recovery (same restart
attempt and epoch) into one ``in_place_recovery`` record in ``events.jsonl``
and returns summary lines for the end of jitrun's output.

The record is not called ``recovery``: that event is the restart path's
summary (failure_to_resumed_s, restore_step, ...) and its readers expect
those fields.
"""

from __future__ import annotations

import json
from pathlib import Path

SHIM_EVENTS = "shim_events.jsonl"
STAGES = ("abort_s", "agree_s", "reinit_s", "replay_s")


def merge(lines: list[dict]) -> list[dict]:
    groups: dict[tuple[int, int], list[dict]] = {}
    for e in lines:
        if e.get("event") == "shim_recovery":
            groups.setdefault((int(e.get("attempt", 0)), int(e.get("epoch", 0))), []).append(e)
    out = []
    for (attempt, epoch), evs in sorted(groups.items()):
        hangs = [e for e in evs if e.get("fault") == "hang"]
        timeout = max((e.get("timeout_s", 0.0) for e in evs), default=0.0)
        total = max(e.get("total_s", 0.0) for e in evs)
        rec = {
            "event": "in_place_recovery",
            "t": min(e["t"] for e in evs),
            "attempt": attempt,
            "epoch": epoch,
            "ranks": sorted(e.get("rank", -1) for e in evs),
            "faults": {str(e.get("rank", -1)): e.get("fault") for e in evs},
            "outcome": "recovered" if all(e.get("outcome") == "recovered" for e in evs) else "fallback",
            "reasons": sorted({e["reason"] for e in evs if e.get("reason")}),
            "minibatch": max(e.get("minibatch", 0) for e in evs),
            "replayed": max(e.get("replayed", 0) for e in evs),
            "timeout_s": timeout,
            "detection_s": max((e.get("waited_s", 0.0) for e in hangs), default=0.0),
            "total_s": total,
            # from the fault to the job going on, minus the timeout (0 without a hang)
            "recovery_minus_timeout_s": max((e["waited_s"] - timeout + e["total_s"] for e in hangs), default=total),
            "stages": {k[:-2]: max(e.get(k, 0.0) for e in evs) for k in STAGES},
            # after a lost device's refill: the state the refilled rank and its replica agreed on
            "state_digest": next((e["state_digest"] for e in evs if e.get("state_digest")), None),
        }
        out.append(rec)
    return out


def collect(root: Path) -> list[str]:
    """Appends the merged records to root/events.jsonl; returns summary lines."""
    src = root / SHIM_EVENTS
    if not src.exists():
        return []
    lines = []
    for raw in src.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    recs = merge(lines)
    if not recs:
        return []
    with open(root / "events.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    out = []
    for r in recs:
        faults = ", ".join(sorted({v for v in r["faults"].values() if v != "peer"})) or "peer"
        st = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in r["stages"].items())
        out.append(f"  in-place recovery (epoch {r['epoch']}, minibatch {r['minibatch']}): {faults} -> "
                   f"{r['outcome']} in {r['total_s'] * 1000:.1f} ms after detection ({st}), "
                   f"{r['replayed']} calls replayed" + (f"; {'; '.join(r['reasons'])}" if r["reasons"] else ""))
    return out
