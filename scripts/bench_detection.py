"""How long a hang costs: fault -> detection and fault -> resumed, with the
learned hang bound (no --jit-timeout) next to the fixed default
(--jit-timeout fixed:120, the old rule), in the same run.

    python scripts/bench_detection.py [--repeats 5] [--fixed-repeats 1] [--minibatch 0.1,1]
                                      [--faults sigstop,hang,lose] [--json FILE] [--skip-fixed]
    python scripts/bench_detection.py --soak MINUTES     # the no-false-alarm soak (README, docs/hangs.md)

Each run: jitrun, 2 ranks, scripts/demo_train.py with --step-sleep MB, rank 1
(both ranks for ``lose``) faulted in the forward of step F. ``sigstop``: the
rank stops; ``hang``: it blocks holding the GIL; ``lose``: every rank waits in
a collective nobody completes (jitckpt/faults.py). Times from events.jsonl,
one clock: fault = ``fault_injected``; detection = ``hang_detected`` (learned)
or the first ``failure_detected`` (fixed: gloo's timeout raised); resumed =
the recovery record's failure_to_resumed_s. Each run's final state is
compared bit for bit with a failure-free plain-torchrun run, and the
minibatches redone are the recovery record's. Medians over the repeats.

``--soak MINUTES``: one long failure-free run under jitrun, no --jit-timeout,
with everything the false-alarm tests scale down mixed (+-50 % jitter, a 5x
straggler, a rank-0 evaluation every 200 minibatches, a rank-0 user save, a
slow first minibatch, a data-loader stall): it must end with zero
recoveries, bit-identical; the stretches the timeline recorded are counted.

Runs one after the other (the machine has 2 cores). Prints a table; nothing
is asserted here (timings are noisy: tests never assert them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "scripts" / "demo_train.py")
sys.path.insert(0, str(ROOT / "scripts"))


def _events(jit: Path) -> list[dict]:
    p = jit / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _run(cmd: list[str], env: dict, timeout: float, cwd: Path) -> tuple[int, str]:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                         env={**os.environ, **env}, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, _ = p.communicate()
        return -9, out
    return p.returncode, out


def _train(steps: int, mb: float, out: Path, extra: list[str] = ()) -> list[str]:
    return [TRAIN, "--steps", str(steps), "--step-sleep", str(mb), "--out", str(out), *extra]


def reference(work: Path, steps: int, mb: float) -> Path:
    out = work / f"ref-{steps}-{mb}.pt"
    if not out.exists():
        code, text = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *_train(steps, 0.0, out)], {}, 600, work)
        if code != 0:
            raise SystemExit(f"reference run failed ({code}):\n{text[-3000:]}")
    return out


def one(work: Path, name: str, *, fault: str, mb: float, fixed: bool, steps: int, ref: Path) -> dict:
    from compare_state import diff_states

    d = work / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    out, jit = d / "final.pt", d / "jit"
    step = steps // 2
    ranks = (0, 1) if fault == "lose" else (1,)
    spec = ";".join(f"rank={r},step={step},phase=forward,kind={fault}" for r in ranks)
    cmd = [sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
           "--jit-dir", str(jit), *(["--jit-timeout", "fixed:120"] if fixed else []), *_train(steps, mb, out)]
    t0 = time.time()
    code, text = _run(cmd, {"JITCKPT_FAULT": spec}, 900, d)
    evs = _events(jit)
    fault_t = min((e["t"] for e in evs if e["event"] == "fault_injected"), default=None)
    det = [e["t"] for e in evs if e["event"] == ("hang_detected" if not fixed else "failure_detected")]
    rec = next((e for e in evs if e["event"] == "recovery"), {})
    same = out.exists() and not diff_states(str(ref), str(out))[1]
    hd = next((e for e in evs if e["event"] == "hang_detected"), {})
    return {"name": name, "fault": fault, "minibatch_s": mb, "mode": "fixed:120" if fixed else "learned",
            "exit": code, "wall_s": round(time.time() - t0, 2),
            "detect_s": round(min(det) - fault_t, 3) if det and fault_t else None,
            "resumed_s": rec.get("failure_to_resumed_s"), "redone": rec.get("redone_minibatches"),
            "bound_s": hd.get("bound_s"), "identical": same}


def _med(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(xs), 3) if xs else None


def table(rows: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["fault"], r["minibatch_s"], r["mode"]), []).append(r)
    lines = [f"{'fault':8} {'minibatch':>9} {'mode':>10} {'n':>2} {'detect s':>9} {'resumed s':>10} "
             f"{'bound s':>8} {'redone':>6} {'identical':>9} {'exit codes':>10}"]
    for (fault, mb, mode), rs in sorted(groups.items()):
        lines.append(f"{fault:8} {mb:>9g} {mode:>10} {len(rs):>2} {_med(rs, 'detect_s')!s:>9} "
                     f"{_med(rs, 'resumed_s')!s:>10} {_med(rs, 'bound_s')!s:>8} "
                     f"{max((r['redone'] or 0) for r in rs):>6} {all(r['identical'] for r in rs)!s:>9} "
                     f"{','.join(sorted({str(r['exit']) for r in rs})):>10}")
    for fault, mb in sorted({(f, m) for f, m, _ in groups}):
        a, b = groups.get((fault, mb, "learned")), groups.get((fault, mb, "fixed:120"))
        if a and b and _med(a, "resumed_s") and _med(b, "resumed_s"):
            lines.append(f"{fault} at {mb:g} s minibatches: fault -> resumed {_med(b, 'resumed_s')} s fixed vs "
                         f"{_med(a, 'resumed_s')} s learned ({_med(b, 'resumed_s') / _med(a, 'resumed_s'):.0f}x)")
    return "\n".join(lines)


def soak(work: Path, minutes: float) -> int:
    """One long failure-free run with every false-alarm case mixed."""
    mb = 0.1
    # the 5x straggler sets the pace (5 x mb a minibatch), plus a 30 s evaluation every 200, plus 40 s once
    steps = int((minutes * 60 - 40) / (5 * mb + 30 / 200))
    out, jit = work / "soak.pt", work / "soak-jit"
    mix = ["--jitter", "0.5", "--straggle", "1=5", "--delay", "rank=0,every=200,seconds=30,kind=eval",
           "--delay", f"rank=0,step={steps // 3},seconds=20,kind=save", "--delay", "rank=1,seconds=10,kind=compile",
           "--delay", f"rank=1,step={steps // 2},seconds=10,kind=loader"]
    ref = reference(work, steps, mb)
    t0 = time.time()
    code, text = _run([sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2",
                       "--max-restarts", "3", "--jit-dir", str(jit), *_train(steps, mb, out, mix)], {},
                      minutes * 60 * 3 + 600, work)
    from compare_state import diff_states

    evs = _events(jit)
    count = {k: sum(e["event"] == k for e in evs) for k in ("hang_detected", "hang_bound_stretched", "recovery")}
    same = out.exists() and not diff_states(str(ref), str(out))[1]
    print(f"soak: {steps} minibatches in {(time.time() - t0) / 60:.1f} min, exit {code}, {count}, "
          f"bit-identical {same}")
    print("\n".join(line for line in text.splitlines() if "hang bound learned" in line))
    return 0 if code == 0 and same and not count["recovery"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fixed-repeats", type=int, default=1, help="runs of the fixed default (each ~2.5 min)")
    ap.add_argument("--minibatch", default="0.1,1", help="seconds per minibatch, comma-separated")
    ap.add_argument("--faults", default="sigstop,hang,lose")
    ap.add_argument("--skip-fixed", action="store_true")
    ap.add_argument("--soak", type=float, default=None, metavar="MINUTES")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-detection-"))
    try:
        if args.soak:
            return soak(work, args.soak)
        rows = []
        for mb in (float(x) for x in args.minibatch.split(",")):
            steps = 40 if mb < 0.5 else 16
            ref = reference(work, steps, mb)
            for fault in args.faults.split(","):
                plan = [(False, i) for i in range(args.repeats)]
                plan += [] if args.skip_fixed else [(True, i) for i in range(args.fixed_repeats)]
                for fixed, i in plan:
                    r = one(work, f"{fault}-{mb}-{'fixed' if fixed else 'learned'}-{i}", fault=fault, mb=mb,
                            fixed=fixed, steps=steps, ref=ref)
                    print(json.dumps(r), flush=True)
                    rows.append(r)
        print(table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
