"""Job side of CRIU process migration (issue 13): ``--jit-migratable on``.

With it every worker runs as PID 1 of a PID namespace of its own, session
leader, with its output in a file of its own
(``<jit dir>/migrate/out/rank<R>.a<attempt>.log``; nothing else writes there, so
CRIU finds it at the size of the dump), through :func:`jitrun.criu.migratable_worker_command`,
which forwards the agent's stop signals. Warm start is off for such jobs: a
worker forked from the fork server is a child of that server (not a tree CRIU
can dump on its own) and shares no session of its own.

Where each rank runs is recorded in ``<jit dir>/migrate/where.json`` (atomic
rewrite per attempt): node, addresses, the wrapper's PID (what torchrun
watches) and the worker's host PID (what ``criu dump`` takes).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ENV = "JITCKPT_MIGRATABLE"
OUT_TEMPLATE = "{JITCKPT_DIR}/migrate/out/rank{RANK}.a{TORCHELASTIC_RESTART_COUNT}.log"


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def wrap(cmd: str, cmd_args: list[str]) -> tuple[str, list[str]]:
    """(cmd, cmd_args) of torchrun's worker command, run migratable."""
    from . import criu

    full = criu.migratable_worker_command([cmd, *cmd_args], OUT_TEMPLATE)
    return full[0], full[1:]


def where_path(root: str | os.PathLike) -> Path:
    return Path(root) / "migrate" / "where.json"


def record_workers(agent, worker_group) -> dict:
    """After the agent started this attempt's workers: write where.json."""
    from . import criu

    root = Path(os.environ["JITCKPT_DIR"])
    ranks = {}
    for rank, p in agent._procs(worker_group).items():
        try:
            pid = criu.ns_init_pid(p.pid, timeout=10)
        except criu.CriuError as e:
            print(f"jitrun: rank {rank} is not migratable: {e}", file=sys.stderr, flush=True)
            pid = None
        attempt = worker_group.spec.max_restarts - getattr(agent, "_remaining_restarts", worker_group.spec.max_restarts)
        env = {"JITCKPT_DIR": str(root), "RANK": rank, "TORCHELASTIC_RESTART_COUNT": attempt}
        ranks[str(rank)] = {"node": agent._node.node_id, "addr": agent._node.addr, "host": agent._node.host,
                            "wrapper_pid": p.pid, "pid": pid, "output": OUT_TEMPLATE.format_map(env)}
    doc = {"t": time.time(), "ranks": ranks}
    path = where_path(root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(path.read_text()) if path.exists() else {"ranks": {}}
        doc["ranks"] = {**old.get("ranks", {}), **ranks}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except (OSError, ValueError) as e:  # training goes on; only migration needs the record
        print(f"jitrun: could not record where ranks run in {path}: {e}", file=sys.stderr, flush=True)
    agent._events.emit("migratable_workers", ranks=ranks)
    return ranks


# -- the request protocol through the job's store (jitrun migrate) -----------------------
#
# <ns>/migrate/gen             add() counter: the newest migration's number g
# <ns>/migrate/<g>/req         {"rank": R, "to": NODE, "t": ...} (set after gen is taken)
# <ns>/migrate/<g>/paused/<r>  every rank, once its group is torn down at a minibatch start
# <ns>/migrate/<g>/resume      {"prefix": "...", "store": [host, port]}: peers rebuild; the moved
#                              rank gets the same in <jit dir>/migrate/ctl/rank<R>/resume-<g>.json
#                              on the target node (it holds no store connection across the dump)
# <ns>/migrate/<g>/failed      why (the agents fall back to the JIT restart path)


def key(token: str, *parts: object) -> str:
    return "/".join([f"jitckpt/{token}/migrate", *map(str, parts)])


def request(store, token: str, rank: int, to: str) -> int:
    """Ask every rank to pause at its next minibatch start so ``rank`` can move to node
    ``to``; returns the migration's number."""
    gen = store.add(key(token, "gen"), 1)
    store.set(key(token, gen, "req"), json.dumps({"rank": rank, "to": to, "t": time.time()}))
    return gen


def resume(store, token: str, gen: int, prefix: str, store_addr: tuple[str, int]) -> dict:
    body = {"gen": gen, "prefix": prefix, "store": list(store_addr)}
    store.set(key(token, gen, "resume"), json.dumps(body))
    return body


def paused_ranks(store, token: str, gen: int, world_size: int) -> list[int]:
    return [r for r in range(world_size) if store.check([key(token, gen, "paused", r)])]
