"""Unit tests of the job-wide pieces: the restore decision (jitrun.decision, jitrun.decide),
the loaded-state consistency check (jitckpt.verify.consistency), replica transfer
through a real TCPStore (jitrun.peers.transfer) and derived network settings."""

from __future__ import annotations

import os
import threading
import time
from argparse import Namespace
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from jitckpt.verify.consistency import FRESH, StateDivergence, check_loaded
from jitckpt.wire import contract, layout
from jitrun import decide, decision, netconf
from jitrun.peers import transfer


def inv(node: str, *reps: tuple[int, str, int]) -> dict:
    return {"node_id": node, "host": node, "addr": node,
            "replicas": [{"step": s, "shard": sh, "rank": r, "manifest_sha256": f"{node}{s}{sh}{r}", "saved_at": 1.0}
                         for s, sh, r in reps]}


NODES = [{"node_id": n, "host": n, "addr": n} for n in ("a", "b", "c")]


def test_newest_step_complete_across_nodes():
    # shard 0 on node a, shard 1 on node b: only together is step 7 complete
    invs = [inv("a", (7, "0", 0), (5, "0", 0), (5, "1", 2)), inv("b", (7, "1", 3)), inv("c")]
    d = decision.compute(1, invs, {"0": "0", "1": "0", "2": "1", "3": "1"}, NODES, decided_by="a")
    assert d.step == 7 and d.shards == ["0", "1"]
    assert [s["node_id"] for s in d.sources["1"]] == ["b"]
    assert d.lost == []


def test_incomplete_newest_falls_back_and_lost_nodes_are_named():
    invs = [inv("a", (9, "0", 0), (4, "0", 0), (4, "1", 1))]
    d = decision.compute(2, invs, {"0": "0", "1": "1"}, NODES, decided_by="a")
    assert d.step == 4
    assert [n["node_id"] for n in d.lost] == ["b", "c"]
    assert "1 of 3" in d.why


def test_sources_are_a_few_holders_not_every_node():
    nodes = [{"node_id": f"n{i:02d}", "host": "h", "addr": "a"} for i in range(20)]
    invs = [{**n, "replicas": [{"step": 9, "shard": "0", "rank": i, "manifest_sha256": "m"}]}
            for i, n in enumerate(nodes)]
    d = decision.compute(1, invs, {str(i): "0" for i in range(20)}, nodes, decided_by="n00")
    assert d.step == 9 and [s["node_id"] for s in d.sources["0"]] == [f"n{i:02d}" for i in range(decision.MAX_SOURCES)]


def test_nothing_complete():
    d = decision.compute(0, [inv("a", (3, "0", 0))], {"0": "0", "1": "1"}, NODES[:1], decided_by="a")
    assert d.step is None and d.sources == {} and "no step" in d.why


def test_decision_roundtrip_and_first_writer_wins():
    store = dist.HashStore()
    a = decide.Coordinator(store, "tok", decision.NodeInfo("a", "a", "a"))
    b = decide.Coordinator(store, "tok", decision.NodeInfo("b", "b", "b"))
    da = decision.compute(3, [inv("a", (5, "0", 0))], {"0": "0"}, NODES[:2], decided_by="a")
    db = decision.compute(3, [inv("b", (2, "0", 1))], {"0": "0"}, NODES[:2], decided_by="b")
    assert a.publish(da).step == 5
    assert b.publish(db).step == 5, "the later writer reads the decision in force"
    assert b.latest() == a.decided(3)
    assert decide.Coordinator(store, "other", decision.NodeInfo("x", "x", "x")).latest() is None


