"""Steady-state cost of jitckpt: the demo LM's step time under jitrun vs plain torchrun.

    python scripts/bench_overhead.py [--pairs 6] [--steps 200] [--probe-pairs 4] [--json] [--quick]
                                     [--train-args "--d-model 32 --layers 1 --batch 4"] [--threads]

Both runs execute the same ``scripts/demo_train.py`` (which calls
``jitckpt.register`` in both; under plain torchrun jitckpt does nothing), with
no injected failure and no ``--step-sleep``, so the step is pure compute plus
the gloo all-reduce (~35 ms on 2 CPU cores): the worst case for a relative
overhead, since sleeping or a bigger model would only dilute it.

How a step time is measured, without changing the trainer: it runs with
``--log-every 1`` and rank 0 prints (flushed) one line per step. The workers
inherit the launcher's stdout, which is a pipe read by this script, so each
line is timestamped as it arrives, a few microseconds after the step ended.
The steady-state mean step time is

    (t[last step line] - t[line of step WARMUP]) / (last - WARMUP)

i.e. the mean over every step after the first WARMUP (default 20; the first ones
pay for allocator growth and first-call initialisation in autograd and
gloo). A mean, not a median, because an overhead that shows up as an
occasional slow step is still an overhead. Start-up, rendezvous and teardown,
which differ between launchers and are noisy on a shared machine, are not part
of the number. Both launchers print the same per-step line, so the printing
costs the same in both.

Also reported: the median step-to-step interval after WARMUP (blind to an
occasional slow step, so robust to bursts of other people's load, but for the
same reason blind to an overhead that only shows up now and then), and CPU
seconds per step: when the lines of step WARMUP and of the last step arrive,
utime+stime of the launcher and all its descendants (agent, both workers, all
threads) are read from /proc, and the difference is divided by the steps in
between. That counts work jitckpt adds anywhere (hooks in the workers, the
agent polling the store) and is less sensitive than wall time to other
processes competing for the 2 cores, which swing the wall-clock step time by
+-30% between runs here; it cannot see time lost waiting without burning CPU,
which the wall metrics can.

Runs are interleaved torchrun/jitrun in one session, the order alternating
from pair to pair (ABBA...) so that a slow drift of the machine's load does
not favour either side; each pair gives a ratio jitrun/torchrun per metric.
We report the min/median/max of those ratios; the median is the headline.
One run of a pair tends to be the slower one here, whichever launcher it is
(the first on some days, the second on others), so the geometric mean of the
median ratio of each order is printed as well ("order-balanced"); each run
after the first starts ``--settle`` seconds after the previous one ended, so
that one's teardown (processes ending, files freed) is not in its window; an
even --pairs keeps the two orders equally represented in the plain median too.
The machine is shared: read single ratios with that in mind, and look at the
spread.

Because that noise is far above 1%, two measurements that do not depend on
the machine being quiet follow (``--probe-pairs``, default 4):

* a single-process probe (world size 1, one thread, no launcher): median CPU
  time of a demo-model training step, plain vs with jitrun's worker runtime
  installed exactly as jitckpt._bootstrap installs it (hooks, signal watcher,
  connected reporter), in fresh processes, alternating;
* the runtime's per-step hook calls alone (on_forward, on_backward,
  on_optimizer_pre/post in step order), best of 5 x 20000 in that process:
  the Python work jitckpt adds to every step, in microseconds. It leaves out
  torch's dispatch of the hooks (a Python frame or a dict lookup each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import selectors
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import thread_stats  # noqa: E402

TRAIN = str(HERE / "demo_train.py")

# per run: mean wall step time, median wall step time, CPU seconds per step
METRICS = ("step_s", "step_median_s", "cpu_per_step_s")
STEP_RE = re.compile(r"^\[rank 0\] step\s+(\d+) loss")


@dataclass
class RunLog:
    """One launcher run: every output line (stdout and stderr merged, so their
    relative order is kept) with its arrival time, plus the wall time."""

    cmd: list[str]
    lines: list[tuple[float, str]] = field(default_factory=list)
    t_start: float = 0.0
    t_end: float = 0.0
    returncode: int | None = None
    timed_out: bool = False

    @property
    def wall_s(self) -> float:
        return self.t_end - self.t_start

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _proc_stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, utime+stime in s) of every live process."""
    out = {}
    tck = os.sysconf("SC_CLK_TCK")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # the fields after "(comm)", which may itself hold spaces or parentheses
        rest = stat[stat.rindex(b")") + 2:].split()
        out[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tck)
    return out


