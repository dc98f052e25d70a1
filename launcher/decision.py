"""The restore decision as a value: what every node holds, the decision computed
from it, and the records' schemas (what a peer's record must look like before
anything in it is used). No store I/O: the protocol that gets every
node the same decision is decide.py's ``Coordinator``.

``inventory`` lists this node's verified replicas; ``compute`` takes every
node's inventory and names the newest step with a replica of every shard and
the nodes that hold each (``choose_source``: a few holders, not every node);
``plan_of`` turns a decision into the ``contract.RestorePlan`` the workers
read; ``source_event``/``source_line`` say where each shard comes from.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jitckpt.wire import auth, contract, layout


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    host: str
    addr: str


@dataclass
class Decision:
    round: int
    step: int | None
    shards: list[str]
    sources: dict[str, list[dict]]  # shard -> [{node_id, host, addr, rank, manifest_sha256}]
    shard_of_rank: dict[str, str]
    nodes: list[dict]  # every node of the failed round
    lost: list[dict]  # nodes that posted no inventory by the deadline
    why: str
    decided_by: str
    t: float = field(default_factory=time.time)
    # every shard has a replica that finished the job (its work is done; the
    # failure came after that replica's last minibatch): nothing to restart
    complete: bool = False
    # where the restart's state comes from: "replica" (``step``), "ec" (``ec_step``, decoded
    # by the restarted ranks from peers' /dev/shm chunks; ``step`` stays the fallback) or "fresh"
    source: str = "replica"
    ec_step: int | None = None
    ec: dict | None = None  # the chosen EC version (k, m, ...) and why newer sources were not used
    # for every node's recovery record (each agent reads only its own ranks' reports): the
    # earliest last sign of life of a failed process any node posted (the failure's time when
    # no injector stamped it), the earliest injector's stamp, the furthest step a rank reached
    last_alive: float | None = None
    fault_t: float | None = None
    progress: int = -1

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(raw: str | bytes) -> Decision:
        d = json.loads(raw)
        why = DECISION.problem(d)
        if why is not None:
            raise ValueError(f"malformed decision: {why}")
        return Decision(**d)

    @staticmethod
    def from_record(d: object) -> Decision | None:
        """A verified record as a Decision; None (one reject line) if it is malformed."""
        why = DECISION.problem(d)
        if why is not None:
            auth.reject("restore decision", f"malformed: {why}")
            return None
        assert isinstance(d, dict)
        return Decision(**d)


class DecisionTampered(RuntimeError):
    pass


_S = str
_OPT_INT = (int, type(None))
NODE = auth.Schema({"node_id": _S, "host": _S, "addr": _S})
_SOURCE = auth.Schema({"node_id": _S, "host": _S, "addr": _S, "rank": int, "manifest_sha256": _S},
                      {"saved_at": (int, float)})
_REPLICA = auth.Schema({"step": int, "shard": _S, "rank": int, "manifest_sha256": _S}, {"saved_at": (int, float)})


def _good_shard(sh: object) -> bool:
    try:
        layout.shard_dirname(sh)  # type: ignore[arg-type]
        return isinstance(sh, str)
    except (ValueError, TypeError):
        return False


def _all(items: object, schema: auth.Schema) -> str | None:
    if not isinstance(items, list):
        return "not a list"
    return next((p for p in map(schema.problem, items) if p is not None), None)


def _decision_parts(d: dict) -> str | None:
    if not all(isinstance(s, str) and _good_shard(s) for s in d["shards"]):
        return "a shard name is not one"
    for sh, srcs in d["sources"].items():
        if not _good_shard(sh) or (p := _all(srcs, _SOURCE)) is not None:
            return f"sources of shard {sh!r}: {p or 'bad name'}"
    if not all(isinstance(k, str) and isinstance(v, str) and _good_shard(v) for k, v in d["shard_of_rank"].items()):
        return "shard_of_rank"
    return _all(d["nodes"], NODE) or _all(d["lost"], NODE)


DECISION = auth.Schema(
    {"round": int, "step": _OPT_INT, "shards": list, "sources": dict, "shard_of_rank": dict, "nodes": list,
     "lost": list, "why": _S, "decided_by": _S, "t": (int, float), "complete": bool, "source": _S,
     "ec_step": _OPT_INT, "ec": (dict, type(None))},
    {"last_alive": (int, float, type(None)), "fault_t": (int, float, type(None)), "progress": int},
    nested=_decision_parts)


def _inventory_parts(inv: dict) -> str | None:
    if (p := _all(inv["replicas"], _REPLICA)) is not None:
        return f"replicas: {p}"
    if not all(_good_shard(r["shard"]) for r in inv["replicas"]):
        return "a replica's shard name"
    if not auth.int_list(inv.get("finished", [])):
        return "finished"
    ec = inv.get("ec")
    if ec is not None and not (isinstance(ec.get("commits"), list) and isinstance(ec.get("chunks"), list)
                               and all(auth.int_list(c) for c in ec["chunks"])):
        return "ec"
    return None


INVENTORY = auth.Schema({"node_id": _S, "host": _S, "addr": _S, "replicas": list},
                        {"finished": list, "ec": dict, "last_alive": (int, float, type(None)),
                         "fault_t": (int, float, type(None)), "progress": int},
                        nested=_inventory_parts)


def _shard_map_parts(m: dict) -> str | None:
    ok = all(isinstance(r, str) and r.isdigit() and _good_shard(s) for r, s in m["shards"].items())
    return None if ok else "a rank or shard name"


SHARD_MAP = auth.Schema({"node_id": _S, "shards": dict}, nested=_shard_map_parts)


def inventory(root: Path, job_id: str, node: NodeInfo, finished: set[int] = frozenset(),
              identity: str | None = None) -> dict:
    """This node's verified replicas (checksums checked now), and the ranks it
    knows finished the job."""
    good, _bad = layout.scan(root, job_id, identity)
    reps = [{"step": r.step, "shard": r.shard, "rank": r.rank, "saved_at": r.saved_at,
             "manifest_sha256": layout.sha256_file(r.path / layout.MANIFEST)} for r in good]
    from jitckpt.ec import files as ec_files
    from jitckpt.ec import snapshot as ec_snapshot

    # the EC chunks and commit records in this node's /dev/shm (the agent shares its workers' mounts)
    inv = {**asdict(node), "replicas": reps, "finished": sorted(finished)}
    if ec_snapshot.enabled():  # --jit-ec-every 0: the inventory (and the decision) are as without EC
        inv["ec"] = ec_files.scan_node(job_id)
    return inv


def all_shards_finished(shard_of_rank: dict[str, str], finished: set, shards) -> bool:
    """Every shard has a replica (rank) that finished the job."""
    have = {shard_of_rank.get(str(r)) for r in finished}
    return bool(shard_of_rank) and all(sh in have for sh in shards)


# holders named per shard: a node that lacks the replica needs one that can send it, and
# naming every holder made the record every agent reads grow with the job (pure data
# parallelism: every node holds the one shard)
MAX_SOURCES = 8


def compute(round_: int, inventories: list[dict], shard_of_rank: dict[str, str], nodes: list[dict],
            decided_by: str, max_step: int | None = None) -> Decision:
    """Newest step at which every shard has a replica on some node that posted."""
    shards = sorted(set(shard_of_rank.values()) or {r["shard"] for inv in inventories for r in inv["replicas"]}
                    or {"0"})
    holders: dict[tuple[int, str], list[dict]] = {}
    for inv in sorted(inventories, key=lambda i: i["node_id"]):
        for r in inv["replicas"]:
            holders.setdefault((r["step"], r["shard"]), []).append(
                {"node_id": inv["node_id"], "host": inv["host"], "addr": inv["addr"], "rank": r["rank"],
                 "saved_at": r.get("saved_at", 0.0), "manifest_sha256": r["manifest_sha256"]})
    steps = {s for s, _ in holders}
    ok = sorted((s for s in steps if all((s, sh) in holders for sh in shards)
                 and (max_step is None or s <= max_step)), reverse=True)
    step = ok[0] if ok else None
    posted = {i["node_id"] for i in inventories}
    lost = [n for n in nodes if n["node_id"] not in posted]
    if step is None:
        why = "no step has a complete replica of every shard on the nodes that answered"
    else:
        why = f"newest step with a replica of every shard ({len(inventories)} of {len(nodes) or '?'} nodes answered)"
    sources = {sh: holders[(step, sh)][:MAX_SOURCES] for sh in shards} if step is not None else {}
    complete = all_shards_finished(shard_of_rank, {r for i in inventories for r in i.get("finished", ())}, shards)
    if complete:
        why = "every shard has a replica that finished the job"
    d = Decision(round=round_, step=step, shards=shards, sources=sources, shard_of_rank=shard_of_rank,
                 nodes=nodes, lost=lost, why=why, decided_by=decided_by, complete=complete,
                 last_alive=min((i["last_alive"] for i in inventories if i.get("last_alive")), default=None),
                 fault_t=min((i["fault_t"] for i in inventories if i.get("fault_t")), default=None),
                 progress=max((i.get("progress", -1) for i in inventories), default=-1))
    if not complete:
        choose_source(d, inventories)
    return d


def choose_source(d: Decision, inventories: list[dict]) -> None:
    """The recovery order: a replica checkpoint (this failure's JIT checkpoint is the newest step
    there is, so it wins any tie); else the newest committed EC version decodable from the nodes that
    answered, when newer than the newest persistent replica; else that replica; else a fresh start."""
    from jitckpt.ec import files as ec_files

    d.source = "replica" if d.step is not None else "fresh"
    ecs = [i["ec"] for i in inventories if i.get("ec") is not None]
    if not ecs:
        return  # EC snapshots off: the decision is exactly the replica one (d.ec stays None)
    world = len(d.shard_of_rank) or None
    try:
        ver, rejected = ec_files.choose_version(ecs, world)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # an inventory's EC part that is not one
        auth.reject("EC part of an inventory", f"malformed: {type(e).__name__}: {e}")
        ver, rejected = None, [f"EC inventories unusable ({type(e).__name__})"]
    if ver is not None and (d.step is None or ver["step"] > d.step):
        d.source, d.ec_step = "ec", ver["step"]
        d.ec = {**ver, "rejected": rejected}
        d.why = (f"no replica checkpoint newer than EC step {ver['step']} "
                 f"({'newest replica step ' + str(d.step) if d.step is not None else 'none at all'}); "
                 f"newest committed EC snapshot decodable from the {len(inventories)} node(s) that answered "
                 f"({ver['k']}+{ver['m']})")
        return
    d.ec = {"rejected": rejected + ([f"EC step {ver['step']} is not newer than replica step {d.step}"]
                                    if ver is not None else [])}


# keys per multi_get: bounds one request (and one reply) at a few hundred records


def plan_of(d: Decision) -> contract.RestorePlan:
    """What the workers restore after decision ``d``: its replica step (fetched to this node as
    for any restore) or a fresh start, with an EC snapshot to decode first when EC was chosen
    (the replica step is then the fallback if the decode fails job-wide)."""
    ec = d.ec_step if d.source == "ec" else None
    return contract.RestorePlan(decided=True, step=d.step, ec_step=ec)


def source_event(d: Decision, progress: int = -1) -> dict:
    """The ``restore_source`` event: source, step, why, why the better sources were not used, steps lost."""
    step = d.ec_step if d.source == "ec" else d.step
    not_used = []
    if d.source != "replica":
        not_used.append(f"JIT/replica checkpoint: {d.why if d.source == 'fresh' else 'none newer (see why)'}")
    if d.source != "ec":
        not_used.extend((d.ec or {}).get("rejected", []))
    lost = None if progress < 0 else max(progress + 1 - (step or 0), 0)
    return {"source": d.source, "step": step, "why": d.why, "not_used": not_used, "minibatches_lost": lost,
            "ec": {k: v for k, v in (d.ec or {}).items() if k != "rejected"} or None}


def source_line(d: Decision, progress: int = -1) -> str:
    ev = source_event(d, progress)
    lost = f"; {ev['minibatches_lost']} minibatch(es) to redo" if ev["minibatches_lost"] is not None else ""
    if d.source == "ec":
        return f"restoring from the erasure-coded snapshot of step {d.ec_step} in the nodes' memory ({d.why}){lost}"
    if d.source == "replica":
        return f"restoring from the replica checkpoint of step {d.step}{lost}"
    return ("NO CHECKPOINT of any kind to restore (no replica on the nodes that answered; EC: "
            + ("; ".join(ev["not_used"][1:]) or "no snapshots") + "): the job RESTARTS FROM SCRATCH" + lost)
