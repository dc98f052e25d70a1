"""Which state the restarted workers load, and making it present here.

After a failure every agent posts its node's inventory of verified replicas;
one decision for the job (``decide``: the newest step complete for every
shard across all nodes, or an EC snapshot; first writer wins) names the
step and which nodes hold it. Before the next start, an agent whose node
lacks the chosen replica fetches it from one that has it (``transfer``).
Without a coordination store this node's disk is all there is.

Main thread, except ``transfer.ReplicaServer``'s own thread (its own store
connection, reading replica files only).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from jitckpt.wire import contract, layout

from .. import decide, decision, worker_env
from ..peers import transfer
from . import alive
from .failure import Failure
from .reports import ReportBook

STATIC_LOST = ("jitrun: ABORT: the static rendezvous (--node-rank/--master-addr, or no rendezvous flags) cannot "
               "continue without a lost node or admit a replacement or spare; launch with --rdzv-backend c10d "
               "--rdzv-endpoint HOST:PORT --nnodes MIN:MAX to recover from node loss")
EVICTED = ("jitrun: ABORT: this node ({node}) was taken as lost by the job in restart round {round}: its agent did "
           "not answer the job's store after the failure (stopped, cut off or starved) and the job went on without "
           "it. Its late reports count for nothing and it does not rejoin this job; start jitrun again on this node "
           "to join as a spare.")


class NodeEvicted(Exception):
    """This node was taken as lost and the job went on without it: its agent
    leaves without shutting the job's rendezvous down (the job is not over)."""


