"""Evidence of a lost agent (launcher/recovery/alive.py) over a real TCPStore."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from jitrun.recovery import alive

TOKEN = "t" * 32


@pytest.fixture()
def store():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield s
    del s


def test_a_beating_agent_is_never_silent_and_a_stopped_one_is(store):
    beat = alive.Pulse(store, TOKEN, "a-1", "a_1_0")
    other = alive.Pulse(store, TOKEN, "b-2", None)
    watch = alive.Silence(store, TOKEN, quiet_s=0.6)
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert watch.silent(["a-1", "b-2"]) == set()
            time.sleep(0.05)
        other.stop()
        time.sleep(0.8)
        deadline = time.monotonic() + 3.0
        while watch.silent(["a-1", "b-2"]) != {"b-2"}:
            assert time.monotonic() < deadline, "a stopped agent was never called silent"
            time.sleep(0.05)
        assert watch.node_of("a_1_0") == "a-1"
        assert watch.node_of("b_2_0") is None  # it sealed no rendezvous name
    finally:
        beat.stop()
        other.stop()


def test_a_counter_that_never_moved_is_no_evidence(store):
    watch = alive.Silence(store, TOKEN, quiet_s=0.1)
    for _ in range(5):
        assert watch.silent(["never-started"]) == set()
        time.sleep(0.05)


def test_a_name_record_under_another_token_is_ignored(store):
    beat = alive.Pulse(store, "x" * 32, "c-3", "c_3_0")
    try:
        assert alive.Silence(store, TOKEN).node_of("c_3_0") is None
    finally:
        beat.stop()