def _agree_all(coords, round_, until_s=10.0, silent=None):
    """Every coordinator's ``agree`` at once (a thread each); the decisions and
    which of them computed one."""
    computed, got = [], {}

    def one(c):
        def compute_here():
            computed.append(c.node.node_id)
            invs = [inv(x.node.node_id, (4, "0", i)) for i, x in enumerate(coords)]
            return decision.compute(round_, invs, {"0": "0"}, NODES[:len(coords)], decided_by=c.node.node_id)
        got[c.node.node_id] = c.agree(round_, compute_here, time.monotonic() + until_s, silent)

    ts = [threading.Thread(target=one, args=(c,)) for c in coords]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    return got, computed


def _coords(store, token="t", names=("a", "b", "c")):
    return [decide.Coordinator(store, token, decision.NodeInfo(n, n, n)) for n in names]


def test_one_agent_decides_and_the_others_read_its_decision():
    store = dist.HashStore()
    got, computed = _agree_all(_coords(store), 2)
    assert len(computed) == 1, f"every agent computed the decision: {computed}"
    assert {d.decided_by for d in got.values()} == set(computed) and len(got) == 3
    assert all(d == got[computed[0]] for d in got.values()) and got["a"].step == 4
    assert decide.Coordinator(store, "t", decision.NodeInfo("z", "z", "z")).latest() == got["a"]


def test_a_decider_that_went_silent_or_never_decided_is_taken_over():
    store = dist.HashStore()
    a, b, c = _coords(store)
    assert a.claim(5) == "a" and b.claim(5) == "a", "the first claim stands"
    # a's agent stops beating after its claim: b and c decide (first writer wins)
    t0 = time.monotonic()
    got, computed = _agree_all([b, c], 5, silent=lambda ids: set(ids) & {"a"})
    # (one that found the other's decision before the silence reads it)
    assert computed and set(computed) <= {"b", "c"} and time.monotonic() - t0 < 5
    assert got["b"] == got["c"] and got["b"].decided_by in computed
    # no liveness evidence (static rendezvous): taken over at the deadline
    assert a.claim(6) == "a"
    t0 = time.monotonic()
    got, computed = _agree_all([b, c], 6, until_s=0.5)
    assert computed and set(computed) <= {"b", "c"} and 0.4 < time.monotonic() - t0 < 5
    assert got["b"] == got["c"] and got["b"].decided_by in computed


def test_a_forged_claim_makes_every_agent_decide(capsys):
    store = dist.HashStore()
    coords = _coords(store)
    store.set(coords[0].auth.key("round", 7, "decider"), b"the attacker decides")
    got, computed = _agree_all(coords, 7)
    assert sorted(computed) == ["a", "b", "c"]
    assert len({d.decided_by for d in got.values()}) == 1, "first writer wins: one decision for all"
    assert "decider claim" in capsys.readouterr().err


def test_the_decider_knows_every_nodes_shards_also_a_lost_ones(capsys):
    """Each agent reads only its own ranks' reports: the shard map each posts is how the
    deciding agent knows that a shard only a lost node's ranks held is needed."""
    store = dist.HashStore()
    a, b, c = _coords(store)
    a.post_shards({0: "0", 1: "1"})
    b.post_shards({2: "0", 3: "1"})
    c.post_shards({4: "2"})  # c is lost later: no inventory, but its shard counts
    got = a.shard_map(NODES, {})
    assert got == {"0": "0", "1": "1", "2": "0", "3": "1", "4": "2"}
    d = decision.compute(3, [inv("a", (9, "0", 0), (9, "1", 1)), inv("b", (9, "0", 2), (9, "1", 3))], got, NODES, "a")
    assert d.step is None and d.shards == ["0", "1", "2"], "shard 2 has no replica: step 9 is not complete"
    # a record that does not verify, or one posted under another node's name, counts for nothing
    store.set(a.auth.key("shards", "b"), b'{"v": {"node_id": "b", "shards": {"2": "7"}}, "mac": "00"}')
    a.auth.put(store, {"node_id": "a", "shards": {"4": "9"}}, "shards", "c")
    assert a.shard_map(NODES, {}) == {"0": "0", "1": "1"}
    assert "shard map of b" in capsys.readouterr().err



