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


def test_agent_gets_only_the_shutdown_keyword_its_torch_knows() -> None:
    """launch.py builds the agent with these keywords: each must be a parameter of this torch's agent."""
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher.api import LaunchConfig

    from jitckpt.torch_compat import agent_shutdown_kwargs

    kw = agent_shutdown_kwargs(LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2))
    params = inspect.signature(LocalElasticAgent.__init__).parameters
    assert set(kw) <= set(params), (kw, list(params))
    assert ("shutdown_timeout" in params) == ("shutdown_timeout" in kw)  # passed wherever torch has it


def test_master_port_not_given_is_none_on_every_version(monkeypatch) -> None:
    """jitrun's bare form must be told from an explicit port (torch 2.11 defaults it to 29500)."""
    from torch.distributed.run import get_args_parser

    from jitckpt.torch_compat import unset_master_port_default

    monkeypatch.delenv("PET_MASTER_PORT", raising=False)
    p = get_args_parser()
    unset_master_port_default(p)
    assert p.parse_args(["--nproc-per-node", "2", "train.py"]).master_port is None
    assert p.parse_args(["--master-port", "29500", "train.py"]).master_port == 29500
    monkeypatch.setenv("PET_MASTER_PORT", "29511")  # torchrun reads its options from PET_* too
    p = get_args_parser()
    unset_master_port_default(p)
    assert int(p.parse_args(["train.py"]).master_port) == 29511
