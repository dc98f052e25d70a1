"""Where jitrun's steady-state cost goes: the demo LM under plain torchrun and
under jitrun with each recovery feature switched off in turn, interleaved.

    python scripts/bench_attribution.py [--rounds 5] [--steps 1000] [--train-args "..."]

Each round runs torchrun once and every jitrun variant once, in an order
rotated from round to round (a slow drift of the machine's load then favours
no variant), and each variant's per-step figures are divided by the same
round's torchrun run. Variants:

* ``jitrun``: every default on (EC snapshots every 100 minibatches, replica
  checks every 200, the learned hang bound with its status record, warm start);
* ``no-ec`` (``--jit-ec-every 0``), ``no-verify`` (``--jit-verify-every 0``),
  ``fixed-timeout`` (``--jit-timeout fixed:120``: no status record, no hang
  watch), ``no-warm`` (``--jit-warm-start off``): one feature off each;
* ``all-off``: all four off: what the hooks and the agent cost alone.

A feature's cost is ``jitrun`` minus its variant, in microseconds per step
and in percent of torchrun's step. Two step lengths tell a fixed
per-minibatch cost from a proportional one: the default demo model (tens of
ms per step on 2 cores) and a smaller one (``--train-args "--d-model 32
--layers 1 --batch 4"``). The figures are wall time per step after the
warm-up (mean and median, as bench_overhead.py measures them) and CPU
seconds per step of the whole process tree. Run it on a quiet machine: the
spread between rounds is printed, and a difference below it is noise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import (  # noqa: E402
    METRICS,
    STEP_RE,
    TRAIN,
    median_step_s,
    run_timestamped,
    steady_step_s,
    step_times,
    tree_cpu_s,
)

VARIANTS: dict[str, list[str]] = {
    "jitrun": [],
    "no-ec": ["--jit-ec-every", "0"],
    "no-verify": ["--jit-verify-every", "0"],
    "fixed-timeout": ["--jit-timeout", "fixed:120"],
    "no-warm": ["--jit-warm-start", "off"],
    "all-off": ["--jit-ec-every", "0", "--jit-verify-every", "0", "--jit-timeout", "fixed:120",
                "--jit-warm-start", "off"],
}


def command(variant: str, steps: int, jit_dir: Path, train_args: list[str]) -> list[str]:
    train = [TRAIN, "--steps", str(steps), "--log-every", "1", *train_args]
    if variant == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *train]
    return [sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--jit-dir", str(jit_dir),
            *VARIANTS[variant], *train]


def run(variant: str, steps: int, warmup: int, workdir: Path, n: int, train_args: list[str],
        timeout_s: float) -> dict:
    jit_dir = workdir / f"jit-{n}"
    shutil.rmtree(jit_dir, ignore_errors=True)  # a reused jit dir would resume
    cpu: dict[int, float] = {}

    def on_line(t: float, line: str, pid: int) -> None:
        m = STEP_RE.match(line)
        if m and int(m.group(1)) in (warmup, steps - 1):
            cpu[int(m.group(1))] = tree_cpu_s(pid)

    log = run_timestamped(command(variant, steps, jit_dir, train_args), timeout_s=timeout_s, cwd=str(workdir),
                          on_line=on_line)
    if log.timed_out or log.returncode != 0 or len(cpu) != 2:
        tail = "\n".join(line for _, line in log.lines[-30:])
        raise RuntimeError(f"{variant} run failed (rc={log.returncode}, timed_out={log.timed_out}):\n{tail}")
    seen = step_times(log.lines)
    return {"step_s": steady_step_s(seen, warmup), "step_median_s": median_step_s(seen, warmup),
            "cpu_per_step_s": (cpu[steps - 1] - cpu[warmup]) / (steps - 1 - warmup)}


def summarize(rounds: list[dict]) -> dict:
    """Per variant and metric: the ratio to the same round's torchrun (median, min, max) and the
    added microseconds per step (median)."""
    out: dict = {}
    for v in VARIANTS:
        out[v] = {}
        for m in METRICS:
            ratios = [r[v][m] / r["torchrun"][m] for r in rounds]
            added = [(r[v][m] - r["torchrun"][m]) * 1e6 for r in rounds]
            out[v][m] = {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios), "added_us_median": statistics.median(added)}
    return out


def table(s: dict, base_ms: float) -> list[str]:
    lines = [f"torchrun median step: {base_ms:.2f} ms",
             f"{'variant':<14} {'mean-step ratio (min..max)':>30} {'median-step ratio':>18} {'CPU ratio':>10} "
             f"{'added us/step':>14}"]
    for v, d in s.items():
        a, b, c = d["step_s"], d["step_median_s"], d["cpu_per_step_s"]
        lines.append(f"{v:<14} {a['ratio_median']:>10.4f} ({a['ratio_min']:.4f}..{a['ratio_max']:.4f}) "
                     f"{b['ratio_median']:>18.4f} {c['ratio_median']:>10.4f} {b['added_us_median']:>14.0f}")
    full = s["jitrun"]["step_median_s"]["added_us_median"]
    costs = {v.removeprefix("no-"): full - s[v]["step_median_s"]["added_us_median"]
             for v in VARIANTS if v not in ("jitrun", "all-off")}
    lines.append("cost of each feature (jitrun minus the variant without it, median step, us): "
                 + ", ".join(f"{k} {c:.0f}" for k, c in costs.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of torchrun + every variant (default 5)")
    ap.add_argument("--steps", type=int, default=1000, help="training steps per run (default 1000)")
    ap.add_argument("--warmup", type=int, default=50, help="first steps left out (default 50)")
    ap.add_argument("--train-args", default="", help="extra demo_train.py arguments (the model's size)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    if args.steps < args.warmup + 10:
        ap.error("--steps must be at least --warmup + 10")
    train_args = shlex.split(args.train_args)
    names = ["torchrun", *VARIANTS]
    workdir = Path(tempfile.mkdtemp(prefix="jitckpt-bench-attr-"))
    rounds: list[dict] = []
    try:
        for i in range(args.rounds):
            order = names[i % len(names):] + names[:i % len(names)]
            rounds.append({v: run(v, args.steps, args.warmup, workdir, i * len(names) + j, train_args, args.timeout)
                           for j, v in enumerate(order)})
            if not args.json:
                print(f"round {i}: " + "  ".join(f"{v} {rounds[-1][v]['step_median_s'] * 1e3:.2f}ms" for v in order),
                      flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    s = summarize(rounds)
    base = statistics.median(r["torchrun"]["step_median_s"] for r in rounds) * 1e3
    if args.json:
        print(json.dumps({"summary": s, "rounds": rounds, "torchrun_median_ms": base}, indent=2))
    else:
        print("\n".join(table(s, base)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
