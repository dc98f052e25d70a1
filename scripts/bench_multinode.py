"""Multi-node recovery: jitrun vs plain torchrun + periodic checkpoints, nodes as network namespaces.

    python scripts/bench_multinode.py [--quick] [--cases a,b,c,d] [--cap 150] [--json FILE] [--publish]
                                      [--keep DIR] [--reparse DIR] [-v]
                                      [--repeats N] [--launchers jitrun,torchrun]
    python scripts/bench_recovery.py --multinode [the same options]

Needs root (network and mount namespaces: tests/netns.py, the multi-node test
harness). Outputs: the raw measurements in build/bench/multinode.json
(untracked); ``--publish`` writes bench_results/multinode.json instead.
``--quick``: cases a and c only, 60 steps, F = 27, cap 100 s (~3 minutes,
most of it torchrun failing c).

The world: 2 nodes x 1 rank (gloo, CPU), each node a network namespace with
its own address, each launcher process tree in a private mount namespace
whose --jit-dir and /dev/shm are a tmpfs of its own (a node cannot read
another node's disk; a killed node's disk is gone). The demo LM trains
``--steps`` steps (120) with ``--step-sleep 0.05 --log-every 1``. Cases, each
run under both launchers in the same session, one run at a time (the machine
has 2 cores), the launcher order alternating from case to case:

a  rank 1 SIGKILLed in the backward pass of step F (47), its node and agent
   intact: JITCKPT_FAULT="rank=1,step=F,phase=backward,kind=sigkill"
   (torchrun: the trainer started through ``-m jitckpt._bootstrap``, which
   only injects the fault);
b  node 1 lost (every process in its namespace SIGKILLed: agent + worker)
   when rank 0 has printed step F, with a hot spare: a third node whose agent
   (the same command) was started as soon as the job's first rendezvous round
   was complete (node 1 has a connection to node 0 other than the rendezvous
   endpoint's: the workers' gloo pairs; or rank 0 printed step 0), so it can
   only wait. "Already waiting" is checked, not assumed: the kill waits, past
   step F if need be, until the spare's agent has held a connection to the
   rendezvous endpoint for 1 s (``ss`` in its namespace; neither launcher
   reports a spare parked in torch's redundancy list). The table's "failed
   in step" column shows where the kill came;
c  node 1 lost the same way, and a replacement node started ``--replace-delay``
   (3) s after the kill, with the same command. Its "replacement start->resumed"
   is compared with the cold-start floor, measured in the same session before
   the runs: a fresh interpreter importing torch and what DDP's constructor
   pulls in (torch._dynamo), which no launcher can skip on a cold node;
d  jitrun only (torchrun has no erasure-coded snapshots; its d is skipped with
   a line saying so): tests/test_ec_e2e.py::test_three_nodes_one_node_lost_2_plus_1
   as a timed run, its world and flags: 3 nodes x 1 rank, ``--jit-ec-every 4``
   (and jitrun's default warm start), 24 steps, ``--step-sleep 0.3`` (``--steps``,
   ``--step-sleep`` and ``--fault-step`` do not apply). Ranks 0 and 1 are
   SIGKILLed in the forward pass of step 11 (JITCKPT_FAULT, given to the
   first three agents) and node 2 is lost when rank 0 has printed step 10: no
   worker is left to take a JIT checkpoint and node 2's /dev/shm, one chunk
   of every stripe, is gone, so the job must decode the EC 2+1 snapshot of
   step 8 from the two surviving nodes' memory (minibatches 8 to 11 redone).
   The job does not shrink: as in the test (``--nnodes 3``), a replacement
   node with the same command (no fault) starts 4 s after the kill (the
   survivors decide without it), and fail->resumed includes its start-up. What the test asserts is checked
   from the events and printed: every ``restore_source`` is ``ec``, step 8,
   k=2, m=1; ``ec_restored`` step 8; no ``checkpoint_saved``; one
   ``recovery``, restore step 8, with a verified fingerprint, at most 4
   minibatches redone; the ``restore_decision`` names a lost node;
e  d's job with a hot spare waiting (started and settled as in b) instead
   of the replacement: the node loss as the EC snapshot's users meet it
   with a spare at hand;

jitrun: ``--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-conf
keep_alive_interval=2 --max-restarts 3 --jit-timeout 5``, per-node --jit-dir,
--local-addr (it derives GLOO_SOCKET_IFNAME and is_host itself).
torchrun: the same rendezvous arguments plus ``is_host=1`` on node 0 and
``is_host=0`` elsewhere and GLOO_SOCKET_IFNAME=eth0, ``--max-restarts 3``, and
the trainer's periodic checkpoint every ``--ckpt-every`` (10) steps into a
directory every node sees (a host path outside the namespaces' private
mounts): periodic checkpoints go to shared storage in practice; on a node's
own disk they would be lost with the node. torchrun 2.13 is not expected to
recover b or c: its c10d rendezvous does not republish MASTER_ADDR for a
later round, so a node that joins after the first round times out (~60 s).
Every run is capped at ``--cap`` s; a run still going then is killed (every
process in the run's namespaces, by PID) and reported as failed.

``--repeats N`` runs every case N times (rounds: every case once per round, the
launcher order alternating) and adds a table of medians (min-max) per case and
launcher; ``--launchers jitrun`` leaves torchrun's runs out (its b and c fail by
design and take the cap each).

Reference: one failure-free plain torchrun run of the same world in
namespaces (no checkpoints); d has its own (``ref-d``: 3 nodes, 24 steps).
"identical" = final model+optimizer state equal to it bit for bit
(scripts/compare_state.diff_states).

The clock. The harness sends the merged stdout+stderr of each node's process
tree (agent and its workers) to a log file. This script polls every log file
every ``POLL_S`` (10 ms) in its one loop and timestamps each new complete
line with time.time() when it reads it, so a line's time is its write time
plus at most ~10 ms (plus scheduling delay on the loaded machine). The same
loop starts the spare, kills node 1 right after reading rank 0's line of step
F (the kill time is time.time() just before the kill) and starts the
replacement. jitrun's events.jsonl (copied out of each node's private jit dir
when its agent exits) carries time.time() of the process that wrote it:
namespaces share the host's clock, so all times compare directly.

Per run:

fault        a/jitrun: ``fault_injected`` in events.jsonl. a/torchrun (nothing
             reports it): the arrival of step F-1's line, the end of the last
             minibatch before the fault, a few ms early (the footer gives the
             error of this estimate measured on the jitrun run). b, c: the
             moment this script killed node 1. d: the first of node 2's kill
             and the ranks' ``fault_injected`` events.
restore      the step both ranks loaded after the failure (their "resumed
             from ... at step N" lines); 0 for a restart from scratch.
failed in    P, the minibatch in progress at the failure (a: F; b/c/d: 1 + the
  step       last step rank 0 printed before the fault).
redone mb    minibatches computed again: P + 1 - restore.
fail->res    fault -> the first step line after the restart (the first
             minibatch done again: the definition of bench_recovery.py and of
             events.jsonl's failure_to_resumed_s).
fail->caught fault -> the line of step P after the restart: back where the job
  up         was, the redone minibatches included (the same as fail->res when
             the restore step is P, as with jitrun).
wall         the first agent started -> the last agent exited (start-up
             included).
exit codes   every agent (bash wrapper) by name; -9 for the lost node's.
ratio        jitrun / torchrun of fail->res (and of fail->caught up), where
             both recovered.

The machine is shared (2 cores, other people's tests): step and start-up
times swing by tens of percent between runs; compare the ratios, measured in
the same session, rather than absolute seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUT_DIR = REPO / "build" / "bench"  # default, untracked
PUBLISHED_DIR = REPO / "bench_results"  # tracked; only with --publish
sys.path.insert(0, str(HERE))
from compare_state import diff_states  # noqa: E402
from netns_watch import Tail, rdzv_connected, round_complete  # noqa: E402

TRAIN = str(HERE / "demo_train.py")
PORT = 29400
POLL_S = 0.01
SPARE_SETTLE_S = 1.0
BASE_ENV = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"}
STEP_RE = re.compile(r"^\[rank 0\] step\s+(\d+) loss")
RESUMED_RE = re.compile(r"^\[rank (\d+)\] resumed from .* at step (\d+)")
# the last error a surviving agent printed: "SomethingError: message"
ERROR_RE = re.compile(r"^((?:[a-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Timeout)):\s*(.*)")

CASES = {
    "a": "rank 1 killed (SIGKILL, step F backward)",
    "b": "node 1 lost, hot spare waiting",
    "c": "node 1 lost, replacement +{delay:g}s",
    "d": "3 nodes + EC 2+1, node 2 lost + ranks 0-1 killed, replacement +4s",
    "e": "3 nodes + EC 2+1, node 2 lost + ranks 0-1 killed, hot spare waiting",
}
EC_CASES = ("d", "e")  # d's world (tests/test_ec_e2e.py's), no torchrun run
# d: tests/test_ec_e2e.py::test_three_nodes_one_node_lost_2_plus_1, its world and flags
EC_EVERY, EC_STEPS, EC_KILL_AT, EC_SLEEP, EC_REPLACE_DELAY = 4, 24, 11, 0.3, 4.0
EC_FLAGS = ("--jit-ec-every", str(EC_EVERY))
LAUNCHERS = ("jitrun", "torchrun")
STAGES = ("detection", "checkpoint", "stop", "decision", "rendezvous", "process_start", "import_and_init",
          "checkpoint_load", "first_minibatch")  # a recovery record's, in time order


@dataclass
class MNRun:
    case: str  # a | b | c | d | ref | ref-d
    launcher: str  # jitrun | torchrun
    rep: int = 0  # which repetition (--repeats)
    fault_step: int | None = None  # F
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)  # agents on the killed node
    timed_out: bool = False
    cap_s: float | None = None
    t_start: float | None = None
    t_end: float | None = None
    fault_t: float | None = None
    fault_source: str | None = None
    fault_t_estimate: float | None = None  # the torchrun estimator (line of step F-1), also for jitrun
    spare_started_t: float | None = None
    spare_connected_t: float | None = None  # the spare's agent reached the rendezvous endpoint
    replacement_started_t: float | None = None
    progress_step: int | None = None  # P: the minibatch in progress at the failure
    restore_step: int | None = None
    redone_minibatches: int | None = None
    resume_t: float | None = None  # every rank printed "resumed from"
    first_done_t: float | None = None  # the first step line after the restart
    caught_up_t: float | None = None  # the line of step P after the restart: back where it failed
    end_t: float | None = None  # the last step line
    last_step: int | None = None
    periodic_saves: int = 0
    identical: bool | None = None
    diffs: list[str] = field(default_factory=list)
    error: str | None = None  # why it did not recover ("failed: <error>" in the table)
    recovery: list[dict] = field(default_factory=list)  # jitrun's events.jsonl recovery records
    ec: dict | None = None  # d: the EC restore as the events tell it, and what the test asserts that failed
    workdir: str | None = None

    @property
    def name(self) -> str:
        if is_ref(self.case):
            return self.case
        return f"{self.case}-{self.launcher}" + (f"-{self.rep + 1}" if self.rep else "")

    @property
    def wall_s(self) -> float | None:
        return _sub(self.t_end, self.t_start)

    def fail_to_resumed_s(self) -> float | None:
        return _sub(self.first_done_t, self.fault_t)

    def fail_to_caught_up_s(self) -> float | None:
        return _sub(self.caught_up_t, self.fault_t)

    def replacement_to_resumed_s(self) -> float | None:
        """c: from the replacement's start to the first step line after the restart."""
        return _sub(self.first_done_t, self.replacement_started_t)

    def recovered(self) -> bool:
        return self.error is None and self.first_done_t is not None


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def is_ref(case: str) -> bool:
    return case.startswith("ref")