def test_the_decision_carries_what_only_other_nodes_ranks_reported():
    """The deciding agent's recovery record needs the failure's step and time, which
    the failed node's ranks reported to their own agent only: they travel in the inventories."""
    a = {**inv("a", (9, "0", 0)), "progress": 9, "fault_t": None, "last_alive": 5.0}
    b = {**inv("b", (9, "0", 1)), "progress": 10, "fault_t": 4.5, "last_alive": 4.0}
    d = decision.compute(3, [a, b], {"0": "0", "1": "0"}, NODES[:2], "a")
    assert (d.progress, d.fault_t, d.last_alive) == (10, 4.5, 4.0)
    assert decision.Decision.from_json(d.to_json()) == d
    assert decision.compute(3, [inv("a", (9, "0", 0))], {"0": "0"}, NODES[:1], "a").progress == -1


def test_wait_inventories_takes_busy_nodes_until_final_and_drops_silent_ones():
    store = dist.HashStore()
    me = decide.Coordinator(store, "t", decision.NodeInfo("a", "a", "a"))
    slow = decide.Coordinator(store, "t", decision.NodeInfo("b", "b", "b"))
    me.post(0, inv("a"))
    slow.handling(0)  # b is saving: wait for it; c never answered: lost
    assert me.failed(0)
    threading.Timer(0.5, lambda: slow.post(0, inv("b", (1, "0", 1)))).start()
    t0 = time.monotonic()
    got = me.wait_inventories(0, NODES, grace=t0 + 0.2, final=t0 + 10)
    assert sorted(i["node_id"] for i in got) == ["a", "b"]
    assert time.monotonic() - t0 < 5


def test_consistency_refuses_different_steps_and_ignores_ranks_that_never_asked():
    store = dist.HashStore()
    res = {}

    def rank(r, v):
        try:
            res[r] = check_loaded(store, "t", 1, r, 3, v, timeout_s=10)
        except StateDivergence as e:
            res[r] = e

    ts = [threading.Thread(target=rank, args=a) for a in ((0, 12), (1, None), (2, 12))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert all(isinstance(v, dict) for v in res.values()), res
    ts = [threading.Thread(target=rank, args=a) for a in ((0, 12), (1, FRESH), (2, 12))]
    store2 = dist.HashStore()
    store = store2
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert all(isinstance(v, StateDivergence) for v in res.values()), res
    assert "ranks [1]" in str(res[0]) and "No training step was taken" in str(res[0])


def _replica(root: Path, step: int, rank: int, payload: bytes) -> Path:
    tmp = layout.staging_dir(root, step, "0", rank)
    (tmp / "state.pt").write_bytes(payload)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "x.bin").write_bytes(payload[::-1])
    return layout.publish(tmp, root=root, step=step, shard="0", rank=rank, world_size=2, job_id="j")


@pytest.fixture
def tcp_store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=20))
    yield server
    del server


def test_transfer_through_a_real_tcpstore(tmp_path, tcp_store, monkeypatch):
    src_root, dst_root = tmp_path / "src", tmp_path / "dst"
    payload = bytes(range(256)) * 70000  # ~17 MiB: several chunks, the window is exercised
    rep = _replica(src_root, 8, 0, payload)
    msha = layout.sha256_file(rep / layout.MANIFEST)
    client = dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False, wait_for_workers=False)
    server = transfer.ReplicaServer(client, "tok", "A", src_root, "j").start()
    src = {"node_id": "A", "rank": 0, "manifest_sha256": msha}
    path, errors, fetched = transfer.ensure_local(client, "tok", root=dst_root, job_id="j", step=8, shard="0",
                                                  sources=[src], self_node="B", timeout_s=20)
    assert errors == [] and fetched == "A"
    ok = layout.verify(path, "j")
    assert isinstance(ok, layout.Replica) and (path / "state.pt").read_bytes() == payload
    # already local: no transfer
    assert transfer.ensure_local(client, "tok", root=dst_root, job_id="j", step=8, shard="0",
                                 sources=[src], self_node="B")[2] is None
    # a lying source (manifest checksum differs from the announced one) is refused, nothing left behind
    bad = {**src, "manifest_sha256": "0" * 64}
    path2, errors2, _ = transfer.ensure_local(client, "tok", root=tmp_path / "dst2", job_id="j", step=8,
                                              shard="0", sources=[bad], self_node="B", timeout_s=20)
    assert path2 is None and "does not match" in errors2[0]
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "dst2").rglob("*"))
    assert server.stop(client)


