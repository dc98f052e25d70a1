"""Stress the restart path: many jitrun jobs, each restarted many times, with
a fault in every phase and at exit, warm (forked) workers by default.

Each job trains ``scripts/demo_train.py`` with 2 ranks and one injected fault
per attempt (attempt a fails at minibatch a+1, so every attempt makes
progress): the phase cycles through forward, backward, all-reduce and
optimizer, the kind through kill / exception / exit / segfault / abort /
SIGTERM / SIGINT with a stopped and a GIL-holding hung rank now and then; the
last attempt's fault fires as the process ends, after the script returned.
Every job must end with exit 0 within its time limit (a hang is a failure),
bit-identical to one failure-free plain-torchrun run, with at most one
minibatch redone per recovery.

    python scripts/stress_warm.py --jobs 10 --restarts 30     # 300 restarts
    python scripts/stress_warm.py --jobs 1 --restarts 8       # what CI runs

Prints one line per job and a summary; exit status 0 only when every job
passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "demo_train.py"
sys.path.insert(0, str(HERE))

PHASES = ["forward", "backward", "allreduce", "optimizer"]
QUICK_KINDS = ["sigkill", "exception", "exit", "sigsegv", "abort", "sigterm", "sigint"]
SLOW_KINDS = ["sigstop", "hang"]  # each costs the detection timeout
ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}


def schedule(restarts: int, offset: int = 0) -> str:
    """One fault per attempt; attempt a fails at minibatch a + 1 (a resumed
    job is at most there), the last one at exit."""
    specs = []
    for a in range(restarts):
        i = a + offset
        rank = i % 2
        if a == restarts - 1:
            specs.append(f"rank={rank},phase=exit,kind={QUICK_KINDS[i % len(QUICK_KINDS)]},attempt={a}")
            continue
        kind = SLOW_KINDS[(i // 10) % 2] if i % 10 == 9 else QUICK_KINDS[i % len(QUICK_KINDS)]
        specs.append(f"rank={rank},step={a + 1},phase={PHASES[i % len(PHASES)]},kind={kind},attempt={a}")
    return ";".join(specs)


def run(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """Run in a session of its own; on timeout kill exactly that session."""
    # SIGINT back to default: a shell's background job inherits it ignored,
    # which would turn the kind=sigint faults into no-ops
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **ENV, **env}, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--restarts", type=int, default=30, help="restarts per job (one fault per attempt)")
    ap.add_argument("--warm", choices=("on", "off"), default="on")
    ap.add_argument("--timeout", type=float, default=2.0, help="--jit-timeout of each job")
    ap.add_argument("--job-time-limit", type=float, default=None,
                    help="seconds after which a job counts as hung (default: 20 + 8 s per restart)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    from compare_state import diff_states

    steps = args.restarts + 3
    limit = args.job_time_limit or 20 + 8.0 * args.restarts
    work = Path(tempfile.mkdtemp(prefix="jitckpt-stress-"))
    py = sys.executable
    failures = 0
    total_restarts = 0
    t_all = time.time()
    try:
        ref = work / "reference.pt"
        code, out = run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         str(TRAIN), "--steps", str(steps), "--out", str(ref)], {}, 300)
        if code != 0:
            print(f"reference run failed ({code}):\n{out[-3000:]}")
            return 2
        for j in range(args.jobs):
            d = work / f"job{j}"
            fault = schedule(args.restarts, offset=j)
            t0 = time.time()
            code, out = run([py, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", str(args.restarts + 2), "--jit-timeout", str(args.timeout),
                             "--jit-warm-start", args.warm, "--jit-dir", str(d / "jit"),
                             str(TRAIN), "--steps", str(steps), "--out", str(d / "final.pt")],
                            {"JITCKPT_FAULT": fault}, limit)
            events = []
            ev_path = d / "jit" / "events.jsonl"
            if ev_path.exists():
                events = [json.loads(line) for line in ev_path.read_text().splitlines()]
            restarts = sum(e["event"] == "restart" for e in events)
            redone = [e["redone_minibatches"] for e in events if e["event"] == "recovery"]
            problems = []
            if code is None:
                problems.append(f"HUNG (killed after {limit:.0f}s)")
            elif code != 0:
                problems.append(f"exit {code}")
            if code == 0:
                n, diffs = diff_states(str(ref), str(d / "final.pt"))
                if diffs or n < 10:
                    problems.append(f"state differs: {diffs[:3]}")
            if restarts < args.restarts - 1:  # the exit-phase fault ends the job without a restart
                problems.append(f"only {restarts} restarts")
            if any(r is None or r > 1 for r in redone):
                problems.append(f"redone minibatches {redone}")
            total_restarts += restarts
            status = "ok" if not problems else "FAIL " + "; ".join(problems)
            print(f"job {j}: {restarts} restarts in {time.time() - t0:.1f}s, redone max "
                  f"{max((r or 0) for r in redone) if redone else '-'}: {status}", flush=True)
            if problems:
                failures += 1
                (work / f"job{j}.log").write_text(out)
                print(f"  log: {work / f'job{j}.log'}\n  JITCKPT_FAULT={fault}", flush=True)
        print(f"\n{args.jobs} jobs, {total_restarts} restarts (warm start {args.warm}) in "
              f"{time.time() - t_all:.0f}s: {failures} failed", flush=True)
        return 1 if failures else 0
    finally:
        if not args.keep and not failures:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