def ref_for(case: str) -> str:
    """The failure-free run ``case`` is compared with: d's world is another."""
    return "ref-d" if case in (*EC_CASES, "ref-d") else "ref"


@dataclass(frozen=True)
class World:
    nnodes: int
    steps: int
    step_sleep: float
    jitrun_flags: tuple[str, ...] = ()

    @staticmethod
    def of(case: str, args) -> World:
        if ref_for(case) == "ref-d":
            return World(3, EC_STEPS, EC_SLEEP, EC_FLAGS)
        return World(2, args.steps, args.step_sleep)


# -- analysis (pure: tested on synthetic output) ---------------------------------------


def failure_reason(run: MNRun, lines: list[tuple[float, str, str]]) -> str | None:
    """None if ``run`` ended well (no timeout, every agent not on the lost node
    exited 0), else a short reason: the cap or the exit codes, and the first
    uncaught exception a surviving agent printed (a traceback's last line, at
    the start of a line: the workers' own errors are prefixed "[rankN]:")."""
    alive = {k: v for k, v in run.exit_codes.items() if k not in run.lost}
    if not run.timed_out and alive and all(v == 0 for v in alive.values()):
        return None
    first = None
    for _, src, line in sorted(lines, key=lambda x: x[0]):
        if src not in run.lost and (m := ERROR_RE.match(line)):
            first = f"{src}: {m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"
            break
    why = (f"no exit within {run.cap_s:g}s, killed" if run.timed_out
           else "exit " + " ".join(f"{k}={v}" for k, v in alive.items() if v != 0))
    if first:
        why += f"; first error: {first[:120]}"
    elif run.timed_out:
        last: dict[str, str] = {}
        for _, src, line in sorted(lines, key=lambda x: x[0]):
            if src not in run.lost and line.strip():
                last[src] = line.strip()
        if last:
            why += "; last output: " + ", ".join(f"{k}: {v[:70]!r}" for k, v in last.items())
    return why