def test_transfer_detects_corruption_and_uses_the_next_source(tmp_path, tcp_store, monkeypatch):
    payload = b"weights" * 1000
    a_root, b_root = tmp_path / "a", tmp_path / "b"
    msha_a = layout.sha256_file(_replica(a_root, 3, 0, payload) / layout.MANIFEST)
    msha_b = layout.sha256_file(_replica(b_root, 3, 1, payload) / layout.MANIFEST)
    client = dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False, wait_for_workers=False)
    monkeypatch.setenv(contract.TEST_CORRUPT_TRANSFER.name, "1")
    bad_server = transfer.ReplicaServer(client, "tok", "A", a_root, "j").start()
    monkeypatch.delenv(contract.TEST_CORRUPT_TRANSFER.name)
    good_server = transfer.ReplicaServer(client, "tok", "B", b_root, "j").start()
    sources = [{"node_id": "A", "rank": 0, "manifest_sha256": msha_a},
               {"node_id": "B", "rank": 1, "manifest_sha256": msha_b}]
    path, errors, fetched = transfer.ensure_local(client, "tok", root=tmp_path / "c", job_id="j", step=3,
                                                  shard="0", sources=sources, self_node="C", timeout_s=20)
    assert fetched == "B" and len(errors) == 1 and "checksum mismatch" in errors[0]
    assert (path / "state.pt").read_bytes() == payload
    assert bad_server.stop(client) and good_server.stop(client)


def test_netconf_derives_interface_and_is_host():
    lo_only = netconf.local_ipv4()
    assert lo_only.get("lo") == "127.0.0.1"
    env: dict = {}
    args = Namespace(local_addr="127.0.0.1", rdzv_backend="c10d", rdzv_endpoint="localhost:29400", rdzv_conf="")
    assert netconf.derive(args, env) == [] and env == {}, "loopback says nothing about the job's interface"
    other = Namespace(local_addr=None, rdzv_backend="c10d", rdzv_endpoint="192.0.2.77:29400", rdzv_conf="x=1")
    said = netconf.derive(other, env)
    assert other.rdzv_conf == "x=1,is_host=0" and said
    given = Namespace(local_addr=None, rdzv_backend="c10d", rdzv_endpoint="192.0.2.77:29400", rdzv_conf="is_host=1")
    netconf.derive(given, env)
    assert given.rdzv_conf == "is_host=1", "what the user set wins"


class _FakeHandler:
    """Just what rdzv.install touches of torch's DynamicRendezvousHandler."""

    def __init__(self, store, rank: int, port: int | None, waiting: int = 0) -> None:
        from types import SimpleNamespace

        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        self._store = store
        self._state_holder = SimpleNamespace(state=SimpleNamespace(round=0))
        self._bootstrap_store_info = RendezvousStoreInfo("stale-host", 1)  # what torch caches after round 0
        self._shared_tcp_store_server = SimpleNamespace(port=port) if port else None
        self._this_node = SimpleNamespace(addr=f"node{rank}")
        self.use_agent_store = True
        self._rank, self._waiting = rank, waiting
        self._info = lambda: RendezvousInfo(dist.PrefixStore(f"round{self._state_holder.state.round}", store),
                                            rank, 2, self._bootstrap_store_info)

    def next_rendezvous(self):
        self._state_holder.state.round += 1
        return self._info()

    def num_nodes_waiting(self) -> int:
        return self._waiting


