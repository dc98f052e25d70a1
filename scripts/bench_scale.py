"""How jitrun's coordination protocol scales with the node count, measured.

N simulated nodes (threads of this process, one rendezvous handler and one set
of store connections each; ranks are simulated, no training) run jitrun's real
coordination code against real torch TCPStores, all under one job token:

* rendezvous round admission: torch's c10d ``DynamicRendezvousHandler`` over a
  ``C10dRendezvousBackend``, patched by ``launcher.rdzv.install`` as jitrun's
  agent patches it; a hot spare waits (reported through ``num_nodes_waiting``)
  and is admitted in the round after the failure;
* report intake: every simulated rank writes its reports with
  ``jitckpt.wire.report.Reporter`` into its node's stream; each node reads its own with
  ``ReportReader`` into ``launcher.recovery.reports.ReportBook`` and posts its
  ranks' shard map (``Coordinator.post_shards``) for the deciding agent;
* the job-wide restore decision: ``launcher.decide.Coordinator`` (handling
  marks, inventories, ``agree``: the first agent to claim the round reads the
  inventories (``wait_inventories``), computes and publishes, the others wait
  for its decision), then the next rendezvous round and ``Coordinator.latest``.

One node is failed (its rendezvous heartbeats stop, its ranks say nothing); its
loss is known from evidence (the peers' collectives failed), so the survivors
wait for each other's inventories, not for a grace period (``--grace S``
instead: the agent's fixed wait). Every store call is counted by a proxy around
each TCPStore client (calls and payload bytes: keys and values both ways).

Threads share one interpreter: the simulation's own Python work (sealing,
JSON, the rendezvous state's pickling) is serialized on one core, so the times
are an upper bound of what N real agents, each with its own CPU, would take.
For the same reason an agent that has the decision waits until every survivor
has it before it joins the next rendezvous round (``--no-barrier``: it goes on
at once, as a real agent does): on real nodes that join runs on the agent's own
CPU, here it would take the interpreter from the agents still reading the
decision (at 256 nodes the last of them read it ~4 s after it was published
without the barrier). ``published_s`` is when the first survivor had the
decision (the decider, or a reader right after its publish), ``decision_s``
when the last survivor had read and verified it.

Replica fetch (``--xfer-mib``): one replica of that size fetched by the
function the restoring agent calls (``launcher.transfer.ensure_local``, answered
by a ``ReplicaServer`` on its own store connection): over the direct
token-checked stream (``launcher.stream``), and through the store in 4 MiB
chunks (the path when a source cannot reach the requester); both copies
fsynced and checked against the replica's manifest.

``--repeats R`` runs every node count R times (all runs in the JSON's ``rows``)
and prints, and plots, the median (min-max) per node count.

Usage: python scripts/bench_scale.py [--nodes 2,8,32,128,256] [--repeats 1] [--xfer-mib 1024]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# no per-round TCPStore server for the (simulated) workers: each would be a listening port per node

import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from jitckpt.wire import auth  # noqa: E402
from jitckpt.wire.report import JOB, Reporter, ReportReader, Stream  # noqa: E402
from jitrun import decide, decision, rdzv  # noqa: E402
from jitrun.recovery.failure import Failure  # noqa: E402
from jitrun.recovery.reports import ReportBook  # noqa: E402

BUCKETS = ("rdzv", "decide", "reports")
STEP = 120  # the step the simulated ranks were at when the node failed


class Tally:
    """Store calls and payload bytes per bucket, from every simulated node."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.msgs = dict.fromkeys(BUCKETS, 0)
        self.bytes = dict.fromkeys(BUCKETS, 0)

    def count(self, bucket: str, nbytes: int) -> None:
        with self._lock:
            self.msgs[bucket] += 1
            self.bytes[bucket] += nbytes

    def snapshot(self) -> dict[str, tuple[float, float]]:
        """Calls and bytes per bucket, and this process's CPU seconds so far ("cpu")."""
        with self._lock:
            return {**{b: (self.msgs[b], self.bytes[b]) for b in BUCKETS}, "cpu": (time.process_time(), 0)}


def _len(v: object) -> int:
    return len(v) if isinstance(v, (bytes, bytearray, str)) else 8


