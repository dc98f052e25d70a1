"""Failure -> resumed for a Hugging Face Trainer job (tests/hf_train.py: a 2-layer GPT-2, 2 ranks,
``callbacks=[JitCallback()]``) under the bare ``jitrun --nproc-per-node 2``, with and without
the warm-start server preloading what the first attempt's workers imported
(``JITRUN_NO_WARM_IMPORTS=1`` turns that off), runs interleaved.

Rank 1 is SIGKILLed at step ``--fault-step``; each step sleeps ``--step-sleep`` s so that the
first attempt runs long enough for the preloading server to finish its imports (it starts at
the first minibatch). Times come from jitrun's recovery event (events.jsonl).

    .venv/bin/python scripts/bench_hf_restart.py [--pairs 2] [--fault-step 60] [--step-sleep 0.2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(warm: bool, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as d:
        jit = Path(d) / "jit"
        env = {**os.environ, "JITCKPT_FAULT": f"rank=1,step={a.fault_step},phase=forward,kind=sigkill"}
        env.pop("JITRUN_NO_WARM_IMPORTS", None)
        if not warm:
            env["JITRUN_NO_WARM_IMPORTS"] = "1"
        cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--max-restarts", "2",
               "--jit-dir", str(jit), str(ROOT / "tests" / "hf_train.py"), "--out", d, "--mode", "jit",
               "--step-sleep", str(a.step_sleep)]
        cp = subprocess.run(cmd, env=env, cwd=d, capture_output=True, text=True, timeout=900)
        if cp.returncode != 0:
            raise SystemExit(f"bench_hf_restart: the job failed (exit {cp.returncode}):\n{cp.stdout[-3000:]}"
                             f"{cp.stderr[-3000:]}")
        events = [json.loads(line) for line in (jit / "events.jsonl").read_text().splitlines()]
    rec = [e for e in events if e["event"] == "recovery"]
    if len(rec) != 1:
        raise SystemExit(f"bench_hf_restart: expected one recovery, got {len(rec)}")
    used = any(e["event"] == "warm_imports" and e.get("used") for e in events)
    r = rec[0]
    return {"warm": warm, "used": used, "failure_to_resumed_s": r["failure_to_resumed_s"],
            "restart_to_resumed_s": r["restart_to_resumed_s"],
            "import_and_init_s": r.get("stages", {}).get("import_and_init")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--fault-step", type=int, default=60)
    ap.add_argument("--step-sleep", type=float, default=0.2)
    a = ap.parse_args()
    runs = []
    for i in range(a.pairs):
        for warm in ((True, False) if i % 2 == 0 else (False, True)):
            r = _run(warm, a)
            runs.append(r)
            print(f"pair {i} {'with   ' if warm else 'without'} warm imports: failure->resumed "
                  f"{r['failure_to_resumed_s']:.2f} s (restart->resumed {r['restart_to_resumed_s']:.2f} s, "
                  f"import+init {r['import_and_init_s']:.2f} s){'' if r['used'] == warm else '  [server not used]'}",
                  flush=True)
    for warm in (True, False):
        xs = [r["failure_to_resumed_s"] for r in runs if r["warm"] is warm]
        print(f"{'with' if warm else 'without'} warm imports: median failure->resumed {statistics.median(xs):.2f} s "
              f"over {len(xs)} ({min(xs):.2f}-{max(xs):.2f})")


if __name__ == "__main__":
    main()