def test_rdzv_republishes_the_workers_store_every_round():
    """torch 2.13 writes MASTER_ADDR/PORT only in a node's first round; a node
    joining round k then waits forever. After install, rank 0 writes them for
    every round and the others read them (following a rank-0 change)."""
    from jitrun import rdzv

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    r0, r1 = _FakeHandler(store, 0, port=4242), _FakeHandler(store, 1, port=None)
    rdzv.install(r0)
    rdzv.install(r1)
    info0 = r0.next_rendezvous()
    assert (info0.bootstrap_store_info.master_addr, info0.bootstrap_store_info.master_port) == ("node0", 4242)
    info1 = r1.next_rendezvous()  # a replacement: reads what rank 0 wrote for this round
    assert (info1.bootstrap_store_info.master_addr, info1.bootstrap_store_info.master_port) == ("node0", 4242)
    assert rdzv.current_round(r1) == 1 and rdzv.coordination_store(r1) is store


def test_rdzv_hides_waiting_nodes_while_healthy():
    from jitrun import rdzv

    seen = []
    healthy = [True]
    h = _FakeHandler(dist.HashStore(), 0, port=1, waiting=1)
    rdzv.install(h, on_spare=seen.append, healthy=lambda: healthy[0])
    assert h.num_nodes_waiting() == 0 and seen == [1]
    healthy[0] = False
    assert h.num_nodes_waiting() == 1


def test_rdzv_reads_the_state_for_spares_at_a_bounded_rate(monkeypatch):
    """Every look for spares reads the whole rendezvous state (every node's entry):
    a healthy agent looks at most every spare_look_s(), and the poll period grows
    with the job beyond POLL_NODES nodes, so the endpoint's load stays linear."""
    from jitrun import rdzv

    h = _FakeHandler(dist.HashStore(), 0, port=1, waiting=1)
    looks = []
    orig = h.num_nodes_waiting
    h.num_nodes_waiting = lambda: looks.append(1) or orig()
    healthy = [True]
    rdzv.install(h, on_spare=lambda n: None, healthy=lambda: healthy[0])
    assert [h.num_nodes_waiting() for _ in range(5)] == [0] * 5 and len(looks) == 1
    monkeypatch.setattr(rdzv, "spare_look_s", lambda: 0.0)
    assert h.num_nodes_waiting() == 0 and len(looks) == 2
    healthy[0] = False  # a failure: torch's agent gets the real count at once
    assert h.num_nodes_waiting() == 1 and len(looks) == 3
    assert rdzv.poll_period(2) == rdzv.poll_period(rdzv.POLL_NODES) == rdzv.POLL_S
    assert rdzv.poll_period(16 * rdzv.POLL_NODES) == pytest.approx(16 * rdzv.POLL_S)


def test_a_rank_stopped_here_after_another_nodes_ranks_finished_is_a_failure():
    """Each agent reads only its own node's reports: that ranks elsewhere finished the
    job this round reaches it as the round's finish mark, set by their agent."""
    import signal
    import subprocess

    from jitrun.recovery.detect import Detector
    from jitrun.recovery.reports import ReportBook
    from jitrun.recovery.restore import Restorer
    from jitrun.workers import Proc

    class Events:
        def __init__(self) -> None:
            self.seen: list[tuple] = []

        def emit(self, ev, **f) -> None:
            self.seen.append((ev, f))

    store = dist.HashStore()
    a, b = _coords(store, names=("a", "b"))
    book_b = ReportBook(Events())
    book_b.new_round(4, {2, 3})
    book_b.absorb({"event": "finished", "t": 1.0, "rank": 2, "attempt": 4}, None, lambda m: None)
    restorer_b = Restorer(Namespace(), a.node, Events())
    restorer_b.coord = b
    assert not a.some_finished(4)
    restorer_b.share(book_b, 4)
    assert a.some_finished(4) and not a.some_finished(5), "the mark is per round"

    p = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.2)
        procs = {0: Proc(p.pid, p.poll, p.wait)}
        ev = Events()
        det = Detector(ReportBook(ev), ev)
        assert det.check([], {0: None}, procs, False, peers_finished=lambda: False) is None
        f = det.check([], {0: None}, procs, False, peers_finished=lambda: a.some_finished(4))
        assert f is not None and ("failure_detected", {"rank": 0, "reason": "stopped after peers finished"}) in ev.seen
    finally:
        p.kill()
        p.wait()