def analyse(run: MNRun, lines: list[tuple[float, str, str]], events: list[dict]) -> MNRun:
    """Fill ``run``'s timeline from the timestamped lines of every node's
    log, (t, agent name, line) in arrival order, and jitrun's merged events.
    ``run.fault_t`` is already set for b/c (the kill); ``run.exit_codes``,
    ``timed_out`` and ``lost`` too."""
    lines = sorted(lines, key=lambda x: x[0])
    steps = [(t, int(m.group(1))) for t, _, line in lines if (m := STEP_RE.match(line))]
    run.periodic_saves = sum(1 for _, _, line in lines if line.startswith("[rank 0] periodic checkpoint"))
    if steps:
        run.end_t, run.last_step = steps[-1]
    run.recovery = [e for e in events if e.get("event") == "recovery"]
    F = run.fault_step
    if F is not None:
        pre = [t for t, s in steps if s == F - 1]
        run.fault_t_estimate = pre[0] if pre else None
    if run.case in EC_CASES and run.fault_t is not None:
        # node 2's kill or the ranks' own faults (step 11's forward, just after rank 0's line of step 10)
        injected = [e["t"] for e in events if e.get("event") == "fault_injected"]
        if injected and min(injected) < run.fault_t:
            run.fault_t, run.fault_source = min(injected), "fault_injected event (before node 2's kill)"
        run.progress_step = F  # the ranks' fault: its line-read times can trail fault_injected by ms
        run.ec = ec_checks(events)
    elif run.case == "a":
        injected = [e["t"] for e in events if e.get("event") == "fault_injected"]
        if injected:
            run.fault_t, run.fault_source = min(injected), "fault_injected event"
        else:
            run.fault_t, run.fault_source = run.fault_t_estimate, f"arrival of step {F - 1}'s line"
        run.progress_step = F
    elif run.fault_t is not None:
        before = [s for t, s in steps if t <= run.fault_t]
        run.progress_step = max(before) + 1 if before else 0
    run.error = failure_reason(run, lines)
    if run.fault_t is None:
        if not is_ref(run.case) and run.error is None:
            run.error = "no failure happened (the job ended first)"
        return run
    after = [(t, s) for t, s in steps if t > run.fault_t]
    resumed = [(t, int(m.group(1)), int(m.group(2))) for t, _, line in lines
               if (m := RESUMED_RE.match(line)) and t > run.fault_t]
    if resumed:
        run.restore_step = resumed[0][2]
        ranks: dict[int, float] = {}
        for t, rank, _ in resumed:
            ranks.setdefault(rank, t)
        run.resume_t = max(ranks.values())
        done = [(t, s) for t, s in after if t > resumed[0][0]]
    else:
        # restarted from scratch (nothing loaded): the step index goes back
        done = [(t, s) for t, s in after if s < (run.progress_step or 0)]
        run.restore_step = done[0][1] if done else None
    if done and run.error is None:
        run.first_done_t = done[0][0]
        caught = [t for t, s in done if s == run.progress_step]
        run.caught_up_t = caught[0] if caught else None
        run.redone_minibatches = max((run.progress_step or 0) + 1 - (run.restore_step or 0), 0)
    elif run.error is None:
        run.error = "no training step after the failure"
    return run


