"""Worker of test_torchrun_stale_peers.py: pytorch/examples' ddp-tutorial-series
script (scripts/examples/multigpu_torchrun.py) with a fault and a slow restart.

* attempt 0 (TORCHELASTIC_RESTART_COUNT=0): rank 1 SIGKILLs itself right after
  its optimizer step STALE_KILL_AFTER (default 5);
* later attempts: rank 1 is the slow rank of the restart, as a rank that
  takes longer to come back is: it calls init_process_group only STALE_DELAY
  seconds (default 2) after rank 0 has called it (rank 0 leaves a marker file
  in the working directory just before), so rank 0 always reaches gloo's
  full-mesh connect first and looks up rank 1's address in the store while
  only an earlier attempt's entry is there.

It also shows the mechanism without depending on gloo: in attempt 0 rank 1
writes a key through the env:// rendezvous store (the store init_process_group
gets); in attempt 1 rank 0 looks for it before its own init_process_group and
prints whether the previous attempt's keys are visible.

    torchrun --standalone --nproc-per-node 2 tests/torchrun_stale_peers_worker.py 2 10 --out final.pt
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "examples" / "multigpu_torchrun.py"

rank = int(os.environ["RANK"])
attempt = int(os.environ.get("JITCKPT_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0")

KEY = "stale-peers/written-by-rank1-attempt0"


# Only when the agent hosts the store (the default): otherwise rank 0 hosts it itself, in init_process_group,
# and a probe before that would start a second server on its port.
PROBE = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _env_store():
    store, _, _ = next(dist.rendezvous("env://"))  # the store init_process_group("env://") is handed
    return store


if rank == 1 and attempt == 0:
    if PROBE:
        _env_store().set(KEY, b"1")
    kill_after = int(os.environ.get("STALE_KILL_AFTER", "5"))
    steps = [0]

    def _kill_after_step(opt, args, kwargs) -> None:
        steps[0] += 1
        if steps[0] == kill_after:
            print(f"[stale-peers] rank 1: SIGKILL after optimizer step {kill_after}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(_kill_after_step)

if attempt >= 1:
    marker = Path(f"stale-peers-rank0-attempt{attempt}")
    delay = float(os.environ.get("STALE_DELAY", "2"))
    _init = dist.init_process_group

    def _ordered_init(*args, **kwargs):
        if rank == 0:
            seen = _env_store().check([KEY]) if PROBE else "n/a (no agent store)"
            print(f"[stale-peers] rank 0, attempt {attempt}: previous attempt's keys visible: {seen}", flush=True)
            marker.touch()
        else:
            while not marker.exists():
                time.sleep(0.05)
            print(f"[stale-peers] rank {rank}, attempt {attempt}: init_process_group {delay}s after rank 0's",
                  flush=True)
            time.sleep(delay)
        return _init(*args, **kwargs)

    dist.init_process_group = _ordered_init  # the script imports it by name when it runs

sys.argv = [str(SCRIPT), *sys.argv[1:]]
runpy.run_path(str(SCRIPT), run_name="__main__")
