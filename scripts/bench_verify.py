#!/usr/bin/env python3
"""What the replicas' state checks cost (jitckpt/verify/fingerprint.py, jitckpt/verify/verifier.py).

1. Fingerprint throughput, in this process on the CPU: the state fingerprint of ``--fp-mib`` MiB held
   as one tensor and as 1 MiB tensors, and of the demo LM's parameters and AdamW state (many small
   tensors: the per-tensor cost). Median of ``--repeats``; reported as seconds per GiB and GB/s.
2. Step-time overhead in a real job: scripts/demo_train.py (``--nproc`` ranks, gloo, CPU) under jitrun
   with ``--jit-verify-every N`` for every N in ``--intervals`` and 0 (no periodic checks, the baseline;
   the one check at the start runs in every run), EC snapshots off, all in this session and interleaved
   in rounds (the order rotates and reverses from round to round, so a drift of the machine's load
   favours no interval). Per run, as scripts/bench_overhead.py measures it: the mean step time after
   ``--warmup``, the median step interval, and CPU seconds per step of the whole process tree. Each
   round gives the ratio checks/baseline of every metric; the table shows their median (min-max).
   A check costs the fingerprint, one exchange through the store and, when it passed, the save_fn into
   tmpfs (the state a rollback goes back to): that is paid once per N minibatches. The ratios between
   runs drift with the machine by more than the small overheads; so each run with N >= 2 also measures
   its checks itself (``in_run_cost``: the step intervals holding a check against the run's others),
   and the table gives that cost over N steps.

Results go to build/bench/verify.json (--out). The machine is shared: read the wall-clock ratios
together with their spread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

METRICS = ("step_s", "step_median_s", "cpu_per_step_s")


# -- 1. fingerprint throughput ------------------------------------------------------------------------------


def _time_fp(items: list, repeats: int) -> float:
    from jitckpt.verify.fingerprint import compute

    compute(items)  # first call: the weight vector is made once per device
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compute(items)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def demo_state(train_args: list[str]) -> list:
    """The demo LM's state items as a rank holds them after a step (parameters, buffers, AdamW)."""
    import torch
    from demo_train import TinyLM

    from jitckpt.verify.fingerprint import state_items

    ap = argparse.ArgumentParser()
    for flag, default in (("--vocab", 256), ("--d-model", 64), ("--layers", 2), ("--seq", 32)):
        ap.add_argument(flag, type=int, default=default)
    a, _ = ap.parse_known_args(train_args)
    model = TinyLM(a.vocab, a.d_model, a.layers, 4, a.seq, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model(torch.zeros(1, a.seq, dtype=torch.long)).sum().backward()
    opt.step()
    return state_items([model], [opt])


def bench_fingerprint(mib: int, repeats: int, train_args: list[str]) -> dict:
    import torch

    torch.set_num_threads(1)  # one core, like one rank of the job
    g = torch.Generator().manual_seed(0)
    one = [("x", torch.randn(mib << 18, generator=g))]
    many = [(f"x{i}", t) for i, t in enumerate(one[0][1].split(1 << 18))]
    demo = demo_state(train_args)
    nbytes_demo = sum(v.numel() * v.element_size() for _, v in demo if isinstance(v, torch.Tensor))
    out = {}
    for name, items, nbytes in (("one_tensor", one, mib << 20), ("1mib_tensors", many, mib << 20),
                                ("demo_state", demo, nbytes_demo)):
        s = _time_fp(items, repeats)
        out[name] = {"bytes": nbytes, "tensors": len(items), "seconds": s, "s_per_gib": s * (1 << 30) / nbytes,
                     "gb_per_s": nbytes / s / 1e9}
    return out


# -- 2. step-time overhead in a real job --------------------------------------------------------------------


def _run(every: int, a: argparse.Namespace, work: Path, n: int) -> dict:
    """One jitrun of the demo with --jit-verify-every ``every``: steady-state step metrics."""
    import bench_overhead as bo

    jit_dir = work / f"jit-{n}"
    cmd = [sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", str(a.nproc),
           "--jit-dir", str(jit_dir), "--jit-ec-every", "0", "--jit-verify-every", str(every),
           bo.TRAIN, "--steps", str(a.steps), "--log-every", "1", *a.train_args.split()]
    cpu: dict[int, float] = {}

    def on_line(_t: float, line: str, pid: int) -> None:
        m = bo.STEP_RE.match(line)
        if m and int(m.group(1)) in (a.warmup, a.steps - 1):
            cpu[int(m.group(1))] = bo.tree_cpu_s(pid)

    log = bo.run_timestamped(cmd, timeout_s=a.timeout, cwd=str(work), on_line=on_line)
    shutil.rmtree(jit_dir, ignore_errors=True)
    if log.timed_out or log.returncode != 0 or len(cpu) != 2:
        tail = "\n".join(line for _, line in log.lines[-30:])
        raise RuntimeError(f"--jit-verify-every {every}: run failed (rc={log.returncode}, "
                           f"timed_out={log.timed_out}):\n{tail}")
    seen = bo.step_times(log.lines)
    return {"every": every, "step_s": bo.steady_step_s(seen, a.warmup),
            "step_median_s": bo.median_step_s(seen, a.warmup),
            "cpu_per_step_s": (cpu[a.steps - 1] - cpu[a.warmup]) / (a.steps - 1 - a.warmup),
            "checks": len([s for s in range(1, a.steps) if every and s % every == 0]),
            **in_run_cost(seen, every, a.warmup)}


def in_run_cost(seen: list[tuple[int, float]], every: int, warmup: int) -> dict:
    """The checks' cost measured inside one run: a check runs at the start of the minibatch
    after every ``every``-th optimizer step, i.e. between rank 0's lines for steps s-1 and s
    with s % every == 0 (demo_train counts steps from 0). Its cost is how much longer those
    intervals are than the run's other intervals (medians), and the overhead that cost over
    ``every`` steps. Paired within the run, so the machine's drift between runs cancels;
    it needs intervals without a check (every >= 2)."""
    if every < 2:
        return {}
    t = dict(seen)
    iv = {s: t[s] - t[s - 1] for s in t if s - 1 in t and s - 1 >= warmup}
    with_check = [v for s, v in iv.items() if s % every == 0]
    plain = [v for s, v in iv.items() if s % every]
    if not with_check or not plain:
        return {}
    extra = statistics.median(with_check) - statistics.median(plain)
    return {"check_extra_s": extra, "in_run_overhead_pct": 100 * extra / (every * statistics.median(plain))}


def bench_overhead(intervals: list[int], a: argparse.Namespace, say: Callable[..., None]) -> dict:
    work = Path(tempfile.mkdtemp(prefix="jitckpt-bench-verify-"))
    runs: dict[int, list[dict]] = {n: [] for n in intervals}
    try:
        for r in range(a.rounds):
            k = r % len(intervals)
            order = intervals[k:] + intervals[:k]
            if r % 2:
                order = order[::-1]
            for i, n in enumerate(order):
                res = _run(n, a, work, r * len(intervals) + i)
                runs[n].append(res)
                say(f"  round {r + 1}/{a.rounds}  --jit-verify-every {n:<4} mean step {res['step_s'] * 1e3:7.2f} ms"
                    f"  median {res['step_median_s'] * 1e3:7.2f} ms  CPU/step {res['cpu_per_step_s'] * 1e3:7.2f} ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out: dict = {"intervals": {}, "baseline_runs": runs[0],
                 "baseline": {m: statistics.median(x[m] for x in runs[0]) for m in METRICS}}
    for n in intervals:
        if n == 0:
            continue
        row: dict = {"runs": runs[n]}
        for metric in METRICS:
            ratios = [x[metric] / b[metric] for x, b in zip(runs[n], runs[0], strict=True)]
            row[metric] = {"ratios": ratios, "median": statistics.median(ratios), "min": min(ratios),
                           "max": max(ratios), "overhead_pct": (statistics.median(ratios) - 1) * 100}
        extra = [x["check_extra_s"] for x in runs[n] if "check_extra_s" in x]
        if extra:
            pct = [x["in_run_overhead_pct"] for x in runs[n]]
            row["in_run"] = {"check_extra_s": statistics.median(extra), "overhead_pct": statistics.median(pct),
                             "min_pct": min(pct), "max_pct": max(pct)}
        out["intervals"][str(n)] = row
    return out


def _print(res: dict, target_pct: float) -> None:
    fp = res["fingerprint"]
    print("\nfingerprint, one core (median):")
    for name, r in fp.items():
        print(f"  {name:<13} {r['bytes'] / 2**20:9.2f} MiB in {r['tensors']:5d} tensors: {r['seconds'] * 1e3:8.2f} ms"
              f"  = {r['s_per_gib']:.3f} s/GiB ({r['gb_per_s']:.2f} GB/s)")
    ov = res.get("overhead")
    if not ov:
        return
    b = ov["baseline"]
    print(f"\nstep time without periodic checks: mean {b['step_s'] * 1e3:.2f} ms, median "
          f"{b['step_median_s'] * 1e3:.2f} ms, CPU {b['cpu_per_step_s'] * 1e3:.2f} ms/step")
    print("overhead vs no checks, median ratio of interleaved runs (min-max):")
    for n, row in ov["intervals"].items():
        cells = [f"{m} {row[m]['median']:.4f} ({row[m]['min']:.3f}-{row[m]['max']:.3f})" for m in METRICS]
        # no verdict here: between runs the machine drifts by more than the target (see in_run_cost)
        print(f"  N={n:<4} " + "  ".join(cells) + f"  -> {row['step_s']['overhead_pct']:+.2f} %")
    print("the checks' cost inside each run (interval holding a check minus the others, medians), over N steps:")
    for n, row in ov["intervals"].items():
        r = row.get("in_run")
        if r:
            ok = "ok" if r["overhead_pct"] <= target_pct else "over"
            print(f"  N={n:<4} {r['check_extra_s'] * 1e3:7.2f} ms per check -> {r['overhead_pct']:+.3f} % "
                  f"(runs {r['min_pct']:+.3f} to {r['max_pct']:+.3f} %; {ok} for <= {target_pct} %)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp-mib", type=int, default=256, help="MiB fingerprinted for the throughput (default 256)")
    ap.add_argument("--repeats", type=int, default=5, help="timed fingerprints per case, median kept (default 5)")
    ap.add_argument("--no-overhead", action="store_true", help="only the fingerprint throughput")
    ap.add_argument("--intervals", default="1,10,100", help="--jit-verify-every values; 0 is always run")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds over all intervals (default 4)")
    ap.add_argument("--steps", type=int, default=320, help="training steps per run (default 320)")
    ap.add_argument("--warmup", type=int, default=20, help="first steps left out of the means (default 20)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--train-args", default="", help="extra demo_train.py arguments")
    ap.add_argument("--target-pct", type=float, default=0.5, help="overhead target in percent (default 0.5)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is killed")
    ap.add_argument("--out", default=str(ROOT / "build" / "bench" / "verify.json"))
    a = ap.parse_args(argv)
    try:
        intervals = sorted({0, *(int(x) for x in a.intervals.split(",") if x.strip())})
    except ValueError:
        ap.error(f"--intervals {a.intervals!r}: expected comma-separated integers")
    if intervals[0] < 0 or a.rounds < 1 or a.steps < a.warmup + 10 or a.fp_mib < 1 or a.repeats < 1:
        ap.error("--intervals >= 0, --rounds >= 1, --steps >= --warmup + 10, --fp-mib and --repeats >= 1")
    load = os.getloadavg()
    print(f"bench_verify: load average {load[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    res: dict = {"fingerprint": bench_fingerprint(a.fp_mib, a.repeats, a.train_args.split()),
                 "loadavg_start": load, "cpus": os.cpu_count()}
    if not a.no_overhead:
        print(f"step-time overhead: demo LM {a.train_args or '(defaults)'}, {a.nproc} ranks (gloo, CPU), "
              f"{a.steps} steps/run after step {a.warmup}, {a.rounds} rounds", flush=True)
        res["overhead"] = bench_overhead(intervals, a, lambda *x: print(*x, flush=True))
        res.update({"steps": a.steps, "warmup": a.warmup, "rounds": a.rounds, "nproc": a.nproc,
                    "train_args": a.train_args.split()})
    res["loadavg_end"] = os.getloadavg()
    _print(res, a.target_pct)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
