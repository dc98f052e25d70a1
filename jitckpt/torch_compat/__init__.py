"""jitckpt's one door into torch's internals: every private torch name it uses,
every patch of a torch object, and what differs between the torch versions it
supports (2.11 to 2.14).

* ``__init__`` (this module): the version differences and ``patch``, the one
  way a torch object's attribute is replaced;
* ``worker``: what the runtime inside a worker reaches (process groups, DDP,
  autograd, distributed checkpoint metadata);
* ``elastic``: what jitrun's agent reaches of torchelastic (launch API,
  rendezvous handler, process contexts, error files).

Each entry says which versions it was checked against; ``PRIVATE`` lists every
private name the door resolves, and tests/test_torch_compat.py resolves each
one on the installed torch, which ``make test-compat TORCH=X`` runs for the
lowest and the highest version of the range. jitrun's agent subclasses
torchelastic's ``LocalElasticAgent``, overrides some of its methods and reads
some of its fields (launcher/agent.py, the adapter): ``AGENT_OVERRIDES``,
checked the same way. scripts/check_structure.py refuses a private torch name
or a patch of a torch object anywhere else.

torch is imported inside each function: jitrun imports its modules without
torch where it can.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# module -> private names of it the door uses (checked: 2.11.0, 2.13.0, 2.14.1 by make test-compat)
PRIVATE: dict[str, tuple[str, ...]] = {
    "torch": ("_foreach_copy_",),
    "torch.distributed.distributed_c10d": ("_world", "_get_default_group"),
    "torch.distributed.rendezvous": ("_rendezvous_handlers",),
    "torch.nn.parallel.distributed.DistributedDataParallel": (
        "_pre_forward", "_build_params_for_reducer", "_ddp_init_helper", "_build_debug_param_to_name_mapping"),
    "torch.autograd.Variable": ("_execution_engine",),
    "torch.distributed.checkpoint.metadata": ("_MEM_FORMAT_ENCODING",),
    "torch.distributed.checkpoint.state_dict": ("_get_fqns",),
    "torch.distributed.launcher.api": ("_get_addr_and_port", "_get_entrypoint_name"),
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous": ("_delay", "get_method_name"),
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler": (
        "_state_holder", "_this_node", "_bootstrap_store_info", "_shared_tcp_store_server", "_store"),
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous._BackendRendezvousStateHolder": (
        "_sanitize", "_cache_duration"),
    "torch.distributed.elastic.multiprocessing.api.MultiprocessContext": (
        "_pc", "_ret_vals", "_return_values", "_is_done", "_worker_finished_event"),
    "torch.distributed.elastic.multiprocessing.api": ("ProcessFailure",),
}
# LocalElasticAgent's (and SimpleElasticAgent's) internals the agent adapter overrides or reads
AGENT_OVERRIDES = ("_rendezvous", "_start_workers", "_set_local_rank_env", "_monitor_workers", "_restart_workers",
                   "_shutdown", "_worker_group", "_pcontext", "_remaining_restarts")
WRAPPED = "__jitckpt_wrapped__"  # on a replacement: the original it wraps (and "patched already")


def patch(owner: Any, name: str, make: Callable[[Any], Any], *also: Any) -> bool:
    """Replace ``owner.name`` (and the same name on each of ``also``, aliases of it)
    with ``make(original)``, once: False when it is patched already or absent."""
    orig = getattr(owner, name, None)
    if orig is None or getattr(orig, WRAPPED, None) is not None:
        return False
    new = make(orig)
    try:
        setattr(new, WRAPPED, orig)
    except (AttributeError, TypeError):  # a builtin or a class with slots: still replaced, marked below
        pass
    for o in (owner, *also):
        setattr(o, name, new)
    return True


def patched(fn: Any) -> bool:
    """``fn`` is one of jitckpt's replacements."""
    return getattr(fn, WRAPPED, None) is not None


def set_pg_timeout(pg: Any, timeout: timedelta) -> None:
    """Set the default timeout of every later operation on process group `pg`.

    Raises what torch raises: ValueError for a group this rank is not part
    of; backends that cannot change their timeout warn (2.14) or are left out
    (2.11 to 2.13) instead.
    """
    import torch.distributed.distributed_c10d as c10d

    # torch 2.14 (checked: 2.14.1) has the public set_timeout(timeout, group) and
    # keeps _set_pg_timeout as its alias, deprecated with a FutureWarning at every
    # call. torch 2.11.0, 2.12.1 and 2.13.0 have only _set_pg_timeout(timeout,
    # group), the same function in all three (gloo and NCCL backends of the group).
    setter = getattr(c10d, "set_timeout", None) or c10d._set_pg_timeout
    setter(timeout, pg)


def agent_shutdown_kwargs(config: Any) -> dict[str, Any]:
    """LocalElasticAgent's keyword for how long workers get to shut down, as torchrun passes it.

    torch 2.12 (checked: 2.12.1), 2.13.0 and 2.14.1: LaunchConfig.shutdown_timeout (default from
    TORCHELASTIC_SHUTDOWN_TIMEOUT, else 30 s) and the agent's shutdown_timeout argument. torch 2.11.0
    has neither: its agent waits its fixed 30 s, so nothing is passed.
    """
    timeout = getattr(config, "shutdown_timeout", None)
    return {} if timeout is None else {"shutdown_timeout": timeout}


def unset_master_port_default(parser: argparse.ArgumentParser) -> None:
    """torchrun's --master-port with no default, so that a port not given can be told from one given.

    torch 2.12 (checked: 2.12.1), 2.13.0 and 2.14.1 default it to None, and torchrun turns a one-node
    launch with neither a port nor an endpoint (the bare form) into a local c10d rendezvous on a free
    port. torch 2.11.0 defaults it to 29500, so the bare form keeps the static rendezvous on port
    29500, and two such jobs on one machine collide (EADDRINUSE). jitrun applies the newer rule on
    every version. A port from PET_MASTER_PORT (read into the default as a string) stays.
    """
    if parser.get_default("master_port") == 29500:
        parser.set_defaults(master_port=None)
