"""Unit tests for jitckpt.wire.report over a real torch.distributed TCPStore."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from jitckpt.wire import auth, report
from jitckpt.wire.report import Reporter, ReportReader


@pytest.fixture(scope="module")
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    assert store.port > 0
    yield store


@pytest.fixture
def client(server):
    return report.connect("127.0.0.1", server.port, timeout_s=30)


def test_key_names_are_per_token_and_do_not_hold_it():
    a, b = auth.of("abc-token-0123456789"), auth.of("abd-token-0123456789")
    assert a.key("n") != b.key("n") and a.key("n") != a.key("r", 1)
    assert "abc-token" not in a.key("n") and a.key("n").startswith("jitckpt/")


def test_round_trip_in_order(server, client):
    w0 = Reporter(client, "tok-order", rank=0)
    w1 = Reporter(report.connect("127.0.0.1", server.port), "tok-order", rank=1)
    reader = ReportReader(server, "tok-order")
    assert reader.poll() == []
    w0.send("started", pid=11)
    w1.send("failure_detected", reason="sigterm", step=4)
    w0.send("checkpoint_saved", step=4, shard="0", seconds=0.25)
    msgs = reader.poll()
    assert [(m["event"], m["rank"]) for m in msgs] == [
        ("started", 0), ("failure_detected", 1), ("checkpoint_saved", 0)]
    assert msgs[0]["pid"] == 11
    assert msgs[1]["reason"] == "sigterm" and msgs[1]["step"] == 4
    assert msgs[2]["seconds"] == 0.25
    assert all(isinstance(m["t"], float) for m in msgs)
    assert reader.poll() == []  # nothing is delivered twice
    w1.send("worker_exit")
    assert [m["event"] for m in reader.poll()] == ["worker_exit"]


def test_reader_with_other_token_sees_nothing(server, client):
    Reporter(client, "tok-a", rank=0).send("started")
    assert ReportReader(server, "tok-b").poll() == []
    assert [m["event"] for m in ReportReader(server, "tok-a").poll()] == ["started"]


def test_unset_slot_is_retried_later(server, client):
    a = auth.of("tok-gap")
    w = Reporter(client, "tok-gap", rank=2)
    reader = ReportReader(server, "tok-gap")
    w.send("first")
    # a writer between add() and set(): slot 2 is taken but not written yet
    slot = client.add(a.key("n"), 1)
    assert slot == 2
    w.send("third")
    assert [m["event"] for m in reader.poll()] == ["first"]  # stops at the gap, keeps order
    assert reader.poll() == []
    a.put(client, {"event": "second", "t": 0.0, "rank": 5}, "r", slot)
    assert [m["event"] for m in reader.poll()] == ["second", "third"]
    assert reader.poll() == []


def test_new_reader_reads_from_the_start(server, client):
    w = Reporter(client, "tok-replay", rank=0)
    w.send("a")
    w.send("b")
    ReportReader(server, "tok-replay").poll()
    assert [m["event"] for m in ReportReader(server, "tok-replay").poll()] == ["a", "b"]


def test_slot_of_a_dead_writer_is_skipped_after_grace(server, client, monkeypatch):
    monkeypatch.setattr(report, "SLOT_GRACE_S", 0.2)
    w = Reporter(client, "tok-dead", rank=1)
    reader = ReportReader(server, "tok-dead")
    client.add(auth.of("tok-dead").key("n"), 1)  # a writer that died between add() and set()
    w.send("after")
    assert reader.poll() == []
    time.sleep(0.3)
    assert [m["event"] for m in reader.poll()] == ["after"]


def test_a_skipped_slot_moves_the_agents_waiter_on(server, client, monkeypatch):
    """The agent's waiter blocks in a store wait on the next slot with a long timeout (a
    timeout prints C++ warnings into the job's output). When that slot's writer died, the
    reader that skips it fills it with a wake record: the waiter moves on and wakes for the
    next report at once, not after its timeout."""
    from jitrun.wakeup import Wakeup

    monkeypatch.setattr(report, "SLOT_GRACE_S", 0.1)
    tok = "tok-waiter"
    w = Reporter(client, tok, rank=0)
    reader = ReportReader(server, tok)
    wake = Wakeup()
    try:
        wake.watch(("127.0.0.1", server.port), tok)
        time.sleep(0.3)  # the waiter blocks on slot 1
        client.add(auth.of(tok).key("n"), 1)  # a writer that died between add() and set(): slot 1
        w.send("second")  # slot 2
        assert reader.poll() == []  # slot 1 empty: its grace starts
        time.sleep(0.2)
        assert [m["event"] for m in reader.poll()] == ["second"]  # slot 1 skipped after the grace (and filled)
        t0 = time.monotonic()
        wake.wait([], 1.0)  # the wake for slot 2, pending or coming now
        w.send("third")
        t1 = time.monotonic()
        wake.wait([], 5.0)
        assert time.monotonic() - t1 < 2.0, "the waiter stayed on the dead writer's slot"
        assert [m["event"] for m in reader.poll()] == ["third"]
        assert t1 - t0 < 1.5
    finally:
        assert wake.close()


def test_the_store_is_read_when_woken_else_once_a_period():
    from jitrun.wakeup import Cadence

    c = Cadence(0.25)
    assert c.due(False, 100.0)  # the first look reads it
    assert not c.due(False, 100.1) and not c.due(False, 100.24)  # quiet ticks within the period do not
    assert c.due(True, 100.2)  # a report or an exit woke the loop: at once
    assert not c.due(False, 100.3) and c.due(False, 100.45)  # the period counts from the last read


def test_the_filled_slot_never_replaces_a_report(server, client, monkeypatch):
    monkeypatch.setattr(report, "SLOT_GRACE_S", 0.0)
    tok = "tok-fill"
    w = Reporter(client, tok, rank=0)
    reader = ReportReader(server, tok)
    w.send("real")
    key = report.Stream(auth.of(tok)).slot(1)
    reader._cursors[0]._fill(key)  # what a skip does, over a slot that holds a report
    assert [m["event"] for m in reader.poll()] == ["real"]


def test_each_node_reads_only_its_own_stream_and_the_jobs(server, client):
    tok = "tok-streams"
    Reporter(client, tok, rank=0, stream="10.0.0.1-11").send("started")
    Reporter(client, tok, rank=1, stream="10.0.0.2-22").send("started")
    Reporter(client, tok, rank=None).send("hang_suspect", node="10.0.0.2-22")  # an agent's message: the job stream
    a = ReportReader(server, tok, streams=("10.0.0.1-11", report.JOB))
    b = ReportReader(server, tok, streams=("10.0.0.2-22", report.JOB))
    assert [(m["event"], m["rank"]) for m in a.poll()] == [("started", 0), ("hang_suspect", None)]
    assert [(m["event"], m["rank"]) for m in b.poll()] == [("started", 1), ("hang_suspect", None)]
    assert ReportReader(server, tok).poll() == [{"event": "hang_suspect", "rank": None, "node": "10.0.0.2-22",
                                                 "t": pytest.approx(time.time(), abs=60)}]
    # a slot of one stream is not a slot of another: the same sequence number, different keys
    s1, s2 = report.Stream(auth.of(tok), "x"), report.Stream(auth.of(tok), "y")
    assert s1.slot(1) != s2.slot(1) and s1.counter != s2.counter != report.Stream(auth.of(tok)).counter
    with pytest.raises(ValueError, match="no '/'"):
        Reporter(client, tok, rank=0, stream="a/1")
