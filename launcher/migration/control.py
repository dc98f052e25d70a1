"""Job side of CRIU process migration: ``--jit-migratable on``.

With it every worker runs as PID 1 of a PID namespace of its own, session
leader, with its output in a file of its own
(``<jit dir>/migrate/out/rank<R>.a<attempt>.log``; nothing else writes there, so
CRIU finds it at the size of the dump), through :func:`jitrun.migration.criu.migratable_worker_command`,
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

from jitckpt.wire import contract

OUT_TEMPLATE = "{JITCKPT_DIR}/migrate/out/rank{RANK}.a{TORCHELASTIC_RESTART_COUNT}.log"


def enabled() -> bool:
    return contract.MIGRATABLE.get()


# A --no-python program has no jitckpt runtime, so no minibatch start to pause at:
# only the shim's lost-device move (launcher/migration/device_loss.py) applies to it.


def pausable() -> bool:
    return not contract.MIGRATE_NO_PAUSE.get()


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

    root = contract.DIR.get()
    assert root is not None, "jitrun sets the jit dir before starting workers"
    ranks = {}
    for rank, p in agent._procs(worker_group).items():
        try:
            pid = criu.ns_init_pid(p.pid, timeout=60)  # unshare forks at once; 60 s: a starved machine
        except criu.CriuError as e:
            print(f"jitrun: rank {rank} is not migratable: {e}", file=sys.stderr, flush=True)
            pid = None
        attempt = worker_group.spec.max_restarts - getattr(agent, "_remaining_restarts", worker_group.spec.max_restarts)
        env = {contract.DIR.name: str(root), "RANK": rank, "TORCHELASTIC_RESTART_COUNT": attempt}
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
# Records sealed under the job token (jitckpt.wire.auth; a key name is a MAC of its label):
# <ns>/migrate/gen             add() counter: the newest migration's number g
# <ns>/migrate/<g>/req         {"ranks": [R, ...], "to": NODE, "t": ...} (set after gen is taken)
# <ns>/migrate/where/<r>       the address of the node rank r runs on (its agent sets it)
# <ns>/migrate/<g>/moved       add() counter: moving ranks restored on the target
# <ns>/migrate/<g>/paused/<r>  every rank, once its group is torn down at a minibatch start
# <ns>/migrate/<g>/resume      {"prefix": "...", "store": [host, port]}: peers rebuild; the moved
#                              rank gets the same in <jit dir>/migrate/ctl/rank<R>/resume-<g>.json
#                              on the target node (it holds no store connection across the dump)
# <ns>/migrate/<g>/failed      why (the agents fall back to the JIT restart path)


def key(token: str, *parts: object) -> str:
    from jitckpt.migrate_worker import records

    return records(token).key(*parts)


def put(store, token: str, value: object, *parts: object) -> None:
    from jitckpt.migrate_worker import records

    records(token).put(store, value, *parts)


def read_request(store, token: str, gen: int) -> dict | None:
    """Migration ``gen``'s request, verified; None (one line) when it does not verify."""
    from jitckpt.migrate_worker import read_request as read

    return read(store, token, gen)


def request(store, token: str, rank: int | list[int], to: str) -> int:
    """Ask every rank to pause at its next minibatch start so ``rank`` (or each of a
    list) can move to node ``to``; returns the migration's number."""
    ranks = [rank] if isinstance(rank, int) else sorted(rank)
    gen = store.add(key(token, "gen"), 1)
    put(store, token, {"ranks": ranks, "to": to, "t": time.time()}, gen, "req")
    return gen


def resume(store, token: str, gen: int, prefix: str, store_addr: tuple[str, int]) -> dict:
    body = {"gen": gen, "prefix": prefix, "store": list(store_addr)}
    put(store, token, body, gen, "resume")
    return body


def paused_ranks(store, token: str, gen: int, world_size: int) -> list[int]:
    return [r for r in range(world_size) if store.check([key(token, gen, "paused", r)])]


def moving_ranks(req: dict) -> list[int]:
    from jitckpt.migrate_worker import moving_ranks as of

    return of(req)


CONTROL = "control.json"


