"""What differs between the torch versions jitckpt supports (2.11 to 2.14), and only that.

Each entry says which versions it was checked against: their wheels' Python
sources read side by side, and `make test-compat TORCH=X` run on each. A new
version's difference goes here, not at the call site, so the range stays one
place to read. torch is imported inside each function: jitrun imports this
module's siblings without torch where it can.
"""

from __future__ import annotations

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
