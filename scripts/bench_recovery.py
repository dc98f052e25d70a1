"""Recovery from one failure: periodic checkpoints under plain torchrun vs jitrun.

    python scripts/bench_recovery.py [--steps 120] [--seed 0] [--intervals 10,30,60]
                                     [--repeats 2] [--plot FILE] [--json FILE] [--publish] [--quick]
    python scripts/bench_recovery.py --multinode [bench_multinode.py's options]

``--multinode`` runs the multi-node cases instead (scripts/bench_multinode.py,
also runnable alone): a killed rank, a lost node with a hot spare, a lost node
with a late replacement, jitrun vs torchrun + periodic checkpoints, nodes as
network namespaces (needs root); raw numbers in build/bench/multinode.json.

Outputs go to build/bench/ (untracked): the plot recovery.png, and the raw
measurements recovery.json. ``--publish`` writes them to bench_results/
instead, the published copy that bench_results/RESULTS.md describes.

One rank (rank 1) is SIGKILLed in the backward pass of step F, F drawn from
``--seed`` and the same for every configuration. Runs, one after the other
(never two at once: the machine has 2 cores):

* ref:      plain torchrun, no failure, no checkpoints: the reference final
            state and the reference duration;
* ckpt-K:   plain torchrun --max-restarts 3 with the demo trainer's periodic
            checkpoint every K steps (``--intervals``); the fault is injected
            with ``-m jitckpt._bootstrap``, which adds no detection;
* jit:      jitrun --jit-timeout 5, same fault (``--repeats`` times);
* jit-stop: jitrun, rank 1 SIGSTOPped instead (a hang, not a crash). Not run
            under plain torchrun: nothing would notice the stopped rank until
            gloo's default 30-minute collective timeout.

Every time comes from the same clock: the output of launcher and workers is
one pipe, read here, and each line is timestamped as it arrives (the trainer
runs with --log-every 1, so rank 0 prints one line per step). For each run:

fault       the failure. jitrun: ``fault_injected`` in events.jsonl. torchrun
            (nothing reports it): the arrival of step F-1's line, i.e. the end
            of the last minibatch before it; the fault comes a forward pass
            later, so this estimate is early by a few ms (the table's footer
            shows its error measured on the jitrun runs).
detect      torchrun: its agent's first line about the dead worker ("closing
            signal" / "failed (exitcode"). jitrun: ``failure_detected``.
ckpt        jitrun: the JIT save (detect -> checkpoint_saved). periodic: not on
            the recovery path but paid all along: saves run x the median cost of
            one save, itself the length of a step with a save minus the median
            step.
restart     end of detect/ckpt -> both ranks printed "resumed from" (state
            loaded; for a restart from scratch: the first step line - 1 step).
redone      "resumed from" -> the line of step F after the restart: the lost
            minibatches done again.
fail->res   fault -> the first step line after the restart: the definition of
            events.jsonl's failure_to_resumed_s (first minibatch done again).
overhead    (last step line - first step line) minus the same for ref: the
            wall-clock cost of the failure and of the checkpoints. The
            components above add up to about one minibatch more, because
            "redone" includes step F, which ref runs once too.
identical   final model+optimizer state equal to ref's bit for bit
            (scripts/compare_state.diff_states).

For the jitrun runs the recovery records of events.jsonl are printed as well.
The machine is shared (2 cores, other people's tests): the step time swings
by tens of percent between runs, which is the noise on ``overhead``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE.parent / "build" / "bench"  # default, untracked
PUBLISHED_DIR = HERE.parent / "bench_results"  # tracked; only with --publish
sys.path.insert(0, str(HERE))
from bench_overhead import RunLog, run_timestamped, step_times  # noqa: E402
from compare_state import diff_states  # noqa: E402

TRAIN = str(HERE / "demo_train.py")
RESUMED_RE = re.compile(r"^\[rank (\d+)\] resumed from .* at step (\d+)")
SAVE_RE = re.compile(r"^\[rank 0\] periodic checkpoint at step (\d+)")
# torchrun's agent noticing the dead worker (torch.distributed.elastic.multiprocessing.api)
AGENT_FAIL_RE = re.compile(r"closing signal SIG|failed \(exitcode: ")


@dataclass
class Result:
    name: str
    kind: str  # ref | periodic | jit
    fault: str | None = None
    fault_step: int | None = None
    interval: int | None = None
    restore_step: int | None = None
    redone_minibatches: int | None = None
    minibatch_s: float | None = None
    span_s: float | None = None  # first -> last step line
    t0: float | None = None  # estimated start of training (first step line - 1 step)
    fault_t: float | None = None
    fault_t_estimate: float | None = None  # the torchrun estimator, also computed for jitrun
    detect_t: float | None = None
    ckpt_end_t: float | None = None
    resume_t: float | None = None
    first_done_t: float | None = None
    caught_up_t: float | None = None
    end_t: float | None = None
    saves: list[float] = field(default_factory=list)  # arrival times of periodic checkpoint lines
    save_s: float | None = None
    wall_s: float | None = None
    identical: bool | None = None
    diffs: list[str] = field(default_factory=list)
    recovery: dict | None = None  # jitrun's events.jsonl record
    spawn_s: float | None = None  # jitrun: restart -> every new worker process started (python + torch import)
    error: str | None = None
    fault_kind: str = "sigkill"
    start: str | None = None  # jitrun: warm | cold workers

    # derived, seconds
    def detect_s(self) -> float | None:
        return _sub(self.detect_t, self.fault_t)

    def ckpt_s(self) -> float | None:
        if self.kind == "periodic":
            return len(self.saves) * (self.save_s or 0.0)
        return _sub(self.ckpt_end_t, self.detect_t)

    def restart_s(self) -> float | None:
        return _sub(self.resume_t, self.ckpt_end_t if self.ckpt_end_t is not None else self.detect_t)

    def redone_s(self) -> float | None:
        return _sub(self.caught_up_t, self.resume_t)

    def fail_to_resumed_s(self) -> float | None:
        return _sub(self.first_done_t, self.fault_t)


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def fault_step(seed: int, steps: int) -> int:
    """The step that fails, the same for every configuration: somewhere in
    the middle, so every interval has saved at least once before it for the
    default intervals and the run goes on a while after it."""
    return random.Random(seed).randint(max(1, steps // 4), max(1, steps - max(2, steps // 12)))


def _steady_minibatch_s(steps: list[tuple[int, float]], saves: list[float], upto: int | None) -> float | None:
    """Median step-to-step interval before the failure, skipping the first
    steps (warm-up) and every interval that holds a periodic save."""
    ivs = []
    save_set = set(saves)
    for (s1, t1), (s2, t2) in pairwise(steps):
        if s2 != s1 + 1 or s1 < 3 or (upto is not None and s2 >= upto):
            continue
        if any(t1 < ts <= t2 for ts in save_set):
            continue
        ivs.append(t2 - t1)
    return statistics.median(ivs) if ivs else None


def _save_cost_s(steps: list[tuple[int, float]], saves: list[float], minibatch_s: float | None) -> float | None:
    """Median extra length of a step that ended with a periodic save."""
    if not saves or minibatch_s is None:
        return None
    extra = []
    for (s1, t1), (s2, t2) in pairwise(steps):
        if s2 == s1 + 1 and s1 >= 3 and any(t1 < ts <= t2 for ts in saves):
            extra.append(max(0.0, (t2 - t1) - minibatch_s))
    return statistics.median(extra) if extra else None


def parse_run(res: Result, log: RunLog, events: list[dict] | None = None) -> Result:
    """Fill the timeline of ``res`` from the timestamped output (and, for
    jitrun, its events). Pure: testable on synthetic logs."""
    lines = log.lines
    steps = step_times(lines)
    if not steps:
        raise ValueError(f"{res.name}: no step lines in the output")
    res.wall_s = log.wall_s
    res.saves = [t for t, line in lines if SAVE_RE.match(line)]
    res.end_t = steps[-1][1]
    res.span_s = steps[-1][1] - steps[0][1]
    F = res.fault_step
    res.minibatch_s = _steady_minibatch_s(steps, res.saves, F)
    res.t0 = steps[0][1] - (res.minibatch_s or 0.0)
    if res.kind == "periodic":
        res.save_s = _save_cost_s(steps, res.saves, res.minibatch_s)
    if F is None:
        return res
    # the lines before the failure: the first occurrence of step F-1 marks its
    # estimated time; the lines after the restart are those after detection
    pre = [t for s, t in steps if s == F - 1]
    res.fault_t_estimate = pre[0] if pre else None
    if events is not None:
        fault = [e["t"] for e in events if e["event"] == "fault_injected"]
        det = [e["t"] for e in events if e["event"] == "failure_detected"]
        saved = [e["t"] for e in events if e["event"] == "checkpoint_saved"]
        res.fault_t = min(fault) if fault else res.fault_t_estimate
        res.detect_t = min(det) if det else None
        res.ckpt_end_t = max(saved) if saved else res.detect_t
        rec = [e for e in events if e["event"] == "recovery"]
        res.recovery = rec[0] if rec else None
        restart = [e["t"] for e in events if e["event"] == "restart"]
        if restart:
            started = [e["t"] for e in events if e["event"] == "started" and e["t"] > restart[0]]
            res.spawn_s = max(started) - restart[0] if started else None
    else:
        res.fault_t = res.fault_t_estimate
        agent = [t for t, line in lines if AGENT_FAIL_RE.search(line) and res.fault_t is not None and t >= res.fault_t]
        res.detect_t = agent[0] if agent else None
    if res.detect_t is not None:
        after = [(s, t) for s, t in steps if t > res.detect_t]
    else:
        # no detection seen: fall back to where the step index goes back
        i = next((i for i in range(1, len(steps)) if steps[i][0] <= steps[i - 1][0]), len(steps))
        after = steps[i:]
    if not after:
        return res
    restart_from = after[0][0]
    resumed = [(t, int(m.group(1)), int(m.group(2))) for t, line in lines
               if (m := RESUMED_RE.match(line)) and res.fault_t is not None and t >= res.fault_t]
    if resumed:
        res.restore_step = resumed[0][2]
        res.resume_t = max(t for t, _, _ in resumed[:2])
    else:
        # restarted from scratch: nothing says when the state was ready
        res.restore_step = restart_from
        res.resume_t = after[0][1] - (res.minibatch_s or 0.0)
    res.redone_minibatches = max(F + 1 - res.restore_step, 0)
    res.first_done_t = after[0][1]
    caught = [t for s, t in after if s == F]
    res.caught_up_t = caught[0] if caught else None
    return res


def _events(jit_dir: Path) -> list[dict]:
    p = jit_dir / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def run_config(name: str, kind: str, args, work: Path, F: int | None, fault_kind: str = "sigkill",
               interval: int | None = None, echo: bool = False, start: str = "warm") -> Result:
    py = sys.executable
    d = work / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    out = d / "final.pt"
    train = [TRAIN, "--steps", str(args.steps), "--step-sleep", str(args.step_sleep),
             "--log-every", "1", "--out", str(out)]
    env = {}
    fault = None
    if F is not None:
        fault = f"rank=1,step={F},phase=backward,kind={fault_kind}"
        env["JITCKPT_FAULT"] = fault
    if kind == "jit":
        cmd = [py, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
               "--jit-timeout", str(args.jit_timeout), "--jit-dir", str(d / "jit"),
               "--jit-warm-start", "on" if start == "warm" else "off", *train]
    elif kind == "periodic":
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
               "-m", "jitckpt._bootstrap", *train, "--ckpt-every", str(interval), "--ckpt-dir", str(d / "ckpt")]
    else:
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *train]
    res = Result(name=name, kind=kind, fault=fault, fault_step=F, interval=interval, fault_kind=fault_kind,
                 start=start if kind == "jit" else None)
    log = run_timestamped(cmd, env=env, timeout_s=args.timeout, cwd=str(d), echo=echo)
    save_log(d, res, log, {"steps": args.steps, "step_sleep": args.step_sleep, "seed": args.seed})
    return analyse(d, res, log)


def print_log_tail(path: Path, lines: int = 60) -> None:
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        print(f"    (no output log: {e})", flush=True)
        return
    print(f"    last {len(tail)} lines of {path}:", flush=True)
    for line in tail:
        print(f"    | {line.partition(' ')[2]}", flush=True)


def save_log(d: Path, res: Result, log: RunLog, run_args: dict) -> None:
    """What --reparse needs to analyse the run again."""
    (d / "output.log").write_text("".join(f"{t:.6f} {line}\n" for t, line in log.lines))
    (d / "meta.json").write_text(json.dumps({
        "name": res.name, "kind": res.kind, "fault": res.fault, "fault_step": res.fault_step,
        "fault_kind": res.fault_kind, "start": res.start,
        "interval": res.interval, "returncode": log.returncode, "timed_out": log.timed_out,
        "t_start": log.t_start, "t_end": log.t_end, "args": run_args}))


def load_run(d: Path) -> tuple[Result, RunLog]:
    meta = json.loads((d / "meta.json").read_text())
    log = RunLog(cmd=[], t_start=meta["t_start"], t_end=meta["t_end"], returncode=meta["returncode"],
                 timed_out=meta["timed_out"])
    for raw in (d / "output.log").read_text().splitlines():
        t, _, line = raw.partition(" ")
        log.lines.append((float(t), line))
    res = Result(name=meta["name"], kind=meta["kind"], fault=meta["fault"], fault_step=meta["fault_step"],
                 interval=meta["interval"], fault_kind=meta.get("fault_kind", "sigkill"), start=meta.get("start"))
    return res, log


def analyse(d: Path, res: Result, log: RunLog) -> Result:
    if log.timed_out or log.returncode != 0:
        res.error = f"rc={log.returncode} timed_out={log.timed_out}; see {d / 'output.log'}"
        return res
    try:
        parse_run(res, log, _events(d / "jit") if res.kind == "jit" else None)
    except ValueError as e:
        res.error = str(e)
    return res


def compare(res: Result, ref_out: Path, work: Path) -> None:
    out = work / res.name / "final.pt"
    if not out.exists() or not ref_out.exists():
        res.identical, res.diffs = False, ["final state missing"]
        return
    _, diffs = diff_states(str(ref_out), str(out))
    res.identical, res.diffs = not diffs, diffs[:10]


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(results: list[Result], ref: Result) -> str:
    """The printed (and RESULTS.md) table, markdown."""
    head = ("| run | fault step | restore step | redone mb | detect s | ckpt s | restart s | redone s "
            "| fail->resumed s | overhead vs ref s (%) | identical to ref |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        over = _sub(r.span_s, ref.span_s)
        pct = None if over is None or not ref.span_s else 100.0 * over / ref.span_s
        ident = "-" if r.identical is None else ("yes" if r.identical else "NO")
        if r.error:
            rows.append(f"| {r.name} | {_f(r.fault_step, '{}')} | FAILED: {r.error} |||||||| {ident} |")
            continue
        rows.append(
            f"| {r.name} | {_f(r.fault_step, '{}')} | {_f(r.restore_step, '{}')} "
            f"| {_f(r.redone_minibatches, '{}')} | {_f(r.detect_s())} "
            f"| {_f(r.ckpt_s())}{' (' + str(len(r.saves)) + ' saves)' if r.kind == 'periodic' else ''} "
            f"| {_f(r.restart_s())} | {_f(r.redone_s())} | {_f(r.fail_to_resumed_s())} "
            f"| {_f(over)} ({_f(pct, '{:+.0f}%')}) | {ident} |")
    return "\n".join(rows)


def jit_records(results: list[Result], target_s: float) -> str:
    lines = []
    for r in results:
        if r.kind != "jit":
            continue
        e = r.recovery
        if e is None:
            lines.append(f"  {r.name}: no recovery record ({r.error or 'events.jsonl without recovery'})")
            continue
        ok = "OK" if e["failure_to_resumed_s"] < target_s else "OVER TARGET"
        lines.append(f"  {r.name:<12} {r.fault or '':<45} failure->resumed {e['failure_to_resumed_s']:6.2f}s "
                     f"(detection {e['detection_s']:.2f}s, checkpoint {e['checkpoint_s']:.2f}s, "
                     f"restart->resumed {e['restart_to_resumed_s']:.2f}s, of which new workers up "
                     f"{_f(r.spawn_s)}s) redone {e['redone_minibatches']} "
                     f"[{ok}: < {target_s:.0f}s]")
    return "\n".join(lines)


STAGES = ("detection", "checkpoint", "stop", "decision", "rendezvous", "process_start", "import_and_init",
          "checkpoint_load", "first_minibatch")


def split_table(results: list[Result]) -> str:
    """Per jitrun run: where failure->resumed went (the recovery record's
    stages); then per fault kind the median of warm and cold starts against
    torchrun + periodic checkpoints with the same fault (fault -> first
    minibatch done after the restart, both)."""
    head = "| run | " + " | ".join(s.replace("_", " ") for s in STAGES) + " | fail->resumed s |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        if r.kind != "jit" or r.recovery is None:
            continue
        st = r.recovery.get("stages") or {}
        rows.append(f"| {r.name} | " + " | ".join(_f(st.get(k)) for k in STAGES)
                    + f" | {_f(r.recovery['failure_to_resumed_s'])} |")
    lines = ["\n".join(rows), "", "median fault -> first minibatch done after the restart (s):"]
    for fk in dict.fromkeys(r.fault_kind for r in results):
        def med(xs: list[float | None]) -> float | None:
            xs = [x for x in xs if x is not None]
            return statistics.median(xs) if xs else None

        per = {st: med([r.recovery["failure_to_resumed_s"] for r in results if r.kind == "jit"
                        and r.start == st and r.fault_kind == fk and r.recovery and not r.error])
               for st in ("warm", "cold")}
        periodic = med([r.fail_to_resumed_s() for r in results
                        if r.kind == "periodic" and r.fault_kind == fk and not r.error])
        parts = [f"jitrun warm {_f(per['warm'])} (n={sum(r.start == 'warm' and r.fault_kind == fk for r in results)})",
                 f"jitrun cold {_f(per['cold'])}"]
        if periodic is not None:
            parts.append(f"torchrun + periodic {_f(periodic)}")
            if per["warm"]:
                parts.append(f"warm / periodic = {per['warm'] / periodic:.2f}")
        lines.append(f"  {fk:<10} " + ", ".join(parts))
    return "\n".join(lines)


COLORS = {"training": "#4c72b0", "detect": "#c44e52", "ckpt": "#dd8452", "restart": "#8172b3",
          "redone": "#937860", "save": "#dd8452"}


def plot(results: list[Result], ref: Result, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    runs = [ref, *[r for r in results if r.error is None]]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 1.5 + 0.55 * len(runs) * 2),
                                  gridspec_kw={"height_ratios": [len(runs), len(runs) - 1 or 1]})
    for y, r in enumerate(reversed(runs)):
        def rel(t: float | None, t0: float = r.t0 or 0.0) -> float | None:
            return None if t is None else t - t0

        def bar(a, b, color, y=y):
            if a is not None and b is not None and b > a:
                ax.barh(y, b - a, left=a, height=0.6, color=color)

        end = rel(r.end_t)
        if r.fault_t is None or r.caught_up_t is None:
            bar(0.0, end, COLORS["training"])
        else:
            bar(0.0, rel(r.fault_t), COLORS["training"])
            bar(rel(r.fault_t), rel(r.detect_t), COLORS["detect"])
            if r.kind == "jit":
                bar(rel(r.detect_t), rel(r.ckpt_end_t), COLORS["ckpt"])
            bar(rel(r.ckpt_end_t if r.ckpt_end_t is not None else r.detect_t), rel(r.resume_t), COLORS["restart"])
            bar(rel(r.resume_t), rel(r.caught_up_t), COLORS["redone"])
            bar(rel(r.caught_up_t), end, COLORS["training"])
        for ts in r.saves:
            # a save is a few ms: a tick, not a visible bar
            ax.plot([rel(ts), rel(ts)], [y - 0.3, y + 0.3], color="black", lw=0.8)
    ax.set_yticks(range(len(runs)), [r.name for r in reversed(runs)])
    ax.set_xlabel("seconds since training start (each run's own clock; start-up not shown)")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=COLORS[k], label=lab) for k, lab in (
        ("training", "training"), ("detect", "failure detection"), ("ckpt", "JIT checkpoint"),
        ("restart", "restart until state loaded"), ("redone", "redone minibatches"))]
        + [plt.Line2D([], [], color="black", lw=0.8, label="periodic checkpoint")],
        loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)

    failed = [r for r in runs if r.kind != "ref"]
    comps = (("detect", "detection", lambda r: r.detect_s()), ("ckpt", "checkpoint (periodic: all saves)",
             lambda r: r.ckpt_s()), ("restart", "restart", lambda r: r.restart_s()),
             ("redone", "redone minibatches", lambda r: r.redone_s()))
    for y, r in enumerate(reversed(failed)):
        left = 0.0
        for key, _, fn in comps:
            v = max(fn(r) or 0.0, 0.0)
            ax2.barh(y, v, left=left, height=0.6, color=COLORS[key])
            left += v
        over = _sub(r.span_s, ref.span_s)
        if over is not None:
            ax2.plot([over], [y], marker="D", color="black", ms=5)
    ax2.set_yticks(range(len(failed)), [r.name for r in reversed(failed)])
    ax2.set_xlabel("seconds lost to the failure: components (they count step F, which ref runs too, "
                   "so they sum to about one minibatch more than the overhead)")
    ax2.legend(handles=[Patch(color=COLORS[k], label=lab) for k, lab, _ in comps]
               + [plt.Line2D([], [], color="black", marker="D", lw=0, label="measured overhead vs ref")],
               loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--multinode" in argv:
        import bench_multinode

        return bench_multinode.main([a for a in argv if a != "--multinode"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--multinode", action="store_true",
                    help="run the multi-node cases instead (scripts/bench_multinode.py; its options follow)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--step-sleep", type=float, default=0.05, help="simulated compute per step (s)")
    ap.add_argument("--seed", type=int, default=0, help="picks the failing step")
    ap.add_argument("--intervals", default="10,30,60", help="periodic checkpoint intervals, steps")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each jitrun configuration")
    ap.add_argument("--jit-timeout", type=float, default=5.0)
    ap.add_argument("--no-stop", action="store_true", help="skip the jitrun SIGSTOP runs")
    ap.add_argument("--kinds", default="sigkill,sigstop",
                    help="fault kinds of the jitrun runs, from sigkill,exit,exception,sigstop; kinds other than "
                         "sigkill/sigstop also get a torchrun + periodic run (sigstop: not under torchrun, "
                         "nothing detects it)")
    ap.add_argument("--starts", default="warm,cold", help="jitrun worker starts to measure: warm, cold or both")
    ap.add_argument("--plot", default=None,
                    help="plot file (default build/bench/recovery.png; '' = no plot)")
    ap.add_argument("--json", default=None,
                    help="file for every measurement (default build/bench/recovery.json; '' = none)")
    ap.add_argument("--publish", action="store_true",
                    help="write the plot and the JSON to bench_results/ (tracked, what RESULTS.md shows) "
                         "instead of build/bench/")
    ap.add_argument("--keep", default=None, help="keep each run's directory (output.log, events) here")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds before a run is killed")
    ap.add_argument("--quick", action="store_true",
                    help="40 steps, one interval, one run of each config (~1-1.5 minutes)")
    ap.add_argument("--reparse", default=None, metavar="DIR",
                    help="analyse the runs kept by an earlier --keep DIR again instead of running")
    ap.add_argument("-v", "--verbose", action="store_true", help="echo the runs' output")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.intervals, args.repeats = 40, "10", 1
    out_dir = PUBLISHED_DIR if args.publish else OUT_DIR
    if args.plot is None:
        args.plot = str(out_dir / "recovery.png")
    if args.json is None:
        args.json = str(out_dir / "recovery.json")
    results: list[Result] = []
    if args.reparse:
        work = Path(args.reparse).resolve()
        args.keep = str(work)  # never delete what we only read
        runs = sorted((p for p in work.iterdir() if (p / "meta.json").exists()), key=lambda p: p.stat().st_mtime)
        if not runs:
            ap.error(f"--reparse: no kept runs (meta.json) under {work}")
        for k, v in json.loads((runs[0] / "meta.json").read_text()).get("args", {}).items():
            setattr(args, k, v)
        loaded = [analyse(p, *load_run(p)) for p in runs]
        ref = next(r for r in loaded if r.kind == "ref")
        results = [r for r in loaded if r.kind != "ref"]
    else:
        work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="jitckpt-bench-recovery-"))
        work.mkdir(parents=True, exist_ok=True)
    intervals = [int(x) for x in args.intervals.split(",") if x.strip()]
    F = results[0].fault_step if results else fault_step(args.seed, args.steps)
    print(f"demo LM, 2 ranks (gloo, CPU), {args.steps} steps, --step-sleep {args.step_sleep}; "
          f"failure: rank 1 at step {F} (seed {args.seed}), backward pass", flush=True)
    try:
        def go(*a, **k) -> Result:
            r = run_config(*a, args=args, work=work, echo=args.verbose, **k)
            print(f"  ran {r.name:<12} wall {_f(r.wall_s, '{:.1f}')}s{'  ERROR ' + r.error if r.error else ''}",
                  flush=True)
            if r.error:
                # the run's directory is gone by the time a CI log is read: say here why it failed
                print_log_tail(work / r.name / "output.log")
            return r

        if not args.reparse:
            ref = go("ref", "ref", F=None)
            if ref.error:
                print(f"reference run failed: {ref.error}", file=sys.stderr)
                return 1
            kinds = [k for k in args.kinds.split(",") if k and not (args.no_stop and k == "sigstop")]
            for k in intervals:
                results.append(go(f"ckpt-{k}", "periodic", F=F, interval=k))
            for fk in kinds:
                if fk not in ("sigkill", "sigstop") and intervals:  # the same faults under torchrun
                    results.append(go(f"ckpt-{intervals[0]}-{fk}", "periodic", F=F, interval=intervals[0],
                                      fault_kind=fk))
            short = {"sigkill": "kill", "sigstop": "stop", "exception": "raise"}
            # interleaved, so slow phases of a shared machine hit every configuration
            for i in range(args.repeats):
                for start in [s for s in args.starts.split(",") if s]:
                    for fk in kinds:
                        results.append(go(f"jit-{start}-{short.get(fk, fk)}{i + 1}", "jit", F=F, fault_kind=fk,
                                          start=start))
        for r in results:
            if r.error is None:
                compare(r, work / "ref" / "final.pt", work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\nreference: {ref.span_s:.2f}s from first to last step line, minibatch "
          f"{ref.minibatch_s * 1e3:.0f} ms (median)\n")
    print(table(results, ref))
    errs = [r.fault_t - r.fault_t_estimate for r in results
            if r.kind == "jit" and r.fault_t is not None and r.fault_t_estimate is not None]
    if errs:
        print(f"\ntorchrun fault-time estimate (line of step F-1) vs the injected fault's own report, "
              f"on the jitrun runs: fault - estimate = {min(errs) * 1e3:.0f}..{max(errs) * 1e3:.0f} ms")
    print("\njitrun recovery records (events.jsonl):")
    print(jit_records(results, 10.0))
    print("\nwhere the time of each jitrun recovery went (events.jsonl 'stages', seconds):\n")
    print(split_table(results))
    print("plain torchrun with a stopped (SIGSTOP) rank: not run; nothing detects it before gloo's "
          "30-minute default timeout.")
    print("noise: shared 2-core machine (other test runs compete), so step times and the overhead column "
          "vary by several tens of percent between runs.")
    if args.plot:
        plot(results, ref, Path(args.plot),
             f"one failure at step {F} of {args.steps} (rank 1; seed {args.seed}); --step-sleep {args.step_sleep}")
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"fault_step": F, "args": vars(args),
                                               "ref": asdict(ref), "runs": [asdict(r) for r in results]},
                                              indent=1))
        print(f"data: {args.json}")
    bad = [r.name for r in results if r.error or not r.identical]
    if bad:
        print(f"FAILED or not identical to ref: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
