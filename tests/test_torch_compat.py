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


def _resolve(dotted: str):
    """A module, or an attribute path inside one (``pkg.mod.Class``)."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(dotted)


def test_every_private_name_the_door_uses_is_in_this_torch() -> None:
    """The list in jitckpt.torch_compat, resolved here: a torch that renamed one fails
    here, not in a worker at its first failure. Instance fields (set in __init__) are
    found on an instance's class's __init__ source."""
    import inspect

    from jitckpt.torch_compat import PRIVATE

    missing = []
    for where, names in PRIVATE.items():
        obj = _resolve(where)
        init = inspect.getsource(obj.__init__) if inspect.isclass(obj) and "__init__" in vars(obj) else ""
        missing += [f"{where}.{n}" for n in names if not hasattr(obj, n) and f"self.{n} " not in init
                    and f"self.{n}:" not in init]
    assert not missing, missing


def test_the_agent_overrides_are_this_torchs_agent_internals() -> None:
    """What launcher/agent.py overrides of LocalElasticAgent, or reads of it, exists in this torch:
    a method, or a field its constructors set."""
    import inspect

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from jitckpt.torch_compat import AGENT_OVERRIDES

    inits = inspect.getsource(SimpleElasticAgent.__init__) + inspect.getsource(LocalElasticAgent.__init__)
    missing = [n for n in AGENT_OVERRIDES if not hasattr(LocalElasticAgent, n) and f"self.{n}" not in inits]
    assert not missing, missing


def test_a_patch_is_applied_once_and_names_its_original() -> None:
    from jitckpt.torch_compat import patch, patched

    class Owner:
        def f(self):
            return 1

    orig = Owner.f
    assert patch(Owner, "f", lambda o: lambda self: o(self) + 1)
    assert patched(Owner.f) and Owner.f.__jitckpt_wrapped__ is orig and Owner().f() == 2
    assert not patch(Owner, "f", lambda o: lambda self: 99)  # patched already: left as it is
    assert Owner().f() == 2 and not patch(Owner, "absent", lambda o: o)


def test_the_structure_check_refuses_torch_internals_outside_the_door(tmp_path) -> None:
    """scripts/check_structure.py's nets, on a module written to break each rule once."""
    import ast

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_structure as cs
    finally:
        sys.path.pop(0)
    src = (
        "import torch.distributed.distributed_c10d as c10d\n"
        "from torch.distributed.launcher.api import _get_addr_and_port\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "def f(handler):\n"
        "    DDP.forward = None\n"
        "    setattr(c10d, 'x', 1)\n"
        "    return c10d._world, handler._state_holder, handler.public\n"
    )
    p = cs.ROOT / "jitckpt" / "probe_module.py"  # a path inside the package (never written)
    got = cs.torch_internals(p, ast.parse(src), ours=set())
    want = ["_get_addr_and_port", "DDP.forward", "setattr on torch's c10d", "c10d._world", "handler._state_holder"]
    assert all(any(w in g for g in got) for w in want), got
    assert not any("handler.public" in g for g in got), got
    assert cs.torch_internals(p, ast.parse("def f(self):\n    return self._x\n"), ours=set()) == []
