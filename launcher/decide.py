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

Records, sealed under the job token (``jitckpt.wire.auth``: key names are MACs of
these labels) in the coordination store (``rdzv``): ``round/<r>/node/<group
rank>`` who is in round r; ``round/<r>/inv/<node>``; ``round/<r>/handling/<node>``
and ``round/<r>/failed``; ``round/<r>/decider`` (the claiming agent's node id);
``round/<r>/decision``; ``decision`` (the newest
decision, read by agents that join later, e.g. a replacement). A record that
does not verify is ignored with one line; a decision in force that does not
verify stops the job (``DecisionTampered``): no node may restore a state the
job did not decide.

The decision as a value, its records' schemas and the pure ``compute`` are
``decision.py``, unit tested without a store. Called from the agent's main
thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta

from jitckpt.sealed_store import space
from jitckpt.wire import auth

from .decision import INVENTORY, NODE, SHARD_MAP, Decision, DecisionTampered, NodeInfo

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
