"""``jitrun events``: several nodes' timelines merged into one job order."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_events_merge_across_nodes(tmp_path):
    """``jitrun events`` merges node timelines into one job order, once each."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    e1 = {"event": "job_start", "t": 1.0, "node": "n0"}
    e2 = {"event": "job_start", "t": 0.5, "node": "n1"}
    e3 = {"event": "job_end", "t": 2.0, "node": "n0", "exitcode": 0}
    (a / "events.jsonl").write_text("\n".join(json.dumps(e) for e in (e1, e3)) + "\n")
    (b / "events.jsonl").write_text(json.dumps(e2) + "\n" + json.dumps(e1) + "\n")  # a copy of e1 too
    cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "events", "--json", str(a), str(b)],
                        capture_output=True, text=True, env={**os.environ})
    assert cp.returncode == 0, cp.stderr
    got = [json.loads(line) for line in cp.stdout.splitlines()]
    assert got == [e2, e1, e3]
    cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "events", str(tmp_path / "nope")],
                        capture_output=True, text=True)
    assert cp.returncode == 2 and "no such event log" in cp.stderr