class CountingStore(dist.Store):
    """A TCPStore client that counts every call (a real c10d Store: PrefixStore and
    the rendezvous backend accept it)."""

    def __init__(self, inner, tally: Tally, bucket: str) -> None:
        super().__init__()
        self._s, self._t, self._b = inner, tally, bucket

    def _c(self, n: int) -> None:
        self._t.count(self._b, n)

    def set(self, key, value):
        self._c(_len(key) + _len(value))
        return self._s.set(key, value)

    def get(self, key):
        v = self._s.get(key)
        self._c(_len(key) + _len(v))
        return v

    def add(self, key, n):
        self._c(_len(key) + 16)
        return self._s.add(key, n)

    def compare_set(self, key, expected, desired):
        v = self._s.compare_set(key, expected, desired)
        self._c(_len(key) + _len(expected) + _len(desired) + _len(v))
        return v

    def check(self, keys):
        self._c(sum(map(_len, keys)))
        return self._s.check(keys)

    def wait(self, keys, timeout=None):
        self._c(sum(map(_len, keys)))
        return self._s.wait(keys) if timeout is None else self._s.wait(keys, timeout)

    def multi_get(self, keys):
        v = self._s.multi_get(keys)
        self._c(sum(map(_len, keys)) + sum(map(_len, v)))
        return v

    def delete_key(self, key):
        self._c(_len(key))
        return self._s.delete_key(key)

    def num_keys(self):
        self._c(0)
        return self._s.num_keys()


def client(port: int, tally: Tally, bucket: str) -> CountingStore:
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120),
                        wait_for_workers=False)
    return CountingStore(raw, tally, bucket)


class _NoEvents:
    """The agent's events log is not part of the protocol: the simulated agents keep none."""

    def emit(self, *_a, **_k) -> None:
        pass