def test_an_agent_restarts_on_the_decision_it_read_not_an_older_newest_record(monkeypatch):
    """The decider publishes the round's decision, then the job's newest-decision
    record; an agent that read the round's decision can restart in between. It must
    restore the step it read (seen in a two-node static job: one rank loaded the
    previous failure's step 9 while the decision was 15, and the job stopped at the
    loaded-state check)."""
    from dataclasses import asdict

    from jitrun.recovery.restore import Restorer

    class Events:
        def emit(self, ev, **f) -> None:
            pass

    store = dist.HashStore()
    a, b = _coords(store, names=("a", "b"))
    nodes = [{"node_id": n, "host": n, "addr": n} for n in ("a", "b")]
    old = a.publish(decision.compute(1, [inv("a", (9, "0", 0)), inv("b", (9, "0", 1))], {"0": "0", "1": "0"}, nodes,
                                   decided_by="a"))
    new = a.publish(decision.compute(2, [inv("a", (15, "0", 0)), inv("b", (9, "0", 1))], {"0": "0", "1": "0"}, nodes,
                                   decided_by="a"))
    assert (old.step, new.step) == (9, 15) and b.latest() == new
    a.auth.put(store, asdict(old), "decision")  # the window: the round's record is there, the newest not yet
    for var in (contract.RESTORE_STEP, contract.RESTORE_SOURCE, contract.EC_FALLBACK_STEP):
        monkeypatch.delenv(var.name, raising=False)
    fetched: list[tuple[int, str]] = []
    r = Restorer(Namespace(), b.node, Events())
    r.coord = b
    monkeypatch.setattr(r, "_fetch", lambda d, shard: fetched.append((d.step, shard)))
    r.decision = b.decided(2)  # what ``agree`` gave this agent
    r.prepare({1})
    assert contract.RESTORE_STEP.get() == "15" and fetched == [(15, "0")] and r.decision == new
    # an agent that took no part (a spare, a replacement) takes the newest record
    r2 = Restorer(Namespace(), decision.NodeInfo("z", "z", "z"), Events())
    r2.coord = decide.Coordinator(store, "t", r2._node)
    monkeypatch.setattr(r2, "_fetch", lambda d, shard: None)
    r2.prepare({1})
    assert contract.RESTORE_STEP.get() == "9" and r2.decision == old


def test_restore_plan_is_one_value_on_both_sides():
    """The agents' plan and the worker's reading of it: the same value through the environment."""
    from jitckpt.wire.contract import RestorePlan

    for plan in (RestorePlan(), RestorePlan(True, None), RestorePlan(True, 12), RestorePlan(True, 8, 10),
                 RestorePlan(True, None, 10)):
        env: dict[str, str] = {"JITCKPT_RESTORE_SOURCE": "ec", "JITCKPT_EC_FALLBACK_STEP": "3"}  # a stale plan
        plan.to_env(env)
        assert RestorePlan.from_env(env) == plan, (plan, env)
    ec = RestorePlan(True, 8, 10)
    assert ec.decoded() == RestorePlan(True, 10) and ec.fallback() == RestorePlan(True, 8)
    assert RestorePlan(True, None, 10).fallback() == RestorePlan(True, None)  # a fresh start, said
