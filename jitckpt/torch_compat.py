"""What differs between the torch versions jitckpt supports (2.11 to 2.14), and only that.

Each entry says which versions it was checked against: their wheels' Python
sources read side by side, and `make test-compat TORCH=X` run on each. A new
version's difference goes here, not at the call site, so the range stays one
place to read. torch is imported inside each function: jitrun imports this
module's siblings without torch where it can.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any


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
