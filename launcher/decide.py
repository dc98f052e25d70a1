"""The job-wide restore decision: one per failure, the same for every node.

Nodes keep checkpoints on their own disks, so no single agent can see which
replicas exist. After a failure every agent, once its own workers have saved
or been given up on, posts its node's inventory (verified replicas: step,
shard, rank, manifest checksum) to the coordination store. The decision is
computed from the inventories of every node of the failed round (or those
posted by a deadline: a node that vanished posts nothing), written once with
``compare_set`` (the first writer wins; every agent then reads the winner),
and names the restore step, the newest complete for every shard across all
nodes, with the nodes that hold each shard's replica as transfer sources.

One agent computes it (``Coordinator.agree``): the first to claim the round
after posting its own inventory; the others wait for its decision instead of
each reading every inventory (which made a failure's work and store traffic
grow as the square of the node count). A decider whose agent stops beating
(``recovery.alive``), or that has not decided by the caller's deadline, is
taken over: the waiting agents compute it themselves, first writer wins as
before. A claim record that does not verify makes every agent compute.

Records, sealed under the job token (``jitckpt.auth``: key names are MACs of
these labels) in the coordination store (``rdzv``): ``round/<r>/node/<group
rank>`` who is in round r; ``round/<r>/inv/<node>``; ``round/<r>/handling/<node>``
and ``round/<r>/failed``; ``round/<r>/decider`` (the claiming agent's node id);
``round/<r>/decision``; ``decision`` (the newest
decision, read by agents that join later, e.g. a replacement). A record that
does not verify is ignored with one line; a decision in force that does not
verify stops the job (``DecisionTampered``): no node may restore a state the
job did not decide.

Pure functions (``compute``) are separate from store I/O so they are unit
tested without a store. Called from the agent's main thread only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

from jitckpt import auth, contract, layout
from jitckpt.sealed_store import space


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
_BATCH = 256


class Coordinator:
    """Store I/O of the decision protocol for one agent."""

    def __init__(self, store, token: str, node: NodeInfo) -> None:
        self.store = store
        self.records = space(token)  # no label prefix: the decision's keys predate the prefixes
        self.auth = self.records.auth
        self.node = node

    def _k(self, *parts: object) -> str:
        return self.records.key(*parts)

    def _get(self, what: str, *parts: object, schema: auth.Schema | None = None):
        return self.records.get(self.store, what, *parts, schema=schema)

    def announce(self, round_: int, group_rank: int) -> None:
        """Say which node holds group rank ``group_rank`` in ``round_``."""
        self.auth.put(self.store, asdict(self.node), "round", round_, "node", group_rank)

    def nodes(self, round_: int, group_world_size: int) -> list[dict]:
        keys = {self._k("round", round_, "node", g): f"round {round_} member {g}" for g in range(group_world_size)}
        return [n for n in self._read_all(keys, NODE) if n is not None]

    def _read_all(self, keys: dict[str, str], schema: auth.Schema) -> list:
        """The verified records at ``keys`` (key -> what), None where absent or rejected.
        One round trip for all when every key is set (the usual case: a node reads
        every node's record, so a round trip per key made the job's traffic grow as
        the square of the node count), else a check per key."""
        names = list(keys)
        if not names:
            return []
        if self.store.check(names):
            raws = [raw for i in range(0, len(names), _BATCH) for raw in self.store.multi_get(names[i:i + _BATCH])]
        else:
            raws = [self.store.get(k) if self.store.check([k]) else None for k in names]
        return [None if raw is None else self.auth.open(k, raw, keys[k], schema)
                for k, raw in zip(names, raws, strict=True)]

    def post(self, round_: int, inv: dict) -> None:
        self.auth.put(self.store, inv, "round", round_, "inv", self.node.node_id)

    def handling(self, round_: int) -> None:
        """This node's agent has seen the failure (it will post an inventory);
        also tells every other agent that round ``round_`` failed."""
        self.auth.put(self.store, self.node.node_id, "round", round_, "handling", self.node.node_id)
        self.auth.put(self.store, self.node.node_id, "round", round_, "failed")

    def post_shards(self, shard_of_rank: dict[int, str]) -> None:
        """The shards this node's ranks registered (their reports reach only this
        node's agent); the deciding agent reads every node's, also a lost one's."""
        record = {"node_id": self.node.node_id, "shards": {str(r): s for r, s in shard_of_rank.items()}}
        self.auth.put(self.store, record, "shards", self.node.node_id)

    def shard_map(self, nodes: list[dict], own: dict[int, str]) -> dict[str, str]:
        """Every rank's shard as the agents of ``nodes`` posted them (one round trip),
        this node's ``own`` (its book, possibly newer than its post) over its post."""
        ids = [n["node_id"] for n in nodes]
        got = self._read_all({self._k("shards", n): f"shard map of {n}" for n in ids}, SHARD_MAP)
        out: dict[str, str] = {}
        for n, m in zip(ids, got, strict=True):
            if m is not None and m["node_id"] == n:
                out.update(m["shards"])
        return {**out, **{str(r): s for r, s in own.items()}}

    def finishing(self, round_: int) -> None:
        """A rank of this node finished the job in ``round_``."""
        self.auth.put(self.store, self.node.node_id, "round", round_, "finishing")

    def some_finished(self, round_: int) -> bool:
        """Has a rank of any node finished the job in ``round_``? (A rank stopped in its
        last minibatch elsewhere has no collective left to time out.)"""
        return isinstance(self._get(f"round {round_} finish mark", "round", round_, "finishing"), str)

    def failed(self, round_: int) -> bool:
        """Has any agent started handling a failure of ``round_``? (Its workers
        may not have noticed yet: a peer's death surfaces only at their next
        collective.) Only a mark sealed by an agent of the job counts."""
        return isinstance(self._get(f"round {round_} failure mark", "round", round_, "failed"), str)

    def wait_inventories(self, round_: int, nodes: list[dict], grace: float, final: float,
                         silent: Callable[[list[str]], set[str]] | None = None) -> list[dict]:
        """Inventories of ``nodes``: every one that posted by ``grace``
        (monotonic), and those whose agent is still handling the failure
        (e.g. a slow save) until ``final``. ``silent(node_ids)``: the nodes
        whose agents are known to be gone, not waited for."""
        want = sorted({n["node_id"] for n in nodes} or {self.node.node_id})
        inv = {n: self._k("round", round_, "inv", n) for n in want}
        if not self._wait_posted(inv, grace, silent):
            busy = [k for n, k in inv.items()
                    if self._get(f"round {round_} handling mark of {n}", "round", round_, "handling", n) == n]
            if busy:
                self._wait(busy, final)
        got = self._read_all({k: f"round {round_} inventory of {n}" for n, k in inv.items()}, INVENTORY)
        return [g for n, g in zip(inv, got, strict=True) if g is not None and g["node_id"] == n]

    def _wait_posted(self, inv: dict[str, str], until: float,
                     silent: Callable[[list[str]], set[str]] | None) -> bool:
        """Every node's inventory posted, or its agent gone; False at ``until``."""
        if silent is None:
            return self._wait(list(inv.values()), until)
        pending = dict(inv)
        while True:
            pending = {n: k for n, k in pending.items() if not self.store.check([k])}
            if pending:
                gone = silent(list(pending))
                pending = {n: k for n, k in pending.items() if n not in gone}
            if not pending:
                return True
            if time.monotonic() >= until:
                return False
            time.sleep(0.05)

    def _wait(self, keys: list[str], until: float) -> bool:
        """Block until every key exists (event-driven) or ``until`` passes."""
        try:
            self.store.wait(keys, timedelta(seconds=max(until - time.monotonic(), 0.001)))
            return True
        except Exception:  # DistStoreError on timeout
            return False

    def _decision(self, key: str, raw: object, what: str) -> Decision:
        d = self.auth.open(key, raw, what)
        won = Decision.from_record(d) if d is not None else None
        if won is None:
            raise DecisionTampered(
                f"jitrun: the {what} in the job's store does not verify under the job token: something outside "
                "the job wrote it (see events.jsonl and the README's threat model). Stopping rather than restore "
                "a state the job did not decide")
        return won

    def claim(self, round_: int) -> str | None:
        """The node id of the agent that computes ``round_``'s decision: this one if it
        asks first. None when the claim record does not verify (every agent decides)."""
        got = self.records.claim(self.store, f"round {round_} decider claim", self.node.node_id, "round", round_,
                                 "decider")
        return got if isinstance(got, str) else None

    def await_decision(self, round_: int, decider: str, until: float,
                       silent: Callable[[list[str]], set[str]] | None = None) -> Decision | None:
        """``round_``'s decision once published; None when ``decider``'s agent
        stopped beating or nothing came by ``until`` (monotonic)."""
        key = self._k("round", round_, "decision")
        step = 0.25 if silent is not None else float("inf")  # without evidence of silence: one wait
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return None
            if self._wait([key], time.monotonic() + min(left, step)):
                return self._decision(key, self.store.get(key), f"restore decision of round {round_}")
            if silent is not None and decider in silent([decider]):
                return None

    def agree(self, round_: int, compute_here: Callable[[], Decision], until: float,
              silent: Callable[[list[str]], set[str]] | None = None) -> Decision:
        """The job's decision for ``round_``: ``compute_here()`` (reads the
        inventories and decides) runs on the claiming agent only, the others read
        its result; they compute it themselves when the decider went silent or had
        not decided by ``until``. Call after posting this node's inventory."""
        decider = self.claim(round_)
        if decider is not None and decider != self.node.node_id:
            won = self.await_decision(round_, decider, until, silent)
            if won is not None:
                return won
        return self.publish(compute_here())

    def publish(self, d: Decision) -> Decision:
        """Write ``d`` unless another agent already decided this round; return
        the decision in force."""
        key = self._k("round", d.round, "decision")
        rec = asdict(d)
        sealed = self.auth.seal(key, rec)
        raw = self.store.compare_set(key, "", sealed)
        won = self._decision(key, raw, f"restore decision of round {d.round}")
        self.auth.put(self.store, rec if raw == sealed else asdict(won), "decision")
        return won

    def decided(self, round_: int) -> Decision | None:
        key = self._k("round", round_, "decision")
        if not self.store.check([key]):
            return None
        return self._decision(key, self.store.get(key), f"restore decision of round {round_}")

    def latest(self) -> Decision | None:
        key = self._k("decision")
        if not self.store.check([key]):
            return None
        return self._decision(key, self.store.get(key), "newest restore decision")


# -- EC snapshots as a restore source ---------------------------------------------------------


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