def process_tree(root: int, stats: dict[int, tuple[int, float]] | None = None) -> list[int]:
    """``root`` and all its live descendants. Walked by parent pid, not by
    session or group: torchrun starts every worker in a session of its own."""
    stats = _proc_stats() if stats is None else stats
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _start_time(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()[19]


def tree_cpu_s(root: int) -> float:
    """utime+stime (s, all threads) of ``root`` and its live descendants."""
    stats = _proc_stats()
    return sum(stats[p][1] for p in process_tree(root, stats))


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every descendant, by pid (a SIGSTOPped worker dies too)."""
    for pid in process_tree(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_timestamped(cmd: list[str], env: dict | None = None, timeout_s: float = 300.0,
                    echo: bool = False, cwd: str | None = None,
                    on_line: Callable[[float, str, int], None] | None = None) -> RunLog:
    """Run ``cmd`` with stdout+stderr piped, timestamping each line on arrival
    (``on_line(t, line, launcher pid)`` is called as it arrives). On timeout
    (or any error here) the launcher and every descendant it had are killed
    and ``timed_out`` is set."""
    log = RunLog(cmd=cmd)
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    log.t_start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env,
                            cwd=cwd, start_new_session=True, bufsize=0)
    # Workers orphaned by a dying launcher leave its tree but keep our pipe
    # open, so remember every pid (with its start time, against pid reuse)
    # ever seen below the launcher and kill the survivors once it is gone.
    seen: dict[int, bytes] = {}
    last_scan = 0.0

    def scan() -> None:
        for pid in process_tree(proc.pid):
            st = _start_time(pid)
            if st is not None:
                seen.setdefault(pid, st)

    deadline = time.monotonic() + timeout_s
    buf = b""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    clean = False
    exited_at: float | None = None

    def kill_seen() -> None:
        for pid, st in seen.items():
            if pid != proc.pid and _start_time(pid) == st:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    try:
        while True:
            if exited_at is None and time.monotonic() - last_scan > 1.0:
                scan()
                last_scan = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = time.monotonic()
            elif exited_at is not None and time.monotonic() - exited_at > 2.0:
                kill_seen()  # the launcher is gone but something still holds the pipe
            left = deadline - time.monotonic()
            if left <= 0:
                log.timed_out = True
                break
            if not sel.select(timeout=min(left, 0.5)):
                continue
            chunk = os.read(fd, 65536)
            now = time.time()
            if not chunk:
                break
            buf += chunk
            *complete, buf = buf.split(b"\n")
            for raw in complete:
                line = raw.decode(errors="replace")
                log.lines.append((now, line))
                if on_line is not None:
                    on_line(now, line, proc.pid)
                if echo:
                    print(line, flush=True)
        if not log.timed_out:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0) + 10)
            except subprocess.TimeoutExpired:
                log.timed_out = True
        clean = not log.timed_out
    finally:
        sel.close()
        if buf:
            log.lines.append((time.time(), buf.decode(errors="replace")))
        if not clean:
            scan()
            kill_tree(proc.pid)
        kill_seen()
        proc.wait()
        proc.stdout.close()
    log.t_end = time.time()
    log.returncode = proc.returncode
    return log


def step_times(lines: list[tuple[float, str]]) -> list[tuple[int, float]]:
    """(step, arrival time) of every rank-0 step line, in arrival order."""
    out = []
    for t, line in lines:
        m = STEP_RE.match(line)
        if m:
            out.append((int(m.group(1)), t))
    return out


def steady_step_s(steps: list[tuple[int, float]], warmup: int) -> float:
    """Mean step time over the steps after ``warmup`` (see module docstring).
    Needs one uninterrupted run: a restart would make the step index go back."""
    idx = [s for s, _ in steps]
    if idx != sorted(idx) or len(set(idx)) != len(idx):
        raise ValueError("step lines are not one increasing sequence (a restart?)")
    after = [(s, t) for s, t in steps if s >= warmup]
    if len(after) < 2:
        raise ValueError(f"need at least 2 step lines at or after step {warmup}, got {len(after)}")
    (s0, t0), (s1, t1) = after[0], after[-1]
    return (t1 - t0) / (s1 - s0)


def _spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def median_step_s(steps: list[tuple[int, float]], warmup: int) -> float:
    """Median of the step-to-step intervals after ``warmup``: blind to a
    rare slow step, so robust to bursts of other load."""
    after = [(s, t) for s, t in steps if s >= warmup]
    return statistics.median((t2 - t1) / (s2 - s1) for (s1, t1), (s2, t2) in pairwise(after))


def summarize(pairs: list[dict]) -> dict:
    """Per-pair ratios jitrun/torchrun of both metrics, their min/median/max,
    and the overhead in percent from the median ratio."""
    out: dict = {"pairs": len(pairs)}
    for metric in METRICS:
        ratios = [p["jitrun"][metric] / p["torchrun"][metric] for p in pairs]
        spread = _spread(ratios)
        # On this machine the first run of a pair tends to be the slower one;
        # the geometric mean of the two orders' medians cancels that.
        by_order = [[r for r, p in zip(ratios, pairs, strict=True) if p.get("order", ["torchrun"])[0] == first]
                    for first in ("torchrun", "jitrun")]
        balanced = (math.sqrt(statistics.median(by_order[0]) * statistics.median(by_order[1]))
                    if all(by_order) else None)
        out[metric] = {
            "ratios": ratios,
            **{f"ratio_{k}": v for k, v in spread.items()},
            "ratio_order_balanced": balanced,
            "overhead_pct": (spread["median"] - 1.0) * 100.0,
            "torchrun_median": statistics.median(p["torchrun"][metric] for p in pairs),
            "jitrun_median": statistics.median(p["jitrun"][metric] for p in pairs),
        }
    return out


def summarize_probe(probes: list[dict], step_s: float) -> dict:
    """Ratios hooked/plain of the probes' CPU per step, and the hook calls'
    cost as a share of ``step_s`` (the 2-rank torchrun step time)."""
    ratios = [p["hooked"]["cpu_s"] / p["plain"]["cpu_s"] for p in probes]
    hook_s = statistics.median(p["hooked"]["hook_s"] for p in probes)
    return {"pairs": probes, "ratios": ratios, **{f"ratio_{k}": v for k, v in _spread(ratios).items()},
            "overhead_pct": (statistics.median(ratios) - 1.0) * 100.0,
            "hook_us": hook_s * 1e6, "hook_pct_of_step": 100.0 * hook_s / step_s}


def summarize_threads(pairs: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """``role/thread`` -> launcher -> the median over the pairs of each per-step figure."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for kind in ("torchrun", "jitrun"):
        runs = [p[kind].get("threads", {}) for p in pairs]
        for name in sorted({n for r in runs for n in r}):
            rows = [r.get(name, {"cpu_ms": 0.0, "vol": 0.0, "invol": 0.0, "minflt": 0.0}) for r in runs]
            out.setdefault(name, {})[kind] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return out


def threads_table(t: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["\nper step, median over the pairs (torchrun | jitrun):",
             f"{'role/thread':<28} {'CPU ms':>15} {'voluntary sw':>15} {'involuntary sw':>15} {'minor faults':>15}"]
    zero = {"cpu_ms": 0.0, "vol": 0.0, "invol": 0.0, "minflt": 0.0}
    for name, by in t.items():
        tr, jr = by.get("torchrun", zero), by.get("jitrun", zero)
        if max(*tr.values(), *jr.values()) < 0.005:
            continue
        lines.append(f"{name:<28} " + " ".join(f"{tr[k]:>7.3f}|{jr[k]:<7.3f}" for k in ("cpu_ms", "vol", "invol",
                                                                                          "minflt")))
    return "\n".join(lines)


def commands(steps: int, jit_dir: str, train_args: list[str] | None = None,
             jit_args: list[str] | None = None) -> dict[str, list[str]]:
    py = sys.executable
    train = [TRAIN, "--steps", str(steps), "--log-every", "1", *(train_args or [])]
    return {
        "torchrun": [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *train],
        "jitrun": [py, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--jit-dir", jit_dir,
                   *(jit_args or []), *train],
    }


def measure(kind: str, steps: int, warmup: int, workdir: Path, n: int, timeout_s: float,
            train_args: list[str] | None = None, threads: bool = False, jit_args: list[str] | None = None) -> dict:
    """One run: mean wall step time and CPU seconds per step after ``warmup``
    (``threads``: also each thread group's cost per step, thread_stats.py)."""
    jit_dir = workdir / f"jit-{n}"
    # a fresh jit dir per run: a reused one would make jitrun resume from it
    shutil.rmtree(jit_dir, ignore_errors=True)
    cpu: dict[int, float] = {}
    snaps: dict[int, dict] = {}

    def on_line(t: float, line: str, pid: int) -> None:
        m = STEP_RE.match(line)
        if m and int(m.group(1)) in (warmup, steps - 1):
            cpu[int(m.group(1))] = tree_cpu_s(pid)
            if threads:
                snaps[int(m.group(1))] = thread_stats.snapshot(pid, TRAIN)

    log = run_timestamped(commands(steps, str(jit_dir), train_args, jit_args)[kind], timeout_s=timeout_s,
                          cwd=str(workdir), on_line=on_line)
    if log.timed_out or log.returncode != 0:
        tail = "\n".join(line for _, line in log.lines[-30:])
        raise RuntimeError(f"{kind} run failed (rc={log.returncode}, timed_out={log.timed_out}):\n{tail}")
    if len(cpu) != 2:
        raise RuntimeError(f"{kind} run: missing step line {warmup} or {steps - 1}")
    steps_seen = step_times(log.lines)
    out = {"step_s": steady_step_s(steps_seen, warmup), "step_median_s": median_step_s(steps_seen, warmup),
           "cpu_per_step_s": (cpu[steps - 1] - cpu[warmup]) / (steps - 1 - warmup), "wall_s": log.wall_s}
    if threads and len(snaps) == 2:
        out["threads"] = thread_stats.per_step(snaps[warmup], snaps[steps - 1], steps - 1 - warmup)
    return out


PROBE = """
import os, statistics, sys, tempfile, time
import torch, torch.distributed as dist, torch.nn as nn
from datetime import timedelta
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, {scripts!r})
from demo_train import TinyLM, batch
import jitckpt
hooked, steps, warmup = sys.argv[1] == "hooked", int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
if hooked:
    # what jitrun gives a worker; install() is what jitckpt._bootstrap runs first
    os.environ.update(JITCKPT_DIR=tempfile.mkdtemp(), JITCKPT_TOKEN="probe", JITCKPT_JOB_ID="probe",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1")
    jitckpt.api.install()
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
torch.manual_seed(0)
model = TinyLM(256, 64, 2, 4, 32, dropout=0.1)
ddp = DDP(model, find_unused_parameters=True)  # as demo_train builds it
opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
jitckpt.register(lambda d: None)
assert (jitckpt.api._runtime.reporter is not None) == hooked
cpu, wall = [], []
for step in range(steps):
    c0, w0 = time.process_time(), time.perf_counter()
    x, y = batch(0, step, 0, 8, 32, 256)
    loss = nn.functional.cross_entropy(ddp(x).reshape(-1, 256), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    if step >= warmup:
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
hook_s = float("nan")
if hooked:
    # the runtime's per-step work alone, in the order a step calls it, best of 5
    import timeit
    rt, n = jitckpt.api._runtime, 20000
    seq = lambda: (rt.on_forward(), rt.on_backward(loss), rt.on_optimizer_pre(), rt.on_optimizer_post())
    hook_s = min(timeit.repeat(seq, number=n, repeat=5)) / n
print(statistics.median(cpu), statistics.median(wall), hook_s)
"""


def probe(kind: str, steps: int, warmup: int, timeout_s: float) -> dict:
    """Median CPU and wall seconds of one training step of the demo model in
    a single process (world size 1, one thread), with jitrun's worker runtime
    installed (``hooked``) or not (``plain``); for ``hooked`` also the cost of
    the runtime's per-step hook calls alone (``hook_s``)."""
    log = run_timestamped([sys.executable, "-c", PROBE.format(scripts=str(HERE)), kind, str(steps), str(warmup)],
                          timeout_s=timeout_s)
    if log.timed_out or log.returncode != 0:
        tail = "\n".join(line for _, line in log.lines[-20:])
        raise RuntimeError(f"probe {kind} failed (rc={log.returncode}):\n{tail}")
    cpu, wall, hook = (float(x) for x in log.lines[-1][1].split())
    return {"cpu_s": cpu, "wall_s": wall, "hook_s": hook}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=6,
                    help="interleaved torchrun/jitrun pairs, order alternating (default 6: 3 of each order)")
    ap.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    ap.add_argument("--warmup", type=int, default=20, help="first steps left out of the mean (default 20)")
    ap.add_argument("--probe-pairs", type=int, default=4,
                    help="single-process plain/hooked probe pairs (default 4; 0 = skip)")
    ap.add_argument("--quick", action="store_true", help="2 pairs of 80 steps, 1 probe pair (~1-1.5 minutes)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds before a run is killed")
    ap.add_argument("--train-args", default="", help='demo_train.py arguments of the model, e.g. '
                    '"--d-model 32 --layers 1 --batch 4" (~8 ms steps here; the default model ~35 ms)')
    ap.add_argument("--jit-args", default="", help='jitrun options, e.g. "--jit-ec-every 0" (a feature off)')
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds of rest before each run after the first (default 3): the previous run's "
                         "processes ending, its files freed and written back, out of the next run's window")
    ap.add_argument("--threads", action="store_true",
                    help="attribute: each thread group's CPU, context switches and page faults per step, "
                         "torchrun vs jitrun (median over the pairs)")
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    if args.quick:
        args.pairs, args.steps, args.warmup, args.probe_pairs = 2, 80, 10, 1
    if args.steps < args.warmup + 10:
        ap.error("--steps must be at least --warmup + 10")
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))

    workdir = Path(tempfile.mkdtemp(prefix="jitckpt-bench-overhead-"))
    pairs: list[dict] = []
    try:
        say(f"demo LM, 2 ranks (gloo, CPU), {args.steps} steps/run, steady state = after step {args.warmup}")
        say(f"{'pair':>4} {'order':<18} {'mean step ms':>20} {'ratio':>7}  {'median step ms':>20} {'ratio':>7}  "
            f"{'CPU ms/step':>20} {'ratio':>7}")
        say(f"{'':>4} {'':<18} {'torchrun  jitrun':>20} {'':>7}  {'torchrun  jitrun':>20} {'':>7}  "
            f"{'torchrun  jitrun':>20}")
        for i in range(args.pairs):
            order = ("torchrun", "jitrun") if i % 2 == 0 else ("jitrun", "torchrun")
            rec: dict = {"order": list(order)}
            for j, kind in enumerate(order):
                if i or j:
                    time.sleep(args.settle)  # the last run's teardown is not part of this one's window
                rec[kind] = measure(kind, args.steps, args.warmup, workdir, 2 * i + j, args.timeout,
                                    shlex.split(args.train_args), args.threads, shlex.split(args.jit_args))
            pairs.append(rec)
            cols = []
            for metric in METRICS:
                tr, jr = rec["torchrun"][metric], rec["jitrun"][metric]
                cols.append(f"{tr * 1e3:>11.2f} {jr * 1e3:>7.2f} {jr / tr:>8.4f}")
            say(f"{i:>4} {'->'.join(order):<18} " + "  ".join(cols))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    s = summarize(pairs)
    s.update(steps=args.steps, warmup=args.warmup, train_args=args.train_args, jit_args=args.jit_args,
             per_pair=pairs)
    if args.threads:
        s["threads"] = summarize_threads(pairs)
        say(threads_table(s["threads"]))
    if args.probe_pairs > 0:
        say(f"\nsingle process (world size 1, 1 thread), {args.steps} steps: median CPU ms per step, "
            "plain vs jitrun's worker runtime installed")
        probes = []
        for i in range(args.probe_pairs):
            order = ("plain", "hooked") if i % 2 == 0 else ("hooked", "plain")
            rec = {"order": list(order), **{k: probe(k, args.steps, args.warmup, args.timeout) for k in order}}
            probes.append(rec)
            say(f"{i:>4} {'->'.join(order):<14} plain {rec['plain']['cpu_s'] * 1e3:7.2f}  hooked "
                f"{rec['hooked']['cpu_s'] * 1e3:7.2f}  ratio {rec['hooked']['cpu_s'] / rec['plain']['cpu_s']:.4f}")
        s["probe"] = summarize_probe(probes, s["step_s"]["torchrun_median"])
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        names = {"step_s": "mean step", "step_median_s": "median step", "cpu_per_step_s": "CPU per step"}
        for metric, name in names.items():
            m = s[metric]
            bal = m["ratio_order_balanced"]
            say(f"{name:<13} ratio jitrun/torchrun: min {m['ratio_min']:.4f}  median {m['ratio_median']:.4f}  "
                f"max {m['ratio_max']:.4f}  -> overhead {m['overhead_pct']:+.2f}% (median)"
                + (f"; order-balanced {bal:.4f}" if bal is not None else ""))
        if "probe" in s:
            p = s["probe"]
            say(f"probe CPU/step ratio hooked/plain: min {p['ratio_min']:.4f}  median {p['ratio_median']:.4f}  "
                f"max {p['ratio_max']:.4f}  -> {p['overhead_pct']:+.2f}% (median)")
            say(f"jitckpt's per-step hook calls alone (best of 5 x 20000): {p['hook_us']:.1f} us per step = "
                f"{p['hook_pct_of_step']:.3f}% of the median 2-rank torchrun step above")
        say("target: < 1%. Shared 2-core machine: the wall-time spread is mostly other processes' load.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