def ec_checks(events: list[dict]) -> dict:
    """d: the EC restore as the events tell it, and ``problems``: which of the assertions of
    tests/test_ec_e2e.py::test_three_nodes_one_node_lost_2_plus_1 do not hold (empty: all do)."""
    def of(name: str) -> list[dict]:
        return [e for e in events if e.get("event") == name]

    want = EC_KILL_AT // EC_EVERY * EC_EVERY  # 8: the newest snapshot committed before the kill
    src, restored, rec, dec = of("restore_source"), of("ec_restored"), of("recovery"), of("restore_decision")
    codes = {((e.get("ec") or {}).get("k"), (e.get("ec") or {}).get("m")) for e in src}
    problems = []
    if not src or {e.get("source") for e in src} != {"ec"} or {e.get("step") for e in src} != {want}:
        problems.append(f"restore_source {[(e.get('source'), e.get('step')) for e in src]}, not all ec step {want}")
    if codes != {(2, 1)}:
        problems.append(f"EC code(s) {sorted(codes, key=str)}, not k=2,m=1")
    if of("checkpoint_saved"):
        problems.append(f"{len(of('checkpoint_saved'))} checkpoint_saved (no replica should have saved)")
    if not restored or {e.get("step") for e in restored} != {want}:
        problems.append(f"ec_restored steps {sorted({e.get('step') for e in restored}, key=str)}, not [{want}]")
    if len(rec) != 1 or rec[0].get("restore_step") != want:
        problems.append(f"recovery records' restore steps {[e.get('restore_step') for e in rec]}, not [{want}]")
    elif not (isinstance(rec[0].get("fingerprint"), dict) and rec[0]["fingerprint"]):
        problems.append("the recovery record carries no verified state fingerprint")
    if not dec or not dec[0].get("lost"):
        problems.append("the restore_decision names no lost node")
    return {"source": src[0].get("source") if src else None, "step": src[0].get("step") if src else None,
            "k_m": sorted(codes, key=str)[0] if len(codes) == 1 else None,
            "lost": dec[0].get("lost") if dec else None, "problems": problems}


def compare(run: MNRun, ref_out: Path, out: Path) -> None:
    if not out.exists() or not ref_out.exists():
        run.identical, run.diffs = False, ["final state missing"]
        return
    _, diffs = diff_states(str(ref_out), str(out))
    run.identical, run.diffs = not diffs, diffs[:10]


def ratios(runs: list[MNRun]) -> dict[str, dict]:
    """Per case: jitrun's and torchrun's fail->resumed and fail->caught-up
    seconds and the ratios jitrun/torchrun (None unless both recovered)."""
    out = {}
    for case in dict.fromkeys(r.case for r in runs if not is_ref(r.case)):
        by = {r.launcher: r for r in runs if r.case == case and r.rep == 0}
        j, t = by.get("jitrun"), by.get("torchrun")
        both = bool(j and t and j.recovered() and t.recovered())
        rec: dict = {"both_recovered": both,
                     "not_recovered": [x.launcher for x in (j, t) if x is not None and not x.recovered()]}
        for key, fn in (("fail_to_resumed", MNRun.fail_to_resumed_s), ("fail_to_caught_up", MNRun.fail_to_caught_up_s)):
            js = fn(j) if j and j.recovered() else None
            ts = fn(t) if t and t.recovered() else None
            rec[key] = {"jitrun_s": js, "torchrun_s": ts, "ratio": js / ts if both and js is not None and ts else None}
        out[case] = rec
    return out


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _codes(r: MNRun) -> str:
    return " ".join(f"{k}={'-' if v is None else v}{' (lost)' if k in r.lost else ''}"
                    for k, v in r.exit_codes.items())


def case_label(case: str, delay: float) -> str:
    return f"{case}: {CASES[case].format(delay=delay)}"


