"""Worker -> launcher reports through torch.distributed's TCPStore.

Both sides connect as clients to the store torchrun's agent already hosts
(MASTER_ADDR/MASTER_PORT of the workers), so there is no server of ours. Every
key lives under ``jitckpt/<token>/``: the token is random per job and given
only to the job's processes, so a stranger on the network cannot inject reports
into a namespace the launcher reads.

Protocol: a writer takes a sequence number with ``add(<ns>/n, 1)`` and then sets
``<ns>/r/<seq>`` to a JSON object. The reader remembers how far it has read and
polls ``add(<ns>/n, 0)``; a slot whose value is not set yet is retried on the
next poll (the writer is between its two calls) and skipped after
``SLOT_GRACE_S`` (the writer died between them: a report is lost, not the
reports of every other rank behind it).
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any


def namespace(token: str) -> str:
    return f"jitckpt/{token}"


def connect(host: str, port: int, timeout_s: float = 30.0):  # -> dist.TCPStore
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class Reporter:
    """Worker side. Thread-safe enough: TCPStore client calls are serialized by
    the store client itself; we only ever add() then set()."""

    def __init__(self, store, token: str, rank: int | None) -> None:
        self._store = store
        self._ns = namespace(token)
        self._rank = rank

    def send(self, event: str, **fields: Any) -> None:
        msg = {"event": event, "t": time.time(), "rank": self._rank, **fields}
        seq = self._store.add(f"{self._ns}/n", 1)
        self._store.set(f"{self._ns}/r/{seq}", json.dumps(msg))


SLOT_GRACE_S = 2.0
WAKE = "_wake"  # a launcher-internal record (see jitrun.wakeup); readers skip it


class ReportReader:
    """Launcher side."""

    def __init__(self, store, token: str, from_now: bool = False) -> None:
        self._store = store
        self._ns = namespace(token)
        # an agent that joins a running job (a replacement) skips the reports
        # of rounds it was not part of
        self._next = self._store.add(f"{self._ns}/n", 0) + 1 if from_now else 1
        self._waiting_since: float | None = None

    def poll(self, drain: bool = False) -> list[dict]:
        """The reports written since the last poll. ``drain``: the writers
        are all gone (the job ended), so a slot still empty is skipped at once
        instead of after SLOT_GRACE_S."""
        out: list[dict] = []
        last = self._store.add(f"{self._ns}/n", 0)
        while self._next <= last:
            key = f"{self._ns}/r/{self._next}"
            if not self._store.check([key]):
                now = time.monotonic()
                if self._waiting_since is None:
                    self._waiting_since = now
                if now - self._waiting_since < SLOT_GRACE_S and not drain:
                    break
            else:
                msg = json.loads(self._store.get(key))
                if msg.get("event") != WAKE:
                    out.append(msg)
            self._waiting_since = None
            self._next += 1
        return out
