"""`make demo`: train the demo transformer LM with 2 ranks under jitrun, kill one
rank mid-run, then stop one (SIGSTOP) after the recovery, and show that the
final weights and optimizer state equal a failure-free torchrun run bit for bit.

Outputs under ./demo_runs/ (recreated on every run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare_state import diff_states  # noqa: E402

STEPS = 60
TRAIN = [str(HERE / "demo_train.py"), "--steps", str(STEPS), "--log-every", "10"]


# Noise for this demo, not errors: torch's C++ warnings (DDP's advice about
# find_unused_parameters, which the trainer sets on purpose for restart-stable
# bucketing; c10d's "hostname of the client socket cannot be retrieved" on hosts
# without reverse DNS) and torchrun's OMP_NUM_THREADS banner (it sets 1 anyway).
# C++ errors and every Python-side message still show; an explicit setting wins.
QUIET = {"TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}


def run(cmd: list[str], env: dict | None = None) -> float:
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, env={**QUIET, **os.environ, **(env or {})})
    return time.time() - t0


def main() -> int:
    out = Path("demo_runs").resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    py = sys.executable
    quiet = [k for k in QUIET if k not in os.environ]
    if quiet:
        print(f"(demo env: {' '.join(f'{k}={QUIET[k]}' for k in quiet)}; set TORCH_CPP_LOG_LEVEL=WARNING "
              "to see torch's C++ warnings)", flush=True)
    print("== 1. reference: plain torchrun, no failure ==", flush=True)
    run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         *TRAIN, "--out", str(out / "reference.pt")])

    print("\n== 2. jitrun with two injected failures ==", flush=True)
    fault = ("rank=1,step=20,phase=backward,kind=sigkill;"
             "rank=1,step=40,phase=allreduce,kind=sigstop,attempt=1")
    print(f"JITCKPT_FAULT={fault}", flush=True)
    # no --jit-timeout: the stopped rank is found by the hang bound learned from the run's own timing
    run([py, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
         "--jit-dir", str(out / "jit"), *TRAIN, "--out", str(out / "recovered.pt")],
        env={"JITCKPT_FAULT": fault})

    print("\n== 3. timeline (demo_runs/jit/events.jsonl) ==")
    events = [json.loads(line) for line in (out / "jit" / "events.jsonl").read_text().splitlines()]
    for e in events:
        if e["event"] == "recovery":
            print(f"  failure at step {e['progress_step']}: failure->resumed {e['failure_to_resumed_s']:.2f}s "
                  f"(detection {e['detection_s']:.2f}s, checkpoint {e['checkpoint_s']:.2f}s, "
                  f"restart->resumed {e['restart_to_resumed_s']:.2f}s), resumed at step {e['restore_step']}, "
                  f"redone minibatches: {e['redone_minibatches']}")

    print("\n== 4. proof ==")
    n, diffs = diff_states(str(out / "reference.pt"), str(out / "recovered.pt"))
    if diffs:
        print("FAIL: recovered state differs from the reference:\n  " + "\n  ".join(diffs[:20]))
        return 1
    print(f"OK: final model and optimizer state identical to the failure-free run ({n} entries, bit for bit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
