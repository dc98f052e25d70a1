"""Worker -> launcher reports through torch.distributed's TCPStore.

Both sides connect as clients to the store torchrun's agent already hosts
(MASTER_ADDR/MASTER_PORT of the workers), so there is no server of ours. Key
names and records are sealed under the job token (``jitckpt.auth``): a stranger
who reaches the store can neither read the token nor inject a report the
launcher accepts; a report that does not verify is skipped with one line.

Protocol: a writer takes a sequence number with ``add(n, 1)`` and then sets
slot ``r/<seq>`` to a sealed JSON object. The reader remembers how far it has
read and polls ``add(n, 0)``; a slot whose value is not set yet is retried on
the next poll (the writer is between its two calls) and skipped after
``SLOT_GRACE_S`` (the writer died between them: a report is lost, not the
reports of every other rank behind it).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from . import auth

_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
# the fields the agent needs of some events
_NEEDS = {"registered": ("shard",), "resumed": ("step",), "checkpoint_saved": ("step", "shard"),
          "migrating": ("gen", "ctl")}


def _needs(m: dict) -> str | None:
    if "self" in m:  # the events log's emit() takes the fields as keyword arguments
        return "a field named 'self'"
    missing = [k for k in _NEEDS.get(m["event"], ()) if k not in m]
    return f"{m['event']} without {missing}" if missing else None


# what the agent reads from a report, typed; a report carries more fields for the events log
REPORT = auth.Schema(
    {"event": str, "t": _NUM, "rank": (int, type(None))},
    {"step": int, "shard": str, "attempt": int, "gen": int, "ctl": str, "reason": str,
     # a step, "fresh" or None; a state_divergence report carries every rank's (a dict)
     "loaded": (int, str, dict, type(None)), "query_t": _OPT_NUM, "proc_start_t": _OPT_NUM, "minibatch_s": _OPT_NUM},
    extra=True, nested=_needs)


class StoreTampered(RuntimeError):
    """A counter of the job's store holds what no agent or worker of the job wrote."""


def connect(host: str, port: int, timeout_s: float = 30.0):  # -> dist.TCPStore
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class Reporter:
    """Worker side. Thread-safe enough: TCPStore client calls are serialized by
    the store client itself; we only ever add() then set()."""

    def __init__(self, store, token: str, rank: int | None) -> None:
        self._store = store
        self._auth = auth.of(token)
        self._rank = rank

    def send(self, event: str, **fields: Any) -> None:
        msg = {"event": event, "t": time.time(), "rank": self._rank, **fields}
        seq = self._store.add(self._auth.key("n"), 1)
        self._auth.put(self._store, msg, "r", seq)


SLOT_GRACE_S = 2.0
BATCH = 256  # report slots read in one multi_get
WAKE = "_wake"  # a launcher-internal record (see jitrun.wakeup); readers skip it


class ReportReader:
    """Launcher side."""

    def __init__(self, store, token: str, from_now: bool = False) -> None:
        self._store = store
        self._auth = auth.of(token)
        self._n = self._auth.key("n")
        # an agent that joins a running job (a replacement) skips the reports
        # of rounds it was not part of
        self._next = self._count() + 1 if from_now else 1
        self._waiting_since: float | None = None

    def _count(self) -> int:
        try:
            return int(self._store.add(self._n, 0))
        except (RuntimeError, ValueError):  # torch's DistStoreError is a RuntimeError
            raise StoreTampered("jitrun: the workers' report counter in the job's store is not a number: "
                                "something outside the job wrote it (see the README's threat model); "
                                "stopping") from None

    def poll(self, drain: bool = False) -> list[dict]:
        """The reports written since the last poll. ``drain``: the writers
        are all gone (the job ended), so a slot still empty is skipped at once
        instead of after SLOT_GRACE_S."""
        out: list[dict] = []
        last = self._count()
        batch = True  # until a batch finds an empty slot: then one by one, as before batching
        while self._next <= last:
            if batch and (batch := self._batch(last, out)):
                continue
            key = self._auth.key("r", self._next)
            if not self._store.check([key]):
                now = time.monotonic()
                if self._waiting_since is None:
                    self._waiting_since = now
                if now - self._waiting_since < SLOT_GRACE_S and not drain:
                    break
            else:
                self._take(self._next, key, self._store.get(key), out)
            self._waiting_since = None
            self._next += 1
        return out

    def _batch(self, last: int, out: list[dict]) -> bool:
        """Read the slots from the next one up to ``last`` (at most BATCH) in two round
        trips when all are set: every agent reads every rank's reports, and a round trip
        per report made a failure's store traffic grow as the square of the job's size.
        False (nothing read) when a slot is still empty: the caller takes them one by one."""
        seqs = list(range(self._next, min(last, self._next + BATCH - 1) + 1))
        if len(seqs) < 2:
            return False
        keys = [self._auth.key("r", s) for s in seqs]
        if not self._store.check(keys):
            return False
        for s, key, raw in zip(seqs, keys, self._store.multi_get(keys), strict=True):
            self._take(s, key, raw, out)
        self._waiting_since = None
        self._next = seqs[-1] + 1
        return True

    def _take(self, seq: int, key: str, raw: bytes, out: list[dict]) -> None:
        msg = self._auth.open(key, raw, f"report {seq}", REPORT)
        if msg is not None and msg["event"] != WAKE:
            out.append(msg)
