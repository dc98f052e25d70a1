#!/usr/bin/env python3
"""In-place recovery (JITCKPT_ON_HANG=recover) on the stand-in: recovery time
split by stage for 2, 3 and 4 ranks, against the restart path.

For each world size and fault kind, the `dp` test program (tests/intercept/
shim_progs/dp.c: compute + NCCL stream, H2D, gradient kernel, grouped
all-reduce, optimizer with state) runs 8 steps against a torch TCPStore with
one fault injected at step 3's gradient all-reduce:
  hang        JITSIM_HANG_AT on one rank (detected by the timeout)
  sync_error  JITSIM_NCCL_ERROR_AT on one rank (returned by the call)
  async_error the same with JITSIM_NCCL_ERROR_ASYNC=1
Each rank writes one shim_recovery line (JITCKPT_SHIM_EVENTS). Reported per
run (max over ranks): detection lag past the timeout, abort (+ drain), agree
(store rendezvous of the epoch), re-init (streams/events/communicators),
replay, and `recovery - timeout` = the time from the fault to the job going
on again minus the timeout (for a hang: waited - timeout + total; for errors:
total, there is no timeout in the path). Final buffers are checked against a
failure-free run.

Restart path, same program, same fault, both under jitrun (--no-python
--jit-intercept on), from jitrun's timeline: detection -> job end, for (a) the
default in-place recovery (detection = the in_place_recovery record's t minus
its total_s) and (b) JITCKPT_ON_HANG=exit with --max-restarts 1 (detection =
the first worker_exit: every rank exits 75 at detection; jitrun restarts the
job, which redoes its steps: dp has no checkpoint). Both include the steps
after the fault. The stand-in program starts in milliseconds (no Python, no
model), so this restart path is a floor of a real one. Also printed: the
restart floor without jitrun (exit run + fresh processes to the faulted step).

  python3 scripts/bench_transparent.py [--ranks 2 3 4] [--repeat 3] [--init-ms MS] [--python] [--json out.json]

--python adds the same comparison with Python workers (tests/intercept/dp_torch.py drives dp.c's
steps through ctypes from a torch script with no jitckpt code): there the restart path is real
(fresh processes import Python, torch and jitckpt again; warm start is off with the shim).

--init-ms gives every dp process that much start-up work (DP_INIT_MS: what a
real job's imports, data preparation and model construction cost a restart);
default 0, the stand-in's bare floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "intercept" / "shim_progs"))
import dpjob  # noqa: E402
import shimtest as st  # noqa: E402

STEPS = 8
FAULT_STEP = 3
TIMEOUT = 1.0
OP = str(2 * FAULT_STEP + 1)  # NCCL op number of step 3's gradient all-reduce


def faults(n: int) -> dict[str, dict]:
    victim = n - 1
    return {
        "hang": dict(JITSIM_HANG_AT=OP, JITSIM_HANG_RANK=str(victim)),
        "sync_error": dict(per_rank_env={victim: dict(JITSIM_NCCL_ERROR_AT=OP)}),
        "async_error": dict(per_rank_env={victim: dict(JITSIM_NCCL_ERROR_AT=OP, JITSIM_NCCL_ERROR_ASYNC="1")}),
    }


def one(tmp: Path, n: int, kind: str, base: dict) -> dict:
    r = dpjob.run(tmp, n, STEPS, JITCKPT_TIMEOUT=str(TIMEOUT), **faults(n)[kind])
    ok = all(c == 0 for c in r["rc"].values()) and all(r["buf"][i] == base["buf"][i] for i in range(n))
    ev = [e for e in r["events"] if e["event"] == "shim_recovery"]
    if not ok or len(ev) != n or any(e["outcome"] != "recovered" for e in ev):
        raise SystemExit(f"{kind} n={n}: not recovered in place: rc={r['rc']} events={ev}")
    stage = {k: max(e[k] for e in ev) for k in ("abort_s", "agree_s", "reinit_s", "replay_s", "total_s")}
    if kind == "hang":
        hangs = [e for e in ev if e["fault"] == "hang"]
        stage["detect_lag_s"] = max(e["waited_s"] - TIMEOUT for e in hangs)
        stage["recovery_minus_timeout_s"] = max(e["waited_s"] - TIMEOUT + e["total_s"] for e in hangs)
    else:
        stage["detect_lag_s"] = 0.0
        stage["recovery_minus_timeout_s"] = stage["total_s"]
    stage["replayed"] = max(e["replayed"] for e in ev)
    return stage


def restart(tmp: Path, n: int) -> float:
    t = dpjob.run(tmp / "exit", n, STEPS, JITCKPT_TIMEOUT=str(TIMEOUT), JITCKPT_ON_HANG="exit",
                  **faults(n)["hang"])
    if not all(c == 75 for c in t["rc"].values()):
        raise SystemExit(f"restart path n={n}: expected exit 75 everywhere, got {t['rc']}")
    t0 = time.monotonic()
    f = dpjob.run(tmp / "fresh", n, FAULT_STEP + 1, JITCKPT_ON_HANG="exit")
    fresh = time.monotonic() - t0
    if not all(c == 0 for c in f["rc"].values()):
        raise SystemExit(f"fresh run n={n} failed: {f['rc']}")
    return (t["wall"] - TIMEOUT) + fresh


def jitrun_after_detection(tmp: Path, n: int, restarts: int = 0, python: bool = False, **env: str) -> float:
    """Seconds from detection to jitrun's job_end (see the module doc). With
    ``python`` the workers are tests/intercept/dp_torch.py: the same steps
    driven from a torch script, so a restart pays a real Python + torch start."""
    import subprocess  # noqa: PLC0415

    tmp.mkdir(parents=True, exist_ok=True)
    e = st.env(preload=False)
    e["JITCKPT_INTERCEPT_LIB"] = str(st.SHIM)
    e.update(env)
    jr = Path(sys.executable).parent / "jitrun"
    prog = ([str(REPO / "tests" / "intercept" / "dp_torch.py"), str(st.PROGS / "dp.so"), str(STEPS)] if python
            else ["--no-python", str(st.PROGS / "dp"), "-", "-", str(STEPS)])
    cmd = [str(jr), "--nproc-per-node", str(n), "--jit-intercept", "on", "--jit-timeout", str(TIMEOUT),
           "--max-restarts", str(restarts), "--jit-dir", str(tmp / "jit"), *prog, str(tmp)]
    p = subprocess.run(cmd, env=e, cwd=tmp, capture_output=True, text=True, timeout=180)
    if p.returncode != 0 or p.stdout.count("FINAL") != n:
        raise SystemExit(f"jitrun n={n} env={env}: rc={p.returncode}\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    evs = [json.loads(x) for x in (tmp / "jit" / "events.jsonl").read_text().splitlines() if x.strip()]
    end = max(e["t"] for e in evs if e["event"] == "job_end")
    rec = [e for e in evs if e["event"] == "in_place_recovery"]
    if rec:
        return end - (rec[0]["t"] - rec[0]["total_s"])
    # detection: the first rank exiting 75 (C program) or reporting it (jitckpt's hang handler)
    return end - min(e["t"] for e in evs if e["event"] in ("worker_exit", "failure_detected"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--init-ms", type=int, default=0)
    ap.add_argument("--python", action="store_true",
                    help="also the same steps in Python workers (tests/intercept/dp_torch.py): a real restart path")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    os.environ["DP_INIT_MS"] = str(a.init_ms)  # inherited by every dp process (st.env copies os.environ)
    st.build()
    out: dict = {"timeout_s": TIMEOUT, "steps": STEPS, "fault_step": FAULT_STEP, "init_ms": a.init_ms, "runs": {}}
    cols = ("detect_lag_s", "abort_s", "agree_s", "reinit_s", "replay_s", "recovery_minus_timeout_s")
    print(f"{'ranks':>5} {'fault':>11} " + " ".join(f"{c[:-2]:>14}" for c in cols) + f" {'replayed':>8}")
    with tempfile.TemporaryDirectory(prefix="bench_transparent.") as d:
        root = Path(d)
        for n in a.ranks:
            base = dpjob.run(root / f"base{n}", n, STEPS)
            assert all(c == 0 for c in base["rc"].values()), base["rc"]
            for kind in ("hang", "sync_error", "async_error"):
                runs = [one(root / f"{kind}{n}.{i}", n, kind, base) for i in range(a.repeat)]
                med = {c: statistics.median(r[c] for r in runs) for c in cols}
                out["runs"][f"{n}/{kind}"] = {"median": med, "all": runs}
                print(f"{n:>5} {kind:>11} " + " ".join(f"{med[c]:>14.4f}" for c in cols)
                      + f" {runs[0]['replayed']:>8}")
            inplace = out["runs"][f"{n}/hang"]["median"]["recovery_minus_timeout_s"]
            floor = statistics.median(restart(root / f"restart{n}.{i}", n) for i in range(a.repeat))
            hang = faults(n)["hang"]
            ip = [jitrun_after_detection(root / f"jr_ip{n}.{i}", n, **hang) for i in range(a.repeat)]
            rs = [jitrun_after_detection(root / f"jr_rs{n}.{i}", n, restarts=1, JITCKPT_ON_HANG="exit",
                                         DP_FAULTS_FIRST_ATTEMPT="1", **hang) for i in range(a.repeat)]
            ipm, rsm = statistics.median(ip), statistics.median(rs)
            out["runs"][f"{n}/jitrun"] = {
                "in_place_detection_to_end_s": ip, "restart_detection_to_end_s": rs,
                "restart_floor_without_jitrun_s": floor, "ratio": rsm / max(ipm, 1e-9),
                "in_place_recovery_minus_timeout_s": inplace}
            print(f"{n:>5} jitrun, detection -> job end: in place {ipm:.3f} s, restart path {rsm:.3f} s "
                  f"({rsm / max(ipm, 1e-9):.1f}x; the shim's own recovery - timeout: {inplace:.3f} s); "
                  f"restart floor without jitrun {floor:.3f} s")
            if a.python:
                # The restart a Python worker really pays on the GPU path: fresh processes
                # (no warm start with the shim), Python, torch and jitckpt imported again.
                pip = [jitrun_after_detection(root / f"py_ip{n}.{i}", n, python=True, **hang)
                       for i in range(a.repeat)]
                prs = [jitrun_after_detection(root / f"py_rs{n}.{i}", n, restarts=1, python=True,
                                              JITCKPT_ON_HANG="exit", DP_FAULTS_FIRST_ATTEMPT="1", **hang)
                       for i in range(a.repeat)]
                pim, prm = statistics.median(pip), statistics.median(prs)
                out["runs"][f"{n}/jitrun_python"] = {"in_place_detection_to_end_s": pip,
                                                     "restart_detection_to_end_s": prs,
                                                     "ratio": prm / max(pim, 1e-9)}
                print(f"{n:>5} jitrun, Python workers (dp_torch.py), detection -> job end: in place {pim:.3f} s, "
                      f"restart path {prm:.3f} s ({prm / max(pim, 1e-9):.1f}x)")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
