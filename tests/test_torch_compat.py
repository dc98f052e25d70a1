"""jitckpt.torch_compat against the installed torch (make test-compat runs this file for each version of the range)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One gloo rank, a second group beside the default one, and the call site that
# arms the timeouts once training starts. Any warning is an error inside the call:
# torch 2.14 deprecates the old setter with a FutureWarning at every call.
ARM = r"""
import json, sys, tempfile, warnings
from datetime import timedelta
import torch, torch.distributed as dist
from jitckpt import hooks
path = tempfile.mktemp(prefix="jitckpt-compat-")
dist.init_process_group("gloo", init_method="file://" + path, rank=0, world_size=1)
sub = dist.new_group([0])
with warnings.catch_warnings():
    warnings.simplefilter("error")
    hooks._arm_timeouts(timedelta(seconds=7))
cpu = torch.device("cpu")
out = [pg._get_backend(cpu).options._timeout.total_seconds() for pg in (dist.group.WORLD, sub)]
dist.destroy_process_group()
print(json.dumps({"torch": torch.__version__, "timeouts": out}))
"""


def test_arm_timeouts_sets_every_group_without_deprecation() -> None:
    p = subprocess.run([sys.executable, "-c", ARM], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["timeouts"] == [7.0, 7.0], got
