"""This node as a migration target: the listener that receives migrated
workers' images and restores them (``migrate_agent.Target``, its own
threads), started once per agent, also on a spare."""

from __future__ import annotations

import sys

from . import agents as migrate_agent
from . import control as migrate


def start_target(coord, jit, node, events) -> migrate_agent.Target | None:
    """None without --jit-migratable on or a coordination store, or when the
    node's job address cannot be listened on (the job trains on; only moving
    ranks here is off, and a line says so)."""
    if not migrate.enabled() or coord is None:
        return None
    try:
        return migrate_agent.Target(coord, jit.token, node.addr, jit.root, events).start()
    except OSError as e:
        print(f"jitrun: this node cannot take migrated workers: listening on {node.addr} failed "
              f"({e}); pass --local-addr with this node's address", file=sys.stderr, flush=True)
        return None
