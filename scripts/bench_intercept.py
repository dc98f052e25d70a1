#!/usr/bin/env python3
"""Added cost of the LD_PRELOAD shim per intercepted call, on the stand-in runtime.

Runs build/shim-tests/bench under the shim. Within that one run, every
repetition times a batch of calls through the shim and a batch calling the
stand-in's own definitions directly (same handles, physical), interleaved and
in alternating order; the added cost is the median over repetitions of the
per-call difference, in thread CPU time (wall time on a loaded 2-core machine
mostly measures preemption and the stand-in worker thread's wake-ups). The
replay log is armed and cleared every batch, as per-minibatch hooks would.

    python3 scripts/bench_intercept.py [--reps N] [--json] [--shim PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_NS = 50.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=300, help="paired batches (5000 calls each)")
    ap.add_argument("--runs", type=int, default=3, help="independent runs; the median run is reported")
    ap.add_argument("--shim", default=str(REPO / "build" / "libjitintercept.so"))
    ap.add_argument("--no-log", action="store_true", help="disable the replay log (JITCKPT_REPLAY_LOG=0)")
    ap.add_argument("--handles", default="none", help="JITCKPT_VIRTUAL_HANDLES for the run (none/all/...)")
    ap.add_argument("--json", action="store_true", help="print the raw JSON result")
    args = ap.parse_args()

    subprocess.run(["make", "-s", "-C", str(REPO / "libintercept"), "shim", "shim-test-progs"], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITCKPT_")}
    env["LD_PRELOAD"] = args.shim
    env["JITCKPT_VIRTUAL_HANDLES"] = args.handles
    if args.no_log:
        env["JITCKPT_REPLAY_LOG"] = "0"
    bench = str(REPO / "build" / "shim-tests" / "bench")
    runs = []
    for _ in range(args.runs):
        out = subprocess.run([bench, str(args.reps)], env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout))
    if not all(r["shim"] for r in runs):
        print("the shim was not loaded", file=sys.stderr)
        return 1
    names = list(runs[0]["added_ns"])
    result = {
        "reps": args.reps,
        "runs": args.runs,
        "replay_log": not args.no_log,
        "virtual_handles": args.handles,
        "direct_ns": {n: sorted(r["direct_ns"][n] for r in runs)[len(runs) // 2] for n in names},
        "added_ns": {n: sorted(r["added_ns"][n] for r in runs)[len(runs) // 2] for n in names},
        "added_ns_all_runs": {n: [r["added_ns"][n] for r in runs] for n in names},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    log = "on" if result["replay_log"] else "off"
    print(
        f"shim overhead per call (stand-in runtime, {args.reps} x 5000 calls, {args.runs} runs, "
        f"replay log {log}, virtual handles: {args.handles})"
    )
    print(f"{'call':24s} {'stand-in ns':>12s} {'added ns':>10s}  runs")
    for n in names:
        runs_s = " ".join(f"{x:.1f}" for x in result["added_ns_all_runs"][n])
        print(f"{n:24s} {result['direct_ns'][n]:12.1f} {result['added_ns'][n]:10.1f}  [{runs_s}]")
    for n in ("cudaEventRecord", "cudaEventQuery"):
        verdict = "OK" if result["added_ns"][n] < TARGET_NS else "ABOVE"
        print(f"target < {TARGET_NS:.0f} ns for {n}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
