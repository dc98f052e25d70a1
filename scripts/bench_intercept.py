#!/usr/bin/env python3
"""Added cost of the LD_PRELOAD shim per intercepted call, on the stand-in runtime.

Runs build/shim-tests/bench under the shim. Within that one run, every
repetition times a batch of calls through the shim and a batch calling the
stand-in's own definitions directly (same handles, physical), interleaved and
in alternating order; the added cost is the median over repetitions of the
per-call difference, in thread CPU time (wall time on a loaded 2-core machine
mostly measures preemption and the stand-in worker thread's wake-ups). The
replay log is armed and cleared every batch, as per-minibatch hooks would.

Workers held (default): while a record or wait batch is timed, every
stand-in stream worker waits inside a host function, so each call only
appends to a queue, as a real runtime's record appends to a push buffer.
``--live-workers`` times them against running workers instead: each append
then also wakes idle workers (a futex wake, charged to the caller) and
contends with them for the stand-in's one lock, and how often that happens
depends on how the shim's path phases against the workers; that interplay,
not the shim's own instructions, dominates the live figure (perf: two thirds
of the samples in the kernel's wake-up path, ~1.5 % in the shim) and moves
it by tens of ns from run to run.

A/B: ``--baseline OTHER.so`` (another build of the shim, e.g. an older
commit's) runs the same bench program under both libraries, alternating run
by run (A B B A A B ...), so both see the same machine; the report gives each
library's median added cost and the difference.

    python3 scripts/bench_intercept.py [--reps N] [--runs N] [--json] [--shim PATH] [--baseline PATH]
                                       [--live-workers]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Added ns per call the shim should stay within (cudaEventRecord / cudaStreamWaitEvent run
# every step of every user; cudaEventQuery is polled).
TARGET_NS = {"cudaEventRecord": 25.0, "cudaStreamWaitEvent": 25.0, "cudaEventQuery": 25.0}


def _run(bench: str, shim: str, reps: int, workers: str, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([bench, str(reps), workers], env={**env, "LD_PRELOAD": shim}, capture_output=True, text=True,
                         check=True)
    res = json.loads(out.stdout)
    if not res["shim"]:
        raise SystemExit(f"{shim} was not loaded (LD_PRELOAD): check the path")
    held, batches = res["held_through"]
    if workers == "held" and held != batches:
        raise SystemExit(f"the stand-in's workers ran during {batches - held} of {batches} timed batches: "
                         "the held figures would include them (a stand-in with more streams than the bench holds?)")
    return res


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = list(runs[0]["added_ns"])
    return {
        "direct_ns": {n: _median([r["direct_ns"][n] for r in runs]) for n in names},
        "added_ns": {n: _median([r["added_ns"][n] for r in runs]) for n in names},
        "added_ns_all_runs": {n: [r["added_ns"][n] for r in runs] for n in names},
        # timed batches every stand-in worker sat out, of all timed batches
        "held_through": [sum(r["held_through"][i] for r in runs) for i in (0, 1)],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=300, help="paired batches (5000 calls each)")
    ap.add_argument("--runs", type=int, default=3, help="independent runs per library; the median is reported")
    ap.add_argument("--shim", default=str(REPO / "build" / "libjitintercept.so"))
    ap.add_argument("--baseline", help="a second build of the shim, run interleaved with --shim (A/B)")
    ap.add_argument("--no-log", action="store_true", help="disable the replay log (JITCKPT_REPLAY_LOG=0)")
    ap.add_argument("--handles", default="none", help="JITCKPT_VIRTUAL_HANDLES for the run (none/all/...)")
    ap.add_argument("--live-workers", action="store_true",
                    help="time the calls against running stand-in workers (see above)")
    ap.add_argument("--json", action="store_true", help="print the raw JSON result")
    args = ap.parse_args()

    subprocess.run(["make", "-s", "-C", str(REPO / "libintercept"), "shim", "shim-test-progs"], check=True)
    for path in [args.shim] + ([args.baseline] if args.baseline else []):
        if not Path(path).is_file():
            print(f"no such shim library: {path} (build one with `make -C libintercept BUILD=<dir> shim`)",
                  file=sys.stderr)
            return 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITCKPT_") and k != "LD_PRELOAD"}
    env["JITCKPT_VIRTUAL_HANDLES"] = args.handles
    if args.no_log:
        env["JITCKPT_REPLAY_LOG"] = "0"
    bench = str(REPO / "build" / "shim-tests" / "bench")
    libs = {"shim": args.shim} | ({"baseline": args.baseline} if args.baseline else {})
    workers = "live" if args.live_workers else "held"
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in libs}
    for i in range(args.runs):
        order = list(libs) if i % 2 == 0 else list(reversed(libs))
        for k in order:
            runs[k].append(_run(bench, libs[k], args.reps, workers, env))
    result: dict[str, Any] = {
        "reps": args.reps,
        "runs": args.runs,
        "replay_log": not args.no_log,
        "virtual_handles": args.handles,
        "workers": workers,
    }
    for k in libs:
        result[k] = {"path": libs[k], **_summary(runs[k])}
    names = list(result["shim"]["added_ns"])
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    log = "on" if result["replay_log"] else "off"
    print(f"shim overhead per call (stand-in runtime, {args.reps} x 5000 calls, {args.runs} runs per library"
          f"{', interleaved A/B' if args.baseline else ''}, replay log {log}, virtual handles: {args.handles}, "
          f"stand-in workers {workers})")
    for k in libs:
        print(f"\n{k}: {libs[k]}")
        print(f"{'call':24s} {'stand-in ns':>12s} {'added ns':>10s}  runs")
        for n in names:
            runs_s = " ".join(f"{x:.1f}" for x in result[k]["added_ns_all_runs"][n])
            print(f"{n:24s} {result[k]['direct_ns'][n]:12.1f} {result[k]['added_ns'][n]:10.1f}  [{runs_s}]")
    if args.baseline:
        print(f"\n{'call':24s} {'shim':>8s} {'baseline':>9s} {'diff':>7s}")
        for n in names:
            a, b = result["shim"]["added_ns"][n], result["baseline"]["added_ns"][n]
            print(f"{n:24s} {a:8.1f} {b:9.1f} {a - b:+7.1f}")
    print()
    for n, target in TARGET_NS.items():
        if n in result["shim"]["added_ns"]:
            verdict = "OK" if result["shim"]["added_ns"][n] <= target else "ABOVE"
            print(f"target <= {target:.0f} ns added for {n}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
