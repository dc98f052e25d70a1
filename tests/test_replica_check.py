"""The replicas' comparison through a real TCPStore (jitckpt.verify.replica_check), one thread per rank,
and what the launcher makes of the verified digests (the recovery record's ``fingerprint``)."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import store_client as _client

from jitckpt.verify import replica_check
from jitckpt.verify.fingerprint import compute
from jitckpt.wire import auth
from jitrun.recovery.failure import Failure
from jitrun.recovery.record import recovery_record, verified_fingerprint
from jitrun.recovery.reports import ReportBook

TOKEN = "replica-check-token-0123456789abcdef"


def _state(flip: str | None = None) -> list:
    items = [("a", torch.arange(8, dtype=torch.float32)), ("b", torch.ones(3, 3)), ("c", torch.zeros(5))]
    for name, t in items:
        if name == flip:
            t.view(-1)[1:2].view(torch.uint8)[0] ^= 4
    return items


def _run_all(master, shards: list[str], states: list[list], label=(0, "step", 10),
             propose: list[int | None] | None = None) -> list:
    out: list = [None] * len(shards)

    def rank(r: int) -> None:
        try:
            out[r] = replica_check.compare(_client(master), TOKEN, label, r, len(shards), shards[r],
                                           compute(states[r]), timeout_s=30,
                                           propose=propose[r] if propose else None)
        except Exception as e:  # surfaced by the assertion below
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_replicas_that_agree(store):
    verdicts = _run_all(store, ["0"] * 3, [_state() for _ in range(3)])
    assert all(v.ok and v.compared for v in verdicts), verdicts
    assert len({v.digests["0"] for v in verdicts}) == 1


def test_every_rank_reads_the_same_interval_to_the_next_check(store):
    """Adaptive checks (--jit-verify-every not given): each rank posts the interval its own cost
    calls for with its fingerprint; every rank takes the largest, so the next check is at the same
    step everywhere without a message of its own."""
    verdicts = _run_all(store, ["0"] * 3, [_state() for _ in range(3)], label=(0, "step", 20),
                        propose=[200, 1300, 450])
    assert [v.next for v in verdicts] == [1300] * 3
    assert all(v.next is None for v in _run_all(store, ["0"] * 2, [_state(), _state()], label=(0, "step", 30)))


def test_the_interval_keeps_a_check_within_its_budget():
    from jitckpt.ec.schedule import BUDGET, interval_for

    assert interval_for(200, None, 0.006) == 200 and interval_for(200, 0.03, None) == 200
    n = interval_for(200, 0.03, 0.006)  # a 30 ms check, 6 ms minibatches
    assert n == 2500 and 0.03 / (n * 0.006) <= BUDGET
    assert interval_for(200, 0.03, 0.35) == 200  # long minibatches: the least interval


def test_the_odd_one_out_and_the_first_differing_tensor(store):
    verdicts = _run_all(store, ["0"] * 3, [_state(), _state(), _state("b")])
    for v in verdicts:  # every rank reaches the same verdict
        assert not v.ok
        (m,) = v.mismatches
        assert m.tensor == "b" and m.odd == [2] and sorted(map(sorted, m.groups.values())) == [[0, 1], [2]]
        assert v.odd_ranks() == [2] and "first differing tensor 'b'" in v.describe()


def test_two_replicas_name_no_one(store):
    verdicts = _run_all(store, ["0"] * 2, [_state("a"), _state()])
    assert all(not v.ok and v.odd_ranks() == [] and v.mismatches[0].tensor == "a" for v in verdicts)


def test_only_replicas_of_a_shard_are_compared(store):
    """Ranks 0 and 1 hold shard x, 2 and 3 shard y: different states across shards are expected."""
    states = [_state(), _state(), _state("c"), _state("c")]
    verdicts = _run_all(store, ["x", "x", "y", "y"], states)
    assert all(v.ok for v in verdicts), verdicts
    assert verdicts[0].digests["x"] != verdicts[0].digests["y"]
    alone = _run_all(store, ["p", "q"], [_state(), _state("a")], label=(0, "start"))
    assert all(v.ok and not v.compared for v in alone)


def test_a_forged_post_is_refused(store):
    a = auth.of(TOKEN)
    key = a.key("fp", 0, "start", 1)
    store.set(key, auth.of("another-token-0123456789abcdef").seal(key, {"shard": "0", "digest": "0" * 32}))
    with pytest.raises(replica_check.RecordTampered, match="rank 1's state fingerprint"):
        replica_check.compare(_client(store), TOKEN, (0, "start"), 0, 2, "0", compute(_state()), timeout_s=5)


def test_forget_deletes_a_ranks_records(store):
    _run_all(store, ["0"] * 2, [_state("a"), _state()], label=(0, "step", 3))
    a = auth.of(TOKEN)
    replica_check.forget(store, TOKEN, (0, "step", 3), 0)
    assert not store.check([a.key("fp", 0, "step", 3, 0)]) and not store.check([a.key("fpd", 0, "step", 3, 0)])
    assert store.check([a.key("fp", 0, "step", 3, 1)])


# -- the recovery record --------------------------------------------------------------------------


def _book(loaded: dict[int, dict]) -> ReportBook:
    class Events:
        def emit(self, *a, **k):
            pass

    book = ReportBook(Events())
    book.new_round(1, set(loaded))
    for r, m in loaded.items():
        book.absorb({"event": "loaded", "t": 5.0, "rank": r, "attempt": 1, **m}, None, lambda m: None)
    return book


def test_record_carries_the_verified_digest_per_shard():
    book = _book({0: {"loaded": 4, "fingerprint": "a" * 32}, 1: {"loaded": 4, "fingerprint": "a" * 32}})
    book.shards = {0: "0", 1: "0"}
    f = Failure(1.0)
    f.restart_t, f.progress = 2.0, 4
    rec = recovery_record(f, book, 6.0)
    assert rec["fingerprint"] == {"0": "a" * 32}
    book.shards = {0: "s0", 1: "s1"}
    assert verified_fingerprint(book) == {"s0": "a" * 32, "s1": "a" * 32}


def test_record_has_none_when_a_rank_verified_nothing():
    assert verified_fingerprint(_book({0: {"loaded": 4, "fingerprint": "a" * 32}, 1: {"loaded": 4}})) is None
    assert verified_fingerprint(_book({})) is None


def test_a_suspect_is_a_failed_rank_for_the_scheduler_hook():
    from jitrun.recovery import episode

    f = Failure(1.0)
    f.reasons = {0: "state_mismatch", 1: "state_mismatch", 2: "sdc_suspect"}
    f.saved = {0: {}, 1: {}, 2: {}}  # every rank published the verified state
    exited = {0: 75, 1: 75, 2: 75}
    assert episode.failed_ranks(f, exited) == [2]
    assert episode.sdc_suspects(f, exited) == {2}
    f.reasons[2] = "state_mismatch"
    assert episode.failed_ranks(f, exited) == []