def publish(store, token: str, root: Path, ranks: dict, store_addr: tuple[str, int]) -> None:
    """After this node's workers started: where its ranks run (in the store, for
    ``jitrun migrate --node``) and how ``jitrun migrate`` on this node reaches the job
    (``<jit dir>/migrate/control.json``, 0600: it holds the job's token)."""
    for r, w in ranks.items():
        put(store, token, w["addr"], "where", r)
    path = root / "migrate" / CONTROL
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{CONTROL}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"store": list(store_addr), "token": token, "pausable": pausable(), "t": time.time()}, f)
        os.replace(tmp, path)
    except OSError as e:
        print(f"jitrun: could not write {path} ({e}); `jitrun migrate` on this node will not reach the job",
              file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    """``jitrun migrate``: ask a running job to move ranks to another node, and wait."""
    import argparse

    ap = argparse.ArgumentParser(prog="jitrun migrate", description=(
        "Move live workers of a running `jitrun --jit-migratable on` job to another node at their next "
        "minibatch start (CRIU). Run it on any node of the job. The target node must run a jitrun agent of "
        "the job (a member or a spare waiting to join). If the migration fails the job takes a JIT "
        "checkpoint and restarts, losing nothing."))
    ap.add_argument("--jit-dir", required=True, help="the job's --jit-dir on this node")
    who = ap.add_mutually_exclusive_group(required=True)
    who.add_argument("--rank", type=int, action="append", help="global rank to move (repeatable)")
    who.add_argument("--node", help="move every rank of the node with this address")
    ap.add_argument("--to", required=True, help="address (--local-addr) of the node that takes them")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the outcome")
    args = ap.parse_args(argv)
    if not args.jit_dir.strip():
        print(f"jitrun migrate: error: --jit-dir {args.jit_dir!r}: an empty path; pass the job's jit dir",
              file=sys.stderr)
        return 2
    c = _read_control(Path(args.jit_dir) / "migrate" / CONTROL)
    if c is None:
        return 2
    store = _connect(c)
    if store is None:
        return 2
    token = c["token"]
    ranks = _ranks_to_move(store, token, args.node) if args.node else sorted(set(args.rank))
    if not ranks:
        print(f"jitrun migrate: error: no rank of this job runs on node {args.node}", file=sys.stderr)
        return 2
    gen = request(store, token, ranks, args.to)
    print(f"jitrun migrate: migration {gen}: ranks {ranks} -> {args.to}; waiting for every rank to pause at a "
          "minibatch start", flush=True)
    return _wait_outcome(store, token, gen, ranks, args.to, args.timeout)


def _read_control(ctl: Path) -> dict | None:
    """The job's migration control record on this node, or None after a line saying why."""
    try:
        c = json.loads(ctl.read_text())
    except FileNotFoundError:
        print(f"jitrun migrate: error: {ctl} not found: no job started with --jit-migratable on uses this "
              "--jit-dir on this node", file=sys.stderr)
        return None
    except (OSError, ValueError) as e:
        print(f"jitrun migrate: error: {ctl}: {e}", file=sys.stderr)
        return None
    if not c.get("pausable", True):
        print("jitrun migrate: error: this job's workers run a program without jitckpt's Python runtime "
              "(--no-python), so they have no minibatch start to pause at; jitrun migrate moves Python "
              "workers only (a lost device is still moved: JITCKPT_ON_DEVICE_LOSS=migrate)", file=sys.stderr)
        return None
    return c


def _connect(c: dict):
    """A client of the job's store, or None after a line saying why."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    try:  # a quiet look first: TCPStore's own connect failure prints a C++ backtrace
        socket.create_connection((c["store"][0], int(c["store"][1])), timeout=5).close()
        return dist.TCPStore(c["store"][0], int(c["store"][1]), is_master=False,
                             timeout=timedelta(seconds=10), wait_for_workers=False)
    except Exception as e:
        print(f"jitrun migrate: error: the job's store {c['store'][0]}:{c['store'][1]} is unreachable ({e}); "
              "is the job still running?", file=sys.stderr)
        return None


def _ranks_to_move(store, token: str, node: str) -> list[int]:
    from jitckpt.migrate_worker import records

    a = records(token)
    ranks, r = [], 0
    while store.check([a.key("where", r)]):  # ranks are 0..world-1
        if a.get(store, f"where rank {r} runs", "where", r) == node:
            ranks.append(r)
        r += 1
    return ranks


def _wait_outcome(store, token: str, gen: int, ranks: list[int], to: str, timeout: float) -> int:
    import torch.distributed as dist

    from jitckpt.migrate_worker import records

    a = records(token)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            why = a.get(store, f"failure of migration {gen}", gen, "failed")
            if isinstance(why, str):
                print(f"jitrun migrate: migration {gen} FAILED: {why}; the "
                      "job takes a JIT checkpoint and restarts", file=sys.stderr)
                return 1
            if a.get(store, f"resume of migration {gen}", gen, "resume") is not None:
                print(f"jitrun migrate: migration {gen} done: ranks {ranks} run on {to}")
                return 0
        except dist.DistError as e:  # the store's host ended: the job finished or restarted meanwhile
            print(f"jitrun migrate: the job's store closed before migration {gen} had an outcome ({e}); the job "
                  "ended or restarted: see its events.jsonl", file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(f"jitrun migrate: no outcome of migration {gen} within {timeout:g}s (see the job's events.jsonl)",
          file=sys.stderr)
    return 1
