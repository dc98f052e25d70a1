"""The sealed-record helpers (jitckpt/sealed_store.py) against a real TCPStore on loopback:
the wire format stays Auth's, a record that does not verify never comes back as a value,
waits are bounded, and the request loop serves, refuses and stops as its callers rely on."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import store_client as client

from jitckpt.sealed_store import STOP, Requests, Space, StoreRecordError, space
from jitckpt.wire import auth

TOKEN = "sealed-store-test-token-0123456789"
OTHER = "another-jobs-token-0123456789abcd"
SCHEMA = auth.Schema({"ok": bool}, {"why": str})


def test_round_trip_keeps_auths_wire_format(store):
    c = client(store)
    s = space(TOKEN, "mig")
    key = s.put(c, {"ok": True, "why": "x"}, "t1", "restored")
    # the same key and bytes as Auth.put: agents of one job understand each other
    assert key == auth.of(TOKEN).key("mig", "t1", "restored")
    assert c.get(key) == auth.of(TOKEN).seal(key, {"ok": True, "why": "x"})
    assert s.get(c, "answer", "t1", "restored", schema=SCHEMA) == {"ok": True, "why": "x"}
    assert s.wait(c, "answer", "t1", "restored", timeout_s=5, schema=SCHEMA) == {"ok": True, "why": "x"}
    assert s.get(c, "absent", "t2", "restored") is None
    assert s.label("t1", "restored") == "mig/t1/restored"
    # another prefix, another key
    assert Space(TOKEN, "xfer").key("t1", "restored") != key
    assert space(TOKEN, "mig") is s


@pytest.mark.parametrize("how", ["other token", "flipped byte", "unsealed", "another key's seal"])
def test_tampered_record_refused(store, rejected, how):
    c = client(store)
    s = space(TOKEN, "mig")
    key = s.key("t", "restored")
    value = {"ok": True, "why": "abc"}
    if how == "other token":
        raw = auth.Auth(OTHER).seal(key, value)
    elif how == "flipped byte":
        good = bytearray(auth.of(TOKEN).seal(key, value))
        good[good.index(b"abc") + 2] ^= 0x07  # "abc" -> "abd": still JSON, another value
        raw = bytes(good)
        assert json.loads(raw)["v"] == {"ok": True, "why": "abd"}
    elif how == "unsealed":
        raw = json.dumps(value).encode()
    else:
        raw = auth.of(TOKEN).seal(s.key("u", "restored"), value)  # replayed under another key
    c.set(key, raw)
    assert s.get(c, "answer of t", "t", "restored", schema=SCHEMA) is None
    with pytest.raises(StoreRecordError) as err:
        s.wait(c, "answer of t", "t", "restored", timeout_s=5, schema=SCHEMA)
    assert err.value.kind == StoreRecordError.REJECTED
    assert err.value.where == "mig/t/restored" and "answer of t" in str(err.value) and "JITCKPT_TOKEN" in err.value.fix
    assert rejected and all(what == "answer of t" for what, _ in rejected), rejected


def test_flipped_byte_in_mac_refused(store):
    c = client(store)
    s = space(TOKEN, "x")
    key = s.key("k")
    doc = json.loads(auth.of(TOKEN).seal(key, 5))
    doc["mac"] = ("0" if doc["mac"][0] != "0" else "1") + doc["mac"][1:]
    c.set(key, json.dumps(doc))
    with pytest.raises(StoreRecordError, match="does not verify"):
        s.wait(c, "k", "k", timeout_s=5)


def test_wait_times_out_within_its_bound(store):
    c = client(store)
    t0 = time.monotonic()
    with pytest.raises(StoreRecordError) as err:
        space(TOKEN, "mig").wait(c, "answer of t", "t", "restored", timeout_s=0.5, fix="start the target")
    took = time.monotonic() - t0
    assert err.value.kind == StoreRecordError.TIMEOUT and 0.4 < took < 10, took
    assert "within 0.5s" in err.value.why and err.value.fix == "start the target"
    assert str(err.value).startswith("answer of t (record mig/t/restored in the job's store): none came")


def test_wait_returns_a_record_set_later(store):
    c, writer = client(store), client(store)
    s = space(TOKEN, "mig")
    th = threading.Timer(0.3, lambda: s.put(writer, {"ok": False, "why": "late"}, "t", "restored"))
    th.start()
    assert s.wait(c, "answer", "t", "restored", timeout_s=20, schema=SCHEMA) == {"ok": False, "why": "late"}
    th.join()


def test_schema_failure_refused(store, rejected):
    c = client(store)
    s = space(TOKEN, "mig")
    s.put(c, {"ok": "yes"}, "t", "restored")
    with pytest.raises(StoreRecordError) as err:
        s.wait(c, "answer", "t", "restored", timeout_s=5, schema=SCHEMA)
    assert err.value.kind == StoreRecordError.REJECTED and err.value.why == "malformed: 'ok' is str"
    s.put(c, {"ok": True, "extra": 1}, "t", "restored")
    assert s.get(c, "answer", "t", "restored", schema=SCHEMA) is None
    assert ("answer", "malformed: unexpected key(s) ['extra']") in rejected


def test_claim_first_writer_wins(store, rejected):
    c = client(store)
    s = space(TOKEN, "migrate")
    assert s.claim(c, "pause step", 7, 1, "at") == 7
    assert s.claim(c, "pause step", 9, 1, "at") == 7  # the first one stays in force
    c.set(s.key(2, "at"), auth.Auth(OTHER).seal(s.key(2, "at"), 3))
    assert s.claim(c, "pause step 2", 9, 2, "at") is None
    assert [w for w, _ in rejected] == ["pause step 2"]


def test_count(store):
    c = client(store)
    s = space(TOKEN, "mig")
    assert s.count(c, 0, "t", "signals") == 0
    assert s.count(c, 1, "t", "signals") == 1
    assert c.add(auth.of(TOKEN).key("mig", "t", "signals"), 0) == 1


class _Server:
    """A Requests loop on a thread and a client of its own, recording what it handled."""

    def __init__(self, srv, name: str = "test request", stop_on: str | None = None) -> None:
        self.box = Requests(space(TOKEN, "mig"), "to", "node-a")
        self.handled: list[dict] = []
        self.stopping = False
        self.store_errors = 0
        self.stop_on = stop_on
        self.conn = client(srv)
        self.thread = threading.Thread(target=self.box.serve, args=(self.conn, name), kwargs=dict(
            problem=SCHEMA.problem, handle=self.handle, stopping=lambda: self.stopping,
            on_store_error=self.on_error, wait_s=0.3), daemon=True)
        self.thread.start()

    def handle(self, req: dict) -> bool:
        self.handled.append(req)
        space(TOKEN, "mig").put(self.conn, {"ok": True, "why": f"got {req.get('why')}"}, req["why"], "answer")
        return req.get("why") != self.stop_on

    def on_error(self) -> bool:
        self.store_errors += 1
        return True


def test_requests_served_in_order_forged_and_malformed_skipped(store, rejected):
    srv = _Server(store)
    c = client(store)
    s = space(TOKEN, "mig")
    time.sleep(0.8)  # the loop's 0.3 s waits time out meanwhile: it must go on (on_store_error says so)
    assert srv.box.send(c, {"ok": True, "why": "a"}) == 1
    # a forged request takes a number too; the loop skips it with one line
    n = s.count(c, 1, "to", "node-a", "n")
    c.set(s.key("to", "node-a", n), auth.Auth(OTHER).seal(s.key("to", "node-a", n), {"ok": True, "why": "evil"}))
    srv.box.send(c, {"ok": "no", "why": "bad"})  # sealed, but fails the schema
    srv.box.send(c, {"ok": True, "why": "b"})
    assert s.wait(c, "answer b", "b", "answer", timeout_s=20, schema=SCHEMA) == {"ok": True, "why": "got b"}
    assert [r["why"] for r in srv.handled] == ["a", "b"]
    assert ("test request 2 to this node", "its MAC does not verify under the job token (forged, or another "
            "job's)") in rejected
    assert ("test request", "malformed: 'ok' is str") in rejected
    srv.box.stop(c)
    srv.thread.join(10)
    assert not srv.thread.is_alive()
    assert srv.store_errors >= 1


def test_requests_loop_ends_when_handle_says_so(store):
    srv = _Server(store, stop_on="last")
    c = client(store)
    srv.box.send(c, {"ok": True, "why": "last"})
    srv.thread.join(10)
    assert not srv.thread.is_alive() and [r["why"] for r in srv.handled] == ["last"]
    srv.box.send(c, {"ok": True, "why": "after"})
    time.sleep(0.5)
    assert [r["why"] for r in srv.handled] == ["last"]


def test_requests_loop_ends_on_store_error_or_stopping(store):
    box = Requests(space(TOKEN, "xfer"), "req", "n1")
    conn = client(store)
    calls = []
    t0 = time.monotonic()
    box.serve(conn, "r", problem=SCHEMA.problem, handle=lambda r: calls.append(r), stopping=lambda: False,
              on_store_error=lambda: False, wait_s=0.2)
    assert calls == [] and time.monotonic() - t0 < 10
    box.serve(conn, "r", problem=SCHEMA.problem, handle=lambda r: calls.append(r), stopping=lambda: True,
              on_store_error=lambda: True)
    assert calls == []


def test_stop_is_a_sealed_request(store):
    c = client(store)
    box = Requests(space(TOKEN, "mig"), "to", "n")
    box.stop(c)
    assert space(TOKEN, "mig").get(c, "stop", "to", "n", 1) == STOP
