"""Worker -> launcher reports through torch.distributed's TCPStore.

Both sides connect as clients to the store torchrun's agent already hosts
(MASTER_ADDR/MASTER_PORT of the workers), so there is no server of ours. Key
names and records are sealed under the job token (``jitckpt.wire.auth``): a stranger
who reaches the store can neither read the token nor inject a report the
launcher accepts; a report that does not verify is skipped with one line.

Streams: a worker writes into its node's stream (``contract.REPORT_STREAM``,
its agent's node id), which only that node's agent reads: no agent reads
every rank's reports, so a failure's report traffic grows with the job's
size, not with its square. What the job as a whole needs from other nodes
comes from the agents' own records (``launcher.decide``: inventories, shard
maps, the round's marks). The job stream (name ``JOB``) carries the agents'
messages to each other (a suspected hang).

Protocol, per stream: a writer takes a sequence number with ``add(n, 1)`` and
then sets slot ``<seq>`` to a sealed JSON object. The reader remembers how far it has
read and polls ``add(n, 0)``; a slot whose value is not set yet is retried on
the next poll (the writer is between its two calls) and skipped after
``SLOT_GRACE_S`` (the writer died between them: a report is lost, not the
reports of every other rank behind it).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from . import auth

if TYPE_CHECKING:
    from .config import WorkerConfig

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


JOB = ""  # the job-wide stream


class Stream:
    """The store keys of one report stream: its counter and its slots."""

    def __init__(self, a: auth.Auth, name: str = JOB) -> None:
        if "/" in name or len(name) > 200:
            raise ValueError(f"report stream name {name!r}: at most 200 characters, no '/'")
        self.name = name
        self._a = a
        self.counter = a.key("n") if name == JOB else a.key("n", name)

    def parts(self, seq: int) -> tuple:
        return ("r", seq) if self.name == JOB else ("s", self.name, seq)

    def slot(self, seq: int) -> str:
        return self._a.key(*self.parts(seq))


class Reporter:
    """Worker side. Thread-safe enough: TCPStore client calls are serialized by
    the store client itself; we only ever add() then set()."""

    def __init__(self, store, token: str, rank: int | None, stream: str = JOB) -> None:
        self._store = store
        self._auth = auth.of(token)
        self._rank = rank
        self._stream = Stream(self._auth, stream)

    def send(self, event: str, **fields: Any) -> None:
        msg = {"event": event, "t": time.time(), "rank": self._rank, **fields}
        seq = self._store.add(self._stream.counter, 1)
        self._auth.put(self._store, msg, *self._stream.parts(seq))


def for_worker(cfg: WorkerConfig, store=None) -> Reporter:
    """A worker's reporter into its node's stream (``cfg``: its ``config.WorkerConfig``;
    ``store``: a client of the workers' store, else a new connection)."""
    return Reporter(connect(*cfg.store_addr) if store is None else store, cfg.token, cfg.rank, cfg.report_stream)


SLOT_GRACE_S = 2.0
BATCH = 256  # report slots read in one multi_get
WAKE = "_wake"  # a launcher-internal record (see jitrun.wakeup); readers skip it


class ReportReader:
    """Launcher side: the reports of ``streams`` (this node's and the job's)."""

    def __init__(self, store, token: str, from_now: bool = False, streams: tuple[str, ...] = (JOB,)) -> None:
        self._store = store
        self._auth = auth.of(token)
        # an agent that joins a running job (a replacement) skips the reports
        # of rounds it was not part of
        self._cursors = [_Cursor(self._store, self._auth, Stream(self._auth, s), from_now) for s in streams]

    def poll(self, drain: bool = False) -> list[dict]:
        """The reports written since the last poll. ``drain``: the writers
        are all gone (the job ended), so a slot still empty is skipped at once
        instead of after SLOT_GRACE_S."""
        out: list[dict] = []
        for c in self._cursors:
            c.poll(drain, out)
        return out

    @property
    def store(self):
        return self._store


class _Cursor:
    """How far one stream has been read."""

    def __init__(self, store, a: auth.Auth, stream: Stream, from_now: bool) -> None:
        self._store = store
        self._auth = a
        self._stream = stream
        self._next = self._count() + 1 if from_now else 1
        self._waiting_since: float | None = None

    def _count(self) -> int:
        try:
            return int(self._store.add(self._stream.counter, 0))
        except (RuntimeError, ValueError):  # torch's DistStoreError is a RuntimeError
            raise StoreTampered("jitrun: the workers' report counter in the job's store is not a number: "
                                "something outside the job wrote it (see the README's threat model); "
                                "stopping") from None

    def poll(self, drain: bool, out: list[dict]) -> None:
        last = self._count()
        batch = True  # until a batch finds an empty slot: then one by one, as before batching
        while self._next <= last:
            if batch and (batch := self._batch(last, out)):
                continue
            key = self._stream.slot(self._next)
            if not self._store.check([key]):
                now = time.monotonic()
                if self._waiting_since is None:
                    self._waiting_since = now
                if now - self._waiting_since < SLOT_GRACE_S and not drain:
                    break
                self._fill(key)
            else:
                self._take(self._next, key, self._store.get(key), out)
            self._waiting_since = None
            self._next += 1

    def _batch(self, last: int, out: list[dict]) -> bool:
        """Read the slots from the next one up to ``last`` (at most BATCH) in two round
        trips when all are set (a burst of reports: a failure's, a round's start).
        False (nothing read) when a slot is still empty: the caller takes them one by one."""
        seqs = list(range(self._next, min(last, self._next + BATCH - 1) + 1))
        if len(seqs) < 2:
            return False
        keys = [self._stream.slot(s) for s in seqs]
        if not self._store.check(keys):
            return False
        for s, key, raw in zip(seqs, keys, self._store.multi_get(keys), strict=True):
            self._take(s, key, raw, out)
        self._waiting_since = None
        self._next = seqs[-1] + 1
        return True

    def _fill(self, key: str) -> None:
        """A slot whose writer died between its two calls, skipped: a wake record there
        moves on whoever blocks in a store wait for it (the agent's waiter, jitrun.wakeup),
        never over a real report (compare_set on an absent key only)."""
        try:
            self._store.compare_set(key, "", self._auth.seal(key, {"event": WAKE, "t": 0.0, "rank": None}))
        except (RuntimeError, ValueError):
            pass  # the store is going away with the job

    def _take(self, seq: int, key: str, raw: bytes, out: list[dict]) -> None:
        msg = self._auth.open(key, raw, f"report {self._stream.name or 'job'}/{seq}", REPORT)
        if msg is not None and msg["event"] != WAKE:
            out.append(msg)


def process_start_time() -> float | None:
    """When this process was created (unix seconds, 10 ms resolution): for a
    forked warm worker the fork, for a fresh one the exec, before Python's own
    start-up."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        # /proc/stat's btime has 1 s resolution; the boot clock does not
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError):
        return None