class Job:
    """One simulated job: its stores, its clock, what each node reached and when."""

    def __init__(self, n: int, args: argparse.Namespace) -> None:
        self.n, self.ranks, self.args = n, args.ranks, args
        self.tally = Tally()
        self.token = secrets.token_hex(16)
        master = dict(is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
        self.coord_srv = dist.TCPStore("127.0.0.1", 0, **master)  # the rendezvous endpoint's store
        self.work_srv = dist.TCPStore("127.0.0.1", 0, **master)  # the workers' store (reports)
        self.failed = threading.Event()
        self.stop = threading.Event()
        self.spare_seen = threading.Event()
        self.victim = ""
        self.t_fail = 0.0
        self._lock = threading.Condition()
        self.ready: set[str] = set()
        self.at: dict[str, dict[str, float]] = {"decided": {}, "restarted": {}}
        self.snap: dict[str, dict] = {}
        self.errors: list[str] = []
        self.cpu: dict[str, list[float]] = {"decided": []}  # per survivor's main thread, failure -> decision

    def mark(self, what: str, node_id: str, want: int) -> None:
        """``node_id`` reached ``what``; the last of ``want`` nodes takes the store tally."""
        with self._lock:
            self.at[what][node_id] = time.monotonic()
            if len(self.at[what]) == want:
                self.snap[what] = self.tally.snapshot()
            self._lock.notify_all()

    def saw_spare(self) -> None:
        with self._lock:
            self.spare_seen.set()
            self._lock.notify_all()

    def arrive(self, node_id: str) -> None:
        with self._lock:
            self.ready.add(node_id)
            self._lock.notify_all()

    def error(self, node_id: str, e: BaseException) -> None:
        with self._lock:
            self.errors.append(f"{node_id}: {type(e).__name__}: {e}")
            self._lock.notify_all()

    def wait_for(self, cond, timeout_s: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: cond() or bool(self.errors), timeout_s) and not self.errors


class SimNode:
    """One node's agent: its rendezvous handler, coordinator, report reader and its
    ranks' reporters, each on its own store connection as in the agent."""

    def __init__(self, job: Job, idx: int, spare: bool = False) -> None:
        self.job, self.spare = job, spare
        self.node = decision.NodeInfo(node_id=f"node{idx:04d}-{secrets.token_hex(4)}", host=f"host{idx:04d}",
                                    addr=f"10.{idx // 65536}.{idx // 256 % 256}.{idx % 256}")
        a = job.args
        rstore = client(job.coord_srv.port, job.tally, "rdzv")
        self.handler = DynamicRendezvousHandler.from_backend(
            # room for the spare (--nnodes N:N+1): it waits in torch's wait list, not its redundancy list
            "bench", rstore, C10dRendezvousBackend(rstore, "bench"), min_nodes=job.n, max_nodes=job.n + 1,
            local_addr=self.node.addr, keep_alive_interval=a.keepalive, keep_alive_max_attempt=a.keepalive_n,
            timeout=RendezvousTimeout(join=timedelta(seconds=a.timeout), last_call=timedelta(seconds=a.last_call)))
        rdzv.install(self.handler, on_spare=lambda _n: job.saw_spare(), healthy=lambda: not job.failed.is_set())
        self.coord = decide.Coordinator(client(job.coord_srv.port, job.tally, "decide"), job.token, self.node)
        self.wconn = client(job.work_srv.port, job.tally, "reports")  # the workers' store, ranks' side
        self.rconn = client(job.work_srv.port, job.tally, "reports")  # the agent's report reader
        self.book = ReportBook(_NoEvents())
        self.reader: ReportReader | None = None
        self.round = self.grank = 0
        self.thread = threading.Thread(target=self._main, name=self.node.node_id, daemon=True)

    def my_ranks(self) -> list[int]:
        return [self.grank * self.job.ranks + i for i in range(self.job.ranks)]

    def _main(self) -> None:
        try:
            self._join()
            if not self.spare:
                self._healthy()
                if self.node.node_id != self.job.victim:
                    self._recover()
            self.job.stop.wait()
        except BaseException as e:  # reported to the controller, which fails the run
            self.job.error(self.node.node_id, e)
        finally:
            self.handler._stop_heartbeats()

    def _join(self) -> None:
        info = self.handler.next_rendezvous()
        self.round, self.grank = rdzv.current_round(self.handler) or 0, info.rank
        self.coord.announce(self.round, self.grank)
        me = self.node.node_id
        self.reader = ReportReader(self.rconn, self.job.token, from_now=self.spare, streams=(me, JOB))
        self.book.new_round(self.round, set(self.my_ranks()))
        reps = [Reporter(self.wconn, self.job.token, r, me) for r in self.my_ranks()]
        for rep, r in zip(reps, self.my_ranks(), strict=True):
            rep.send("registered", shard=str(r % self.job.ranks), attempt=self.round)
        if self.spare:  # admitted after the failure: read the decision in force, as ``Restorer.prepare``
            assert self.coord.latest() is not None, "the spare found no restore decision"
            self.job.mark("restarted", self.node.node_id, self.job.n)
            return
        while len(self.book.local_shards()) < self.job.ranks:
            self._absorb(None)
            time.sleep(0.01)
        self.coord.post_shards(self.book.shards)  # as the agent's ``Restorer.share``
        self.job.arrive(self.node.node_id)

    def _absorb(self, f: Failure | None) -> None:
        assert self.reader is not None
        for m in self.reader.poll():
            self.book.absorb(m, f, lambda _m: None)

    def _wake(self) -> None:
        """Block until the next report slot is written, as the agent's report waiter
        (``launcher.wakeup``) does, or a short timeout."""
        assert self.reader is not None
        try:
            nxt = self.reader._cursors[0]._next  # this node's stream
            self.rconn.wait([Stream(auth.of(self.job.token), self.node.node_id).slot(nxt)], timedelta(seconds=0.05))
        except Exception:  # DistStoreError on timeout
            pass

    def _healthy(self) -> None:
        """The agent's monitor loop while healthy: reports, and the spare check torch's agent makes."""
        while not self.job.failed.wait(self.job.args.monitor):
            self.handler.num_nodes_waiting()
            self._absorb(None)


    def _recover(self) -> None:
        """A survivor's failure episode: its ranks report and save, the agent posts its
        inventory, the job decides, and the next rendezvous round admits the spare."""
        job, coord = self.job, self.coord
        cpu0 = time.thread_time()  # this agent's own CPU: what it would spend on a node of its own
        f = Failure(time.time())
        for r in self.my_ranks():
            rep = Reporter(self.wconn, job.token, r, self.node.node_id)
            rep.send("failure_detected", step=STEP, reason="a collective with a lost node failed", attempt=self.round)
            rep.send("save_started", step=STEP, attempt=self.round)
            rep.send("checkpoint_saved", step=STEP, shard=str(r % job.ranks), attempt=self.round)
        coord.handling(self.round)
        while not set(self.my_ranks()) <= set(f.saved):  # the episode waits for this node's savers
            self._wake()
            self._absorb(f)
        coord.post(self.round, self._inventory())
        until = time.monotonic() + job.args.timeout

        def compute_here() -> decision.Decision:  # as ``Restorer._decide``'s, on the claiming agent only
            nodes = coord.nodes(self.round, job.n)
            if job.args.grace is None:  # the loss is known from evidence: wait for the survivors only
                invs = coord.wait_inventories(self.round, [n for n in nodes if n["node_id"] != job.victim],
                                              until, until)
            else:
                grace = f.handling_since + job.args.grace
                invs = coord.wait_inventories(self.round, nodes, grace, grace + 5.0)
            self._absorb(f)
            shard_of_rank = coord.shard_map(nodes, self.book.shards)
            if len(shard_of_rank) != job.n * job.ranks:
                raise AssertionError(f"the decider knows {len(shard_of_rank)} ranks' shards of {job.n * job.ranks}")
            return decision.compute(self.round, invs, shard_of_rank, nodes, decided_by=self.node.node_id)

        won = coord.agree(self.round, compute_here, until)
        if won.step != STEP or [n["node_id"] for n in won.lost] != [job.victim]:
            raise AssertionError(f"wrong decision: step {won.step}, lost {won.lost}")
        job.cpu["decided"].append(time.thread_time() - cpu0)
        job.mark("decided", self.node.node_id, job.n - 1)
        if job.args.barrier and not job.wait_for(lambda: len(job.at["decided"]) == job.n - 1, job.args.timeout):
            raise RuntimeError(f"not every survivor decided: {len(job.at['decided'])}/{job.n - 1}")
        info = self.handler.next_rendezvous()
        self.round, self.grank = rdzv.current_round(self.handler) or 0, info.rank
        coord.announce(self.round, self.grank)
        assert coord.latest() is not None
        job.mark("restarted", self.node.node_id, job.n)

    def _inventory(self) -> dict:
        reps = [{"step": s, "shard": str(r % self.job.ranks), "rank": r, "saved_at": time.time(),
                 "manifest_sha256": hashlib.sha256(f"{s}/{r}".encode()).hexdigest()}
                for r in self.my_ranks() for s in (STEP - 100, STEP)]
        return {**vars(self.node), "replicas": reps, "finished": [], "last_alive": time.time()}


def _delta(a: dict, b: dict) -> dict:
    return {**{k: {"msgs": b[k][0] - a[k][0], "bytes": b[k][1] - a[k][1]} for k in BUCKETS},
            "cpu_s": round(b["cpu"][0] - a["cpu"][0], 3)}


def run_once(n: int, args: argparse.Namespace) -> dict:
    """One job of ``n`` nodes and a spare; one node fails; what it cost."""
    job = Job(n, args)
    nodes = [SimNode(job, i) for i in range(n)]
    spare = SimNode(job, n, spare=True)
    try:
        for nd in nodes:
            nd.thread.start()
        if not job.wait_for(lambda: len(job.ready) == n, args.timeout):
            raise RuntimeError(f"round 0 did not form with {n} nodes: {job.errors[:3]}")
        spare.thread.start()
        if not job.wait_for(job.spare_seen.is_set, args.timeout):
            raise RuntimeError(f"the spare was never reported waiting: {job.errors[:3]}")
        h0, t0 = job.tally.snapshot(), time.monotonic()
        time.sleep(1.0)  # one healthy second: the background traffic
        healthy = _delta(h0, job.tally.snapshot())
        healthy_s = time.monotonic() - t0
        victim = nodes[n // 2]
        job.victim = victim.node.node_id
        before = job.tally.snapshot()
        job.t_fail = time.monotonic()
        victim.handler._stop_heartbeats()  # the node is gone: no more keep-alives, its ranks say nothing
        job.failed.set()
        readmitted = job.wait_for(lambda: len(job.at["restarted"]) == n, args.timeout)
        why = None if readmitted else (f"not every node restarted: {len(job.at['restarted'])}/{n} "
                                       f"({len(job.at['decided'])} decided); {job.errors[:3]}")
        if why and len(job.at["decided"]) < n - 1:
            raise RuntimeError(why)
    finally:
        job.stop.set()
        for nd in [*nodes, spare]:
            nd.handler._stop_heartbeats()
    decided = max(job.at["decided"].values())
    # every survivor decided but the next round did not form: the decision is still measured, and the row says why
    restarted = round(max(job.at["restarted"].values()) - job.t_fail, 4) if readmitted else None
    return {"nodes": n, "ranks_per_node": args.ranks,
            "published_s": round(min(job.at["decided"].values()) - job.t_fail, 4),
            "decision_s": round(decided - job.t_fail, 4), "restarted_s": restarted,
            "barrier": args.barrier,
            **({"readmission_failed": why} if why else {}),
            "keepalive_expiry_s": args.keepalive * args.keepalive_n,
            "to_decision": _delta(before, job.snap["decided"]),
            "to_restart": _delta(before, job.snap["restarted"] if readmitted else job.tally.snapshot()),
            "healthy_per_s": {k: {m: round(v / healthy_s) for m, v in healthy[k].items()} for k in BUCKETS},
            # the simulation's own CPU while healthy (keep-alives, polls): what the failure's work queues behind
            "healthy_cpu_per_s": round(healthy["cpu_s"] / healthy_s, 3),
            "agent_cpu_to_decision_s": {"median": round(sorted(job.cpu["decided"])[len(job.cpu["decided"]) // 2], 4),
                                        "max": round(max(job.cpu["decided"]), 4)},
            "load_avg": os.getloadavg()[0]}


# -- replica transfer: through the store vs. the direct stream ------------------------------------


XFER_JOB = "bench-xfer"


def _make_replica(root: Path, mib: int) -> dict:
    """A published replica (one file of ``mib`` MiB) of step 1, shard 0, as a save
    leaves it; its source record as the restore decision carries it."""
    from jitckpt.wire import layout

    tmp = layout.staging_dir(root, 1, "0", 0)
    block = os.urandom(1 << 20)
    with open(tmp / "model.pt", "wb") as fh:
        for _ in range(mib):
            fh.write(block)
    rep = layout.publish(tmp, root=root, step=1, shard="0", rank=0, world_size=1, job_id=XFER_JOB)
    return {"rank": 0, "manifest_sha256": layout.sha256_file(rep / layout.MANIFEST)}


def _restore_fetch(port: int, token: str, src_root: Path, source: dict, dst: Path, listen: str | None) -> dict:
    """One ``transfer.ensure_local`` as the restoring agent calls it, from the
    ``ReplicaServer`` of node ``source["node_id"]`` (its own store connection; a node
    name of its own: an agent's requests are numbered per node), every store call of
    both counted; ``listen``: the requester's address for the direct stream (None:
    the store path)."""
    from jitckpt.wire import layout
    from jitrun.peers import transfer

    tally = Tally()
    serving, fetching = client(port, tally, "decide"), client(port, tally, "decide")
    server = transfer.ReplicaServer(serving, token, source["node_id"], src_root, XFER_JOB).start()
    events: list[dict] = []
    try:
        t0 = time.monotonic()
        path, errors, _ = transfer.ensure_local(
            fetching, token, root=dst, job_id=XFER_JOB, step=1, shard="0", sources=[source], self_node="B",
            timeout_s=600, listen_addr=listen, emit=lambda ev, **f: events.append({"event": ev, **f}))
        secs = time.monotonic() - t0
        msgs, nbytes = tally.msgs["decide"], tally.bytes["decide"]
    finally:
        server.stop(fetching)
    if path is None:
        raise RuntimeError(f"the fetch failed: {errors}")
    [done] = [e for e in events if e["event"] == "replica_fetched"]
    t1 = time.monotonic()
    verified = isinstance(layout.verify(path, XFER_JOB), layout.Replica)
    size = done["bytes"]
    return {"via": done["via"], "seconds": round(secs, 3), "MB_per_s": round(size / 1e6 / secs, 1),
            "store_msgs": msgs, "store_MB": round(nbytes / 1e6, 1), "verify_s": round(time.monotonic() - t1, 3),
            "verified": verified, "fallbacks": [e["why"] for e in events if e["event"] == "replica_fetch_fallback"]}


def bench_transfer(mib: int) -> dict:
    """A replica of ``mib`` MiB fetched by the restore path's own function
    (``transfer.ensure_local``, answered by a ``transfer.ReplicaServer``): over the
    direct stream (a listener on 127.0.0.1) and through the store in 4 MiB chunks (no
    listener: the path a source takes when it cannot reach the requester). Both
    include what the agent does with a copy: fsync, the sha256 of every file against
    the manifest, the rename; ``verify_s`` is that check alone, repeated afterwards
    on the fetched copy."""
    token = secrets.token_hex(16)
    out: dict = {"mib": mib}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        d = Path(tmp)
        source = _make_replica(d / "a", mib)
        srv = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
        for how, listen in (("stream", "127.0.0.1"), ("store", None)):
            got = _restore_fetch(srv.port, token, d / "a", {"node_id": f"A-{how}", **source}, d / how, listen)
            if got["via"] != how or not got["verified"]:
                raise RuntimeError(f"the {how} fetch went {got['via']} or did not verify: {got}")
            out[how] = got
        del srv
    return out


# -- output ----------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    head = (f"{'nodes':>6} {'publish s':>9} {'decide s':>9} {'restart s':>10} {'msgs/fail':>10} {'bytes/fail':>11} "
            f"{'decide msgs':>12} {'report msgs':>12} {'rdzv msgs':>10} {'rdzv bytes':>11} {'healthy msg/s':>14} "
            f"{'cpu s':>6} {'agent cpu':>9} {'load':>5}")
    lines = [head]
    for r in rows:
        t = r["to_restart"]
        msgs, nbytes = sum(t[b]["msgs"] for b in BUCKETS), sum(t[b]["bytes"] for b in BUCKETS)
        hz = sum(v["msgs"] for v in r["healthy_per_s"].values())
        rs = "-" if r["restarted_s"] is None else f"{r['restarted_s']:.3f}"
        lines.append(f"{r['nodes']:>6} {r['published_s']:>9.3f} {r['decision_s']:>9.3f} {rs:>10} {msgs:>10} "
                     f"{nbytes:>11} "
                     f"{t['decide']['msgs']:>12} {t['reports']['msgs']:>12} {t['rdzv']['msgs']:>10} "
                     f"{t['rdzv']['bytes']:>11} {hz:>14} {t['cpu_s']:>6.2f} "
                     f"{r['agent_cpu_to_decision_s']['max']:>9.3f} {r['load_avg']:>5.1f}")
    return "\n".join(lines)


MEDIAN_KEYS = ("published_s", "decision_s", "restarted_s")


def medians(rows: list[dict]) -> list[dict]:
    """Per node count: median, min and max of each time over its runs (a run whose spare
    was not re-admitted has no restarted_s: that column's ``n`` is smaller)."""
    out = []
    for n in sorted({r["nodes"] for r in rows}):
        runs = [r for r in rows if r["nodes"] == n]
        m: dict = {"nodes": n, "runs": len(runs)}
        for k in MEDIAN_KEYS:
            vals = [r[k] for r in runs if r[k] is not None]
            m[k] = ({"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
                    if vals else None)
        out.append(m)
    return out


def medians_table(meds: list[dict]) -> str:
    def cell(v: dict | None) -> str:
        return "-" if v is None else f"{v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f}, n={v['n']})"

    lines = [f"{'nodes':>6} {'runs':>4}  " + "  ".join(f"{k:<28}" for k in MEDIAN_KEYS)]
    for m in meds:
        lines.append(f"{m['nodes']:>6} {m['runs']:>4}  " + "  ".join(f"{cell(m[k]):<28}" for k in MEDIAN_KEYS))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed"
    if len({r["nodes"] for r in rows}) < len(rows):  # repeats: one point per node count, its median run
        rows = [_median_run([r for r in rows if r["nodes"] == n]) for n in sorted({r["nodes"] for r in rows})]
    ns = [r["nodes"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(ns, [r["decision_s"] for r in rows], "o-", label="failure -> every survivor has the decision")
    a.plot(ns, [r["published_s"] for r in rows], "v:", label="failure -> decision published")
    a.plot(ns, [float("nan") if r["restarted_s"] is None else r["restarted_s"] for r in rows], "s-",
           label="failure -> all nodes re-admitted")
    a.axhline(rows[0]["keepalive_expiry_s"], ls=":", c="grey", label="dead node's keep-alive expiry")
    a.set(xscale="log", yscale="log", xlabel="nodes", ylabel="seconds", title="time per failure")
    for bucket, mark in zip(BUCKETS, "o^s", strict=True):
        b.plot(ns, [r["to_restart"][bucket]["msgs"] for r in rows], mark + "-", label=f"{bucket} messages")
    b.plot(ns, [sum(r["to_restart"][k]["bytes"] for k in BUCKETS) / 1e3 for r in rows], "k--", label="all kB")
    b.set(xscale="log", yscale="log", xlabel="nodes", title="store traffic per failure")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return f"plot: {path}"


def _median_run(runs: list[dict]) -> dict:
    """The run whose decision_s is the median (the lower middle for an even count)."""
    return sorted(runs, key=lambda r: r["decision_s"])[(len(runs) - 1) // 2]


def _write(out: Path, args: argparse.Namespace, rows: list[dict], xfer: dict | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"args": vars(args), "rows": rows, "medians": medians(rows), "transfer": xfer},
                              indent=1))
    os.replace(tmp, out.with_suffix(".json"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="2,8,32,128,256", help="comma-separated node counts ('' : none)")
    p.add_argument("--ranks", type=int, default=1, help="simulated ranks per node (one shard each)")
    p.add_argument("--keepalive", type=float, default=1.0, help="rendezvous keep-alive interval, s")
    p.add_argument("--keepalive-n", type=int, default=3, help="keep-alives missed before a node is dead")
    p.add_argument("--last-call", type=float, default=0.1,
                   help="rendezvous last-call timeout, s: a round with min nodes completes after it")
    p.add_argument("--monitor", type=float, default=0.1, help="agent monitor interval while healthy, s")
    p.add_argument("--grace", type=float, default=None,
                   help="wait this long for every node's inventory (the agent's fixed grace) instead of "
                        "knowing the lost node from evidence")
    p.add_argument("--timeout", type=float, default=120.0, help="per phase, s")
    p.add_argument("--no-barrier", dest="barrier", action="store_false",
                   help="an agent joins the next round as soon as it has the decision (see above)")
    p.add_argument("--repeats", type=int, default=1, help="runs per node count (medians printed)")
    p.add_argument("--xfer-mib", type=int, default=1024, help="replica size for the transfer bench (0: skip)")
    p.add_argument("--out", default=str(ROOT / "bench_results" / "scale"), help="prefix of the .json and .png")
    args = p.parse_args(argv)
    # set here, not at import: a process that imports this module (the test of its tables)
    # would hand it to every jitrun it starts, and jitrun's agent does not work under it
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    rows: list[dict] = []
    out = Path(args.out)
    if args.repeats < 1:
        p.error("--repeats: at least 1")
    for n in (int(x) for x in args.nodes.split(",") if x for _ in range(args.repeats)):
        if n < 2:
            p.error("--nodes: at least 2 nodes (one of them fails)")
        rows.append(run_once(n, args))
        print(table(rows[-1:]).splitlines()[-1] if len(rows) > 1 else table(rows), flush=True)
        _write(out, args, rows, None)  # each size as it is measured: a larger one may not finish
        plot(rows, out.with_suffix(".png"))
    if args.repeats > 1 and rows:
        print(f"medians of {args.repeats} runs, seconds from the failure (min-max):")
        print(medians_table(medians(rows)), flush=True)
    xfer = bench_transfer(args.xfer_mib) if args.xfer_mib > 0 else None
    if xfer:
        st, so = xfer["stream"], xfer["store"]
        print(f"replica fetch of {xfer['mib']} MiB (transfer.ensure_local, as the restoring agent): direct stream "
              f"{st['MB_per_s']} MB/s ({st['seconds']} s, {st['store_msgs']} store calls, {st['store_MB']} MB "
              f"through the store); through the store {so['MB_per_s']} MB/s ({so['seconds']} s, {so['store_msgs']} "
              f"store calls, {so['store_MB']} MB); both copies fsynced and verified (sha256 of the files against "
              f"the manifest: {st['verify_s']} s / {so['verify_s']} s of that)")
    _write(out, args, rows, xfer)
    if rows:
        print(plot(rows, out.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