def table(runs: list[MNRun], delay: float = 3.0) -> str:
    """The printed table, markdown."""
    head = ("| case | launcher | exit codes | failed in step | restore step | redone mb | fail->resumed s "
            "| fail->caught up s | wall s | identical to ref |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        ident = "-" if r.identical is None else ("yes" if r.identical else "NO")
        if r.recovered():
            mid = (f"| {_f(r.restore_step, '{}')} | {_f(r.redone_minibatches, '{}')} | {_f(r.fail_to_resumed_s())} "
                   f"| {_f(r.fail_to_caught_up_s())} ")
        else:
            mid = f"| - | - | failed: {r.error} | - "
        rows.append(f"| {case_label(r.case, delay)} | {r.launcher} | {_codes(r)} | {_f(r.progress_step, '{}')} {mid}"
                    f"| {_f(r.wall_s, '{:.1f}')} | {ident} |")
    return "\n".join(rows)


def medians(runs: list[MNRun]) -> list[dict]:
    """Per case and launcher over the repetitions: how many recovered bit-identically, and the
    median (min, max) of fail->resumed, fail->caught up and (c) replacement start->resumed."""
    out = []
    for case in dict.fromkeys(r.case for r in runs if not is_ref(r.case)):
        for launcher in dict.fromkeys(r.launcher for r in runs if r.case == case):
            rs = [r for r in runs if r.case == case and r.launcher == launcher]
            row: dict = {"case": case, "launcher": launcher, "runs": len(rs),
                         "recovered_identical": sum(1 for r in rs if r.recovered() and r.identical)}
            for key, fn in (("fail_to_resumed", MNRun.fail_to_resumed_s),
                            ("fail_to_caught_up", MNRun.fail_to_caught_up_s),
                            ("replacement_to_resumed", MNRun.replacement_to_resumed_s)):
                xs = [x for r in rs if r.recovered() and (x := fn(r)) is not None]
                row[key] = ({"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
                            if xs else None)
            out.append(row)
    return out


def median_table(runs: list[MNRun], delay: float = 3.0) -> str:
    head = ("| case | launcher | recovered bit-identical | fail->resumed s | fail->caught up s "
            "| replacement start->resumed s |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]

    def cell(x: dict | None) -> str:
        return "-" if x is None else f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f}, n={x['n']})"

    for m in medians(runs):
        rows.append(f"| {case_label(m['case'], delay)} | {m['launcher']} | {m['recovered_identical']}/{m['runs']} "
                    f"| {cell(m['fail_to_resumed'])} | {cell(m['fail_to_caught_up'])} "
                    f"| {cell(m['replacement_to_resumed'])} |")
    return "\n".join(rows)


def ratio_table(runs: list[MNRun], delay: float = 3.0) -> str:
    head = ("| case | fail->resumed s jitrun | torchrun | jitrun/torchrun "
            "| fail->caught up s jitrun | torchrun | jitrun/torchrun |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for case, v in ratios(runs).items():
        cells = []
        for key in ("fail_to_resumed", "fail_to_caught_up"):
            x = v[key]
            rat = (_f(x["ratio"], "{:.3f}") if x["ratio"] is not None
                   else "- (" + ", ".join(v["not_recovered"]) + " did not recover)" if v["not_recovered"]
                   else "- (torchrun not run)")
            cells.append(f"{_f(x['jitrun_s'])} | {_f(x['torchrun_s'])} | {rat}")
        rows.append(f"| {case_label(case, delay)} | {' | '.join(cells)} |")
    return "\n".join(rows)


def details(runs: list[MNRun]) -> str:
    """jitrun's own recovery records, and the odd things worth a look."""
    out = []
    for r in runs:
        if r.launcher == "jitrun":
            for e in r.recovery:
                st = e.get("stages") or {}
                out.append(f"  {r.name:<12} events.jsonl recovery: failure->resumed {_f(e['failure_to_resumed_s'])}s "
                           f"(detection {_f(e['detection_s'])}s, checkpoint {_f(e['checkpoint_s'])}s, "
                           f"restart->resumed {_f(e['restart_to_resumed_s'])}s), restore step "
                           f"{e['restore_step']}, redone {e['redone_minibatches']}"
                           + "".join(f"; {k} {_f(st[k])}" for k in STAGES if k in st))
            if r.case == "a" and r.fault_t is not None and r.fault_t_estimate is not None:
                out.append(f"  {r.name:<12} torchrun's fault-time estimate (line of step F-1) is "
                           f"{(r.fault_t - r.fault_t_estimate) * 1e3:.0f} ms early here")
        if r.case in ("b", "e") and r.spare_started_t is not None and r.fault_t is not None:
            conn = (f", at the rendezvous endpoint {r.fault_t - r.spare_connected_t:.1f}s before it"
                    if r.spare_connected_t is not None else "")
            out.append(f"  {r.name:<12} spare started {r.fault_t - r.spare_started_t:.1f}s before the kill{conn}")
        if r.ec is not None:
            out.append(f"  {r.name:<12} EC: restored from {r.ec['source']} step {r.ec['step']} (k,m = {r.ec['k_m']}), "
                       f"lost node(s) {r.ec['lost']}; the test's assertions: "
                       + ("all hold" if not r.ec["problems"] else "FAILED: " + "; ".join(r.ec["problems"])))
        if r.launcher == "torchrun" and r.periodic_saves:
            out.append(f"  {r.name:<12} {r.periodic_saves} periodic checkpoints written (shared host directory)")
        if r.diffs:
            out.append(f"  {r.name:<12} state differs from ref: {', '.join(r.diffs[:3])}")
    return "\n".join(out)


def write_json(path: Path, args: dict, refs: list[MNRun], runs: list[MNRun], total_s: float | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)

    def rec(r: MNRun) -> dict:
        return {**asdict(r), "name": r.name, "wall_s": r.wall_s, "fail_to_resumed_s": r.fail_to_resumed_s(),
                "fail_to_caught_up_s": r.fail_to_caught_up_s(),
                "replacement_to_resumed_s": r.replacement_to_resumed_s(), "recovered": r.recovered()}

    ref = next((r for r in refs if r.case == "ref"), None)  # the 2-node world's; every one under "references"
    path.write_text(json.dumps({"args": args, "total_s": total_s, "reference": rec(ref) if ref else None,
                                "references": {r.name: rec(r) for r in refs}, "runs": [rec(r) for r in runs],
                                "ratios": ratios(runs), "medians": medians(runs)},
                               indent=1))


# -- the cold-start floor ---------------------------------------------------------
# What a replacement node cannot avoid before its first minibatch, whatever the launcher: a
# fresh interpreter importing torch and what DDP pulls in (DDP's constructor imports
# torch._dynamo). jitrun's warm-start server does exactly these imports (launcher/warm.py).
FLOOR_CODE = "import torch, torch.distributed, torch.nn.parallel, torch._dynamo"


def cold_start_floor(repeats: int = 3) -> dict:
    """Wall seconds of FLOOR_CODE in a fresh interpreter, ``repeats`` times, in this session
    (the machine as the runs find it), for the replacement column's comparison."""
    walls = []
    for _ in range(repeats):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", FLOOR_CODE], check=True, env={**os.environ, **BASE_ENV})
        walls.append(time.monotonic() - t0)
    return {"code": FLOOR_CODE, "median": statistics.median(walls), "min": min(walls), "max": max(walls),
            "n": len(walls)}


def floor_line(floor: dict, runs: list[MNRun]) -> str:
    reps = [x for r in runs if r.launcher == "jitrun" and (x := r.replacement_to_resumed_s()) is not None]
    line = (f"cold-start floor: a fresh interpreter's `{floor['code']}` took {floor['median']:.2f} s "
            f"(median of {floor['n']}, {floor['min']:.2f}-{floor['max']:.2f}) in this session")
    if reps:
        med = statistics.median(reps)
        line += (f"; jitrun's replacement start -> resumed {med:.2f} s (median of {len(reps)}), "
                 f"{med - floor['median']:.2f} s above that floor (its agent's own start, the rendezvous, "
                 f"the replica fetch, the worker's init, load and first minibatch)")
    return line


# -- running (namespaces) -----------------------------------------------------------


def _harness():
    sys.path.insert(0, str(REPO / "tests"))
    import netns

    return netns


def command(launcher: str, node, nodes0_addr: str, args, *, out: Path, jit: str, fault: bool,
            ckpt_dir: Path | None, rdzv_id: str, w: World) -> list[str]:
    train = [TRAIN, "--steps", str(w.steps), "--step-sleep", str(w.step_sleep), "--log-every", "1",
             "--out", str(out)]
    rdzv = ["--nnodes", str(w.nnodes), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{nodes0_addr}:{PORT}", "--rdzv-id", rdzv_id]
    py = sys.executable
    if launcher == "jitrun":
        return [py, "-m", "jitrun.cli", *rdzv, "--rdzv-conf", "keep_alive_interval=2", "--max-restarts", "3",
                "--jit-timeout", str(args.jit_timeout), "--jit-dir", jit, "--local-addr", node.addr,
                *w.jitrun_flags, *train]
    cmd = [py, "-m", "torch.distributed.run", *rdzv,
           "--rdzv-conf", f"is_host={int(node.index == 0)},keep_alive_interval=2", "--local-addr", node.addr]
    if ckpt_dir is not None:
        cmd += ["--max-restarts", "3"]
    if fault:
        cmd += ["-m", "jitckpt._bootstrap"]
    cmd += train
    if ckpt_dir is not None:
        cmd += ["--ckpt-every", str(args.ckpt_every), "--ckpt-dir", str(ckpt_dir)]
    return cmd


def run_one(case: str, launcher: str, args, work: Path, ref_out: Path | None, rep: int = 0) -> MNRun:
    """One job on a fresh cluster (2 nodes; d: 3); kills/starts nodes as ``case`` says."""
    netns = _harness()
    w = World.of(case, args)
    F = EC_KILL_AT if case in EC_CASES else args.fault_step
    run = MNRun(case=case, launcher=launcher, rep=rep, fault_step=None if is_ref(case) else F, cap_s=args.cap)
    d = work / run.name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    run.workdir = str(d)
    out = d / "final.pt"
    fault = case == "a"
    env = {**BASE_ENV, "JITCKPT_FAULT": f"rank=1,step={F},phase=backward,kind=sigkill" if fault else ""}
    if case in EC_CASES:  # as the test: every agent but a replacement's; node 2 is lost instead of its rank's fault
        env["JITCKPT_FAULT"] = ";".join(f"rank={r},step={F},phase=forward,kind=sigkill" for r in (0, 1))
    victim, kill_after = (2, F - 1) if case in EC_CASES else (1, F)  # node; rank 0's step line that triggers the kill
    if launcher == "torchrun":
        env["GLOO_SOCKET_IFNAME"] = "eth0"
    lines: list[tuple[float, str, str]] = []
    with netns.Cluster(w.nnodes, tag="b") as c:
        jit = str(c.dir / "jit")
        procs, tails = {}, {}

        def start(node, agent: str) -> float:
            cmd = command(launcher, node, c.nodes[0].addr, args, out=out, jit=jit, fault=fault,
                          ckpt_dir=None if is_ref(case) else d / "ckpt", rdzv_id=f"bench{case}", w=w)
            jitrun = launcher == "jitrun"
            keep = ((f"{jit}/events.jsonl", str(d / f"events-{agent}.jsonl")),) if jitrun else ()
            node_env = {**env, "JITCKPT_FAULT": ""} if agent == "replacement" else env
            p = node.run(cmd, name=agent, env=node_env, private_dirs=(jit,) if jitrun else (), keep=keep)
            procs[agent], tails[agent] = p, Tail(agent, p.log)
            return time.time()

        run.t_start = start(c.nodes[0], "agent0")
        for i in range(1, w.nnodes):
            start(c.nodes[i], f"agent{i}")
        deadline = time.monotonic() + args.cap
        seen = -1  # the highest step rank 0 printed before the failure
        next_probe = 0.0
        while True:
            for tl in tails.values():
                for item in tl.read():
                    lines.append(item)
                    if args.verbose:
                        print(f"  {item[0]:.3f} {item[1]:<11} {item[2]}", flush=True)
                    if run.fault_t is None and (m := STEP_RE.match(item[2])):
                        seen = max(seen, int(m.group(1)))
            if case in ("b", "e") and time.monotonic() >= next_probe:
                # the spare starts once the job's first round is complete and
                # counts as waiting 1 s after its agent reached the endpoint
                next_probe = time.monotonic() + 0.2
                if run.spare_started_t is None and (seen >= 0 or round_complete(c.nodes[1], c.nodes[0].addr,
                                                                                 PORT)):
                    run.spare_started_t = start(c.add_node(), "spare")
                elif run.spare_connected_t is None and run.spare_started_t is not None and rdzv_connected(
                        c.nodes[w.nnodes], c.nodes[0].addr, PORT):
                    run.spare_connected_t = time.time()
            spare_ready = case not in ("b", "e") or (run.spare_connected_t is not None
                                          and time.time() - run.spare_connected_t >= SPARE_SETTLE_S)
            if case in ("b", "c", "d", "e") and run.fault_t is None and seen >= kill_after and spare_ready:
                run.fault_t, run.fault_source = time.time(), f"node {victim} killed"
                c.nodes[victim].kill()
                run.lost = [f"agent{victim}"]
            if (case in ("c", "d") and run.fault_t is not None and run.replacement_started_t is None
                    and time.time() - run.fault_t >= (EC_REPLACE_DELAY if case == "d" else args.replace_delay)):
                run.replacement_started_t = start(c.add_node(), "replacement")
            if all(p.popen.poll() is not None for p in procs.values()):
                break
            if time.monotonic() > deadline:
                run.timed_out = True
                for node in c.nodes:
                    node.kill()  # every process of this run, by PID (ip netns pids)
                break
            time.sleep(POLL_S)
        run.t_end = time.time()  # the last agent seen gone (or the kill at the cap)
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except Exception:
                pass
        for tl in tails.values():
            lines.extend(tl.read(final=True))
        run.exit_codes = {k: p.popen.returncode for k, p in procs.items()}
        logs = {k: p.output() for k, p in procs.items()}
        for k, text in logs.items():
            (d / f"{k}.log").write_text(text)
    (d / "lines.log").write_text("".join(f"{t:.6f} {src} {line}\n" for t, src, line in lines))
    (d / "meta.json").write_text(json.dumps({k: getattr(run, k) for k in RAW}))
    analyse(run, lines, _events(d))
    if not is_ref(case) and ref_out is not None and run.error is None:
        compare(run, ref_out, out)
    return run


# what a run records before analysis: enough for --reparse
RAW = ("case", "launcher", "rep", "fault_step", "exit_codes", "lost", "timed_out", "cap_s", "t_start", "t_end",
       "fault_t", "fault_source", "spare_started_t", "spare_connected_t", "replacement_started_t", "workdir")


def _events(d: Path) -> list[dict]:
    events = []
    for f in sorted(d.glob("events-*.jsonl")):
        events += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return sorted(events, key=lambda e: e["t"])


def load_run(d: Path) -> MNRun:
    """A kept run (--keep) analysed again."""
    run = MNRun(**json.loads((d / "meta.json").read_text()))
    lines = []
    for raw in (d / "lines.log").read_text().splitlines():
        t, src, line = (raw.split(" ", 2) + ["", ""])[:3]
        lines.append((float(t), src, line))
    analyse(run, lines, _events(d))
    if not is_ref(run.case) and run.error is None:
        compare(run, d.parent / ref_for(run.case) / "final.pt", d / "final.pt")
    return run


def report(args, refs: list[MNRun], runs: list[MNRun], total: float | None) -> int:
    """Print the tables and notes, write the JSON; 1 if jitrun did not
    recover every case bit-identically (d: or an assertion of its test failed)."""
    print()
    for ref in refs:
        print(f"reference {ref.name} (plain torchrun, no failure{', 3 nodes' if ref.case == 'ref-d' else ''}): "
              f"wall {_f(ref.wall_s, '{:.1f}')}s, last step {ref.last_step}"
              f"{'  ERROR ' + ref.error if ref.error else ''}")
    print()
    print(table(runs, args.replace_delay))
    print()
    if getattr(args, "repeats", 1) > 1:  # callers building their own Namespace have none
        print(median_table(runs, args.replace_delay))
        print()
    if {r.launcher for r in runs} == set(LAUNCHERS):
        print(ratio_table(runs, args.replace_delay))
    extra = details(runs)
    if extra:
        print("\n" + extra)
    if getattr(args, "cold_start_floor", None):
        print("\n" + floor_line(args.cold_start_floor, runs))
    print(f"\nfault: a/jitrun the fault_injected event, a/torchrun the arrival of step {args.fault_step - 1}'s "
          f"line; b, c: the moment node 1 was killed; d: the first of node 2's kill and the ranks' "
          f"fault_injected. fail->resumed: fault -> the first step line after the "
          f"restart; fail->caught up: fault -> the line of the failed step after the restart (includes the "
          f"redone minibatches).")
    print(f"torchrun's periodic checkpoints (every {args.ckpt_every} steps) go to a host directory every node "
          f"sees (shared storage, as in practice); jitrun keeps its checkpoints on each node's own tmpfs. torchrun "
          f"2.13 is known not to recover b/c (its c10d rendezvous does not republish MASTER_ADDR for a later "
          f"round); each run is capped at {args.cap:g}s.")
    print("noise: shared 2-core machine; absolute seconds vary by tens of percent between runs.")
    if total is not None:
        print(f"total {total:.0f}s")
    if args.json:
        write_json(Path(args.json), vars(args), refs, runs, total)
        print(f"data: {args.json}")
    bad = [r.name for r in runs if r.launcher == "jitrun"
           and not (r.recovered() and r.identical and not (r.ec or {}).get("problems"))]
    if bad:
        print(f"jitrun did not recover bit-identically: {', '.join(bad)}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="a,b,c", help="which cases (a: killed rank, b: lost node + hot spare, "
                    "c: lost node + late replacement, d: 3 nodes + EC 2+1, node lost, replacement, "
                    "e: d with a hot spare; d and e jitrun only)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--fault-step", type=int, default=47, help="F: a kills rank 1 in step F's backward pass; "
                    "b and c kill node 1 when rank 0 has printed step F")
    ap.add_argument("--ckpt-every", type=int, default=10, help="torchrun's periodic checkpoint interval, steps")
    ap.add_argument("--jit-timeout", type=float, default=5.0)
    ap.add_argument("--replace-delay", type=float, default=3.0, help="c: seconds from the kill to the replacement")
    ap.add_argument("--cap", type=float, default=150.0, help="seconds before a run is killed and counted failed")
    ap.add_argument("--json", default=None, help="raw measurements (default build/bench/multinode.json; '' = none)")
    ap.add_argument("--publish", action="store_true", help="write the JSON to bench_results/ instead")
    ap.add_argument("--keep", default=None, help="keep each run's logs and events in this directory")
    ap.add_argument("--quick", action="store_true", help="cases a and c only, 60 steps, F=27, cap 100 s")
    ap.add_argument("--reparse", default=None, metavar="DIR", help="analyse the runs kept by --keep DIR again")
    ap.add_argument("-v", "--verbose", action="store_true", help="echo every line as it is read")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every case (medians table when > 1)")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS), help="which launchers (default jitrun,torchrun)")
    args = ap.parse_args(argv)
    launchers = tuple(x for x in LAUNCHERS if x in args.launchers.split(","))
    if not launchers or args.repeats < 1:
        ap.error("--launchers needs jitrun and/or torchrun; --repeats at least 1")
    if args.quick:
        args.cases, args.steps, args.fault_step, args.cap = "a,c", 60, 27, 100.0
    cases = [x.strip() for x in args.cases.split(",") if x.strip()]
    if bad := [x for x in cases if x not in CASES]:
        ap.error(f"unknown case(s) {bad}; choose from {', '.join(CASES)}")
    if not 1 <= args.fault_step < args.steps - 1:
        ap.error("--fault-step must leave steps after it")
    if args.json is None:
        args.json = str((PUBLISHED_DIR if args.publish else OUT_DIR) / "multinode.json")
    if args.reparse:
        work = Path(args.reparse).resolve()
        found = {p.name: load_run(p) for p in sorted(work.iterdir()) if (p / "meta.json").exists()}
        refs = [found.pop(n) for n in ("ref", "ref-d") if n in found]
        if not refs:
            ap.error(f"--reparse: no kept reference run under {work}")
        runs = sorted(found.values(), key=lambda r: (r.case, LAUNCHERS.index(r.launcher), r.rep))
        return report(args, refs, runs, None)
    why = _harness().Cluster.unavailable()
    if why:
        print(f"bench_multinode: cannot run: {why}", file=sys.stderr)
        return 2
    t0 = time.time()
    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="jitckpt-bench-mn-"))
    work.mkdir(parents=True, exist_ok=True)
    print("demo LM, network namespaces, gloo, CPU; "
          + (f"2 nodes x 1 rank, {args.steps} steps, --step-sleep {args.step_sleep}; F = {args.fault_step}; "
             f"torchrun: periodic checkpoint every {args.ckpt_every} steps to a directory shared by all nodes; "
             if set(cases) - set(EC_CASES) else "")
          + (f"d: 3 nodes x 1 rank, {EC_STEPS} steps, --step-sleep {EC_SLEEP}, {' '.join(EC_FLAGS)}, F = "
             f"{EC_KILL_AT}; " if set(cases) & set(EC_CASES) else "") + f"cap {args.cap:g}s per run", flush=True)
    runs: list[MNRun] = []
    refs: list[MNRun] = []
    try:
        for name in dict.fromkeys(ref_for(c) for c in cases):
            refs.append(ref := run_one(name, "torchrun", args, work, None))
            print(f"  ran {name:<12} wall {_f(ref.wall_s, '{:.1f}')}s"
                  f"{'  ERROR ' + ref.error if ref.error else ''}", flush=True)
            if ref.error or not (work / name / "final.pt").exists():
                print(f"reference run failed: {ref.error}; logs in {work / name}", file=sys.stderr)
                return 1
        if {"c", "d"} & set(cases):  # the replacement cases: measured here, before the runs, with the machine as idle
            args.cold_start_floor = cold_start_floor()
            print(f"  cold-start floor {args.cold_start_floor['median']:.2f}s", flush=True)
        for k, (rep, case) in enumerate((rep, case) for rep in range(args.repeats) for case in cases):
            for launcher in (launchers if k % 2 else launchers[::-1]):  # torchrun first, then alternating
                if case in EC_CASES and launcher == "torchrun":
                    if rep == 0:
                        print(f"  skip {case}-torchrun: torchrun has no erasure-coded in-memory snapshots ({case} "
                              "is jitrun's --jit-ec-every)", flush=True)
                    continue
                r = run_one(case, launcher, args, work, work / ref_for(case) / "final.pt", rep)
                runs.append(r)
                print(f"  ran {r.name:<12} wall {_f(r.wall_s, '{:.1f}')}s"
                      f"{'  failed: ' + r.error if r.error else ''}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    order = {c: i for i, c in enumerate(cases)}
    runs.sort(key=lambda r: (order[r.case], LAUNCHERS.index(r.launcher), r.rep))
    return report(args, refs, runs, time.time() - t0)

if __name__ == "__main__":
    sys.exit(main())