class Restorer:
    def __init__(self, jit, node, events) -> None:
        self._jit = jit
        self._node = node
        self._events = events
        self.coord: decide.Coordinator | None = None
        self._server: transfer.ReplicaServer | None = None
        self.decision: decision.Decision | None = None
        self.silence: alive.Silence | None = None  # which agents stopped beating (main thread)
        self._pulse: alive.Pulse | None = None
        self._finish_marked = -1  # the round whose finish mark this node set
        self._posted_shards: dict[int, str] = {}  # this node's shard map as last posted

    def join_round(self, store, round_: int, group_rank: int, rdzv_node: str | None = None) -> None:
        """Say which node holds ``group_rank`` this round (``store``: the
        coordination store, or None; ``rdzv_node``: this agent's name in a
        dynamic rendezvous, for the evidence of lost nodes)."""
        if store is None:
            return
        if self.coord is None:
            # our blocking waits must not share the heartbeat thread's connection
            self.coord = decide.Coordinator(transfer.own_connection(store), self._jit.token, self._node)
            self._server = transfer.ReplicaServer(store, self._jit.token, self._node.node_id,
                                                  self._jit.root, self._jit.job_id,
                                                  self._jit.identity).start()
            if rdzv_node is not None:
                self._pulse = alive.Pulse(store, self._jit.token, self._node.node_id, rdzv_node)
                self.silence = alive.Silence(self.coord.store, self._jit.token)
        self.coord.announce(round_, group_rank)

    def share(self, book: ReportBook, round_: int) -> None:
        """What the job needs from this node's reports, which only this agent reads:
        its ranks' shards (for the deciding agent, even after this node is lost)
        and that one of them finished the job this round."""
        if self.coord is None:
            return
        if book.shards != self._posted_shards:
            self._posted_shards = dict(book.shards)
            self.coord.post_shards(book.shards)
        if self._finish_marked != round_ and book.finished_now:
            self._finish_marked = round_
            self.coord.finishing(round_)

    def silent_peers(self, round_: int, group_world_size: int) -> list[str]:
        """The other nodes of ``round_`` whose agents stopped beating (a store
        read per node: only while a suspected hang's laggard is elsewhere)."""
        if self.coord is None or self.silence is None:
            return []
        ids = [n["node_id"] for n in self.coord.nodes(round_, group_world_size) if n["node_id"] != self._node.node_id]
        return sorted(self.silence.silent(ids))

    def close(self) -> bool:
        """False if the replica server thread would not stop."""
        if self._pulse is not None:
            self._pulse.stop()
        if self._server is None or self.coord is None:
            return True
        return self._server.stop(self.coord.store)

    def prepare(self, local_ranks: set[int]) -> None:
        """Make the job's restore step and its replicas present on this node.

        The newest decision in the store is the job's, also for an agent that
        joined after the failure (a replacement or a spare)."""
        if self.coord is None:
            return
        d = self.coord.latest()
        # The decider writes the newest-decision record just after the round's own, and
        # an agent that read the round's decision may restart in between: the record it
        # finds then is the previous failure's, and its ranks would load that step.
        if self.decision is not None and (d is None or d.round < self.decision.round):
            d = self.decision
        if d is None:
            return
        self.decision = d
        # an EC version chosen: the workers decode it, d.step stays their fallback
        worker_env.plan(decision.plan_of(d))
        if d.step is None:
            return
        need = sorted({d.shard_of_rank.get(str(r)) for r in local_ranks} - {None}) or d.shards
        for shard in need:
            self._fetch(d, shard)

    def _fetch(self, d: decision.Decision, shard: str) -> None:
        """This node's copy of ``shard`` at the decided step, fetched if missing: over a
        stream to a listener on this node's job address, through the store where the
        source cannot reach it (events ``replica_fetched``, ``replica_fetch_failed``,
        ``replica_fetch_fallback``)."""
        assert self.coord is not None and d.step is not None
        path, errors, _ = transfer.ensure_local(
            self.coord.store, self._jit.token, root=self._jit.root, job_id=self._jit.job_id, step=d.step,
            shard=shard, sources=d.sources.get(shard, []), self_node=self._node.node_id,
            timeout_s=self._jit.save_timeout_s, listen_addr=self._node.addr, emit=self._events.emit,
            identity=self._jit.identity)
        if path is None:
            print(f"jitrun: no copy of step {d.step} shard {shard} could be brought to this node "
                  f"({'; '.join(errors) or 'no source'}); its ranks will refuse to start", file=sys.stderr,
                  flush=True)

    def choose(self, f: Failure, *, round_: int, group_world_size: int, shards: dict[int, str],
               done_ranks: set[int], last_alive: float | None, poll: Callable[[], object], static: bool,
               ) -> tuple[bool, bool]:
        """Set the restore step (``f.decided``: the episode's DECIDED stage, and the
        workers' JITCKPT_RESTORE_STEP). Returns (finished, abort): finished when every
        shard has a replica that finished the job before the failure (nothing
        to restart); abort when a node was lost under the static rendezvous.
        Raises NodeEvicted when the job already decided without this node (it
        was taken as lost and came back)."""
        jit_steps = {int(m["step"]) for m in f.saved.values()}
        abort = False
        plan: contract.RestorePlan | None = None
        if self.coord is None:  # no coordination store: this node's disk is all we know
            replicas, _bad = layout.scan(self._jit.root, self._jit.job_id, self._jit.identity)
            all_shards = set(shards.values()) | {r.shard for r in replicas} or {"0"}
            step = layout.select_step(replicas, all_shards)
            if decision.all_shards_finished({str(k): v for k, v in shards.items()}, done_ranks, all_shards):
                return True, False
        else:
            d = self._decide(f, round_=round_, group_world_size=group_world_size, shards=shards,
                             done_ranks=done_ranks, last_alive=last_alive, poll=poll)
            if d.complete:
                return True, False
            if any(n["node_id"] == self._node.node_id for n in d.lost):
                self._events.emit("node_evicted", round=round_, decided_by=d.decided_by)
                raise NodeEvicted(EVICTED.format(node=f"{self._node.node_id}, {self._node.addr}", round=round_))
            abort = bool(d.lost) and static
            step = d.step
            # saved after this failure was seen, on any node (this agent may
            # not have read the other nodes' reports yet)
            if step is not None and any(src.get("saved_at", 0.0) >= f.detected_t - 1.0
                                        for srcs in d.sources.values() for src in srcs):
                jit_steps.add(step)
            # an EC snapshot chosen job-wide replaces an older (or no) replica step
            if d.source == "ec":
                step = d.ec_step
            plan = decision.plan_of(d)
        self._announce(f, step, jit_steps, bool(shards))
        f.decided(step)
        worker_env.plan(plan or contract.RestorePlan(decided=True, step=step))
        return False, abort

    def _announce(self, f: Failure, step: int | None, jit_steps: set[int], registered: bool) -> None:
        if step is None and not registered:
            # drop-in: the script restarts as it would under torchrun, on its own checkpoints if it has any
            self._events.emit("no_jit_checkpoint", fallback_step=None, why="no save_fn registered")
            print("jitrun: no rank registered a save_fn (jitckpt.register): restarting the script, which resumes "
                  "from its own checkpoints if it keeps any", flush=True)
        elif step is None or step not in jit_steps:
            self._events.emit("no_jit_checkpoint", fallback_step=step,
                              why="no shard-complete checkpoint from this failure")
            print(f"jitrun: no complete JIT checkpoint for every shard after this failure; "
                  f"{'falling back to step ' + str(step) if step is not None else 'the workers restart without one'}",
                  flush=True)

    def _decide(self, f: Failure, *, round_: int, group_world_size: int, shards: dict[int, str],
                done_ranks: set[int], last_alive: float | None, poll: Callable[[], object]) -> decision.Decision:
        """The job-wide decision for this failure: post this node's replicas; the
        first agent to claim the round waits for every node of it (a node whose
        agent has not even started handling the failure within a few seconds is
        taken as lost) and decides, the others read its decision."""
        coord = self.coord
        assert coord is not None
        inv = decision.inventory(self._jit.root, self._jit.job_id, self._node, done_ranks,
                               identity=self._jit.identity)
        inv.update(last_alive=last_alive, fault_t=f.fault_t, progress=f.progress)
        coord.post(round_, inv)
        # every live agent joins within a monitor tick of the first one (the
        # round's "failed" key); one that has not started by then is gone
        grace = f.handling_since + 3.0
        final = f.handling_since + self._jit.timeout_s + self._jit.save_timeout_s + 5.0
        silent = self.silence.silent if self.silence is not None else None

        def compute_here() -> decision.Decision:
            nodes = coord.nodes(round_, group_world_size)
            invs = coord.wait_inventories(round_, nodes, grace, final, silent=silent)
            poll()  # this node's last reports, and its shard map posted
            # every node's ranks' shards, a lost node's too: a shard only it held is still needed
            return decision.compute(round_, invs, coord.shard_map(nodes, shards), nodes, decided_by=self._node.node_id)

        won = coord.agree(round_, compute_here, final + 5.0, silent)
        poll()  # as above, for the record this node may write
        # what the other nodes' ranks reported, which only their agents read
        f.note_job_facts(won.progress, won.fault_t, won.last_alive)
        self.decision = won
        self._events.emit("restore_decision", round=round_, step=won.step, why=won.why, decided_by=won.decided_by,
                          lost=[n["node_id"] for n in won.lost],
                          sources={sh: [s["node_id"] for s in srcs] for sh, srcs in won.sources.items()})
        if won.lost:
            print(f"jitrun: node(s) {', '.join(n['addr'] for n in won.lost)} did not answer after the failure; "
                  "taken as lost", flush=True)
        # which source the restart uses, why not a better one, steps lost
        if not won.complete and won.ec is not None:  # only with --jit-ec-every N > 0
            self._events.emit("restore_source", **decision.source_event(won, f.progress))
            # a script that registered no save_fn restarts on its own checkpoints, if it keeps any: not
            # "from scratch" (_announce says so), whatever jitrun had of its own to restore
            if shards or won.source != "fresh":
                print(f"jitrun: {decision.source_line(won, f.progress)}", flush=True)
        return won
