"""Ranks of this node that paused for a requested migration are dumped and
shipped to their target, one at a time (the peers wait at their minibatch
start meanwhile). Agent's main thread."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from ..workers import Whereabouts
from . import agents as migrate_agent
from . import control as migrate


def move_out(migrating: dict[int, list[dict]], *, store, coord, token: str, root: Path, where: Whereabouts,
             attempt: int, store_addr: tuple[str, int], events, on_moved: Callable[[], None]) -> None:
    """``migrating``: generation -> this node's ranks' "migrating" reports.
    ``store``: the workers' store; ``coord``: the coordination store (None
    under a backend without one: every migration then fails over to a JIT
    checkpoint and a restart)."""
    for gen, msgs in sorted(migrating.items()):
        req = migrate.read_request(store, token, gen)
        if req is None:
            continue  # not a request of this job (one line in the timeline)
        moving = migrate.moving_ranks(req)
        mine = [int(m["rank"]) for m in msgs]
        resume = None
        for m in msgs:
            rank = int(m["rank"])
            try:
                if coord is None:
                    raise migrate_agent.MigrationError("setup", "no coordination store")
                done = migrate_agent.migrate_out(
                    coord_store=coord, worker_store=store, token=token, root=root, gen=gen, req=req, rank=rank,
                    pid=where.ns_pids.get(rank, 0), ctl=Path(m["ctl"]), output=where.outputs.get(rank),
                    store_addr=store_addr, attempt=attempt, events=events)
            except migrate_agent.MigrationError as e:
                print(f"jitrun: migration {gen} of rank {rank} to {req.get('to')} failed at {e.stage}: "
                      f"{e.why}; the job falls back to a JIT checkpoint and a restart", file=sys.stderr, flush=True)
                for other in msgs:  # this node's other moving ranks wait for a word too
                    if int(other["rank"]) not in where.moved and other is not m:
                        migrate_agent.fail(store, token, gen, int(other["rank"]), Path(other["ctl"]),
                                           f"rank {rank}'s migration failed: {e.why}")
                break
            where.moved[rank] = migrate_agent.Remote(coord, token, done["id"], done["to"])
            on_moved()
            resume = {"prefix": migrate_agent.prefix(token, attempt, gen), "store": list(store_addr)}
            print(f"jitrun: rank {rank} migrated to {done['to']} (dump {done['dump_s']}s, transfer "
                  f"{done['transfer_s']}s, restore {done['restore_s']}s, {done['image_bytes'] >> 20} MiB)", flush=True)
        else:
            if resume is not None:
                migrate_agent.release_peers(store, token, gen, len(moving), len(mine), resume)
    migrating.clear()
