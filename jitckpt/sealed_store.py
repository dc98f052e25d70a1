"""Sealed records in the job's coordination store: writing, reading and waiting
for them, and the numbered request loop of a node's servers, in one place.

torch's TCPStore has no authentication (:mod:`jitckpt.wire.auth`): a record read there
counts only when it verifies under the job token. The helpers here never hand a
caller a value that did not verify, so no caller reads raw bytes of a record:

* :class:`Space`: the records under one label prefix (``"mig"``: the agents' side of
  ``jitrun migrate``, ``"xfer"``: replica transfers, ``"migrate"``: the job-wide
  migration protocol). The record labelled ``(prefix..., parts...)`` lives at
  ``Auth.key(prefix..., parts...)`` sealed under that key name, which is what
  ``Auth.put`` / ``Auth.get`` write and read: agents of one job understand each
  other whichever of the two they use.
* :class:`Requests`: numbered requests to one server (a node's migration target, its
  replica server). The sender takes a number from the counter ``<parts>/n`` with
  ``add`` and sets request k at ``<parts>/k``; the server waits for each k in turn.
  A forged bump of the counter only makes a number whose record never verifies.
  The answer goes to a key the request names (its id), read with :meth:`Space.wait`.
* :class:`StoreRecordError`: a record that did not come in time, or did not verify.

Threads: a TCPStore client runs one call at a time, and a blocking ``wait`` on a
client that another thread shares stalls that thread (torch's rendezvous heartbeats:
see ``jitrun.peers.transfer.own_connection``). Every helper here uses only the client
it is given, on the calling thread, and keeps nothing between calls (a
:class:`Requests` loop keeps its next number in a local), so a client object is used
by one thread at a time exactly as its caller arranges; nothing here locks. Each
helper's docstring says which store calls it makes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .wire import auth

STOP = {"stop": True}  # the request that ends a server's loop (sealed like any other)

_WAIT_FIX = ("the agent or worker of this job that writes it is gone or stalled: see the job's "
             "events.jsonl on its node")
_REJECT_FIX = ("something outside the job wrote it, or an agent started with another JITCKPT_TOKEN: every "
               "node of a job needs the same token (see the README's threat model)")


class StoreRecordError(RuntimeError):
    """A sealed record that could not be had: ``kind`` is :attr:`TIMEOUT` (none came
    in time, or the store went away meanwhile) or :attr:`REJECTED` (it does not verify
    under the job token, or does not fit its schema). ``what`` names the record,
    ``where`` its label in the job's store (not the key name: that is a MAC), ``why``
    what was wrong and ``fix`` what to do about it; the message says all four."""

    TIMEOUT = "timeout"
    REJECTED = "rejected"

    def __init__(self, kind: str, what: str, where: str, why: str, fix: str) -> None:
        super().__init__(f"{what} (record {where} in the job's store): {why}; {fix}")
        self.kind = kind
        self.what = what
        self.where = where
        self.why = why
        self.fix = fix


class Space:
    """The sealed records of one job (``token``) under the label prefix ``prefix``."""

    def __init__(self, token: str, *prefix: object) -> None:
        self.auth = auth.of(token)
        self.prefix = prefix

    def key(self, *parts: object) -> str:
        """The store key of the record labelled ``parts`` (no store call)."""
        return self.auth.key(*self.prefix, *parts)

    def label(self, *parts: object) -> str:
        """The readable label of ``parts`` (for messages; no store call)."""
        return "/".join(map(str, (*self.prefix, *parts)))

    def put(self, store: Any, value: object, *parts: object) -> str:
        """Seal ``value`` at ``parts`` (one ``set``); returns the key."""
        return self.auth.put(store, value, *self.prefix, *parts)

    def get(self, store: Any, what: str, *parts: object, schema: auth.Schema | None = None) -> Any:
        """The verified record at ``parts``: None when absent (one ``check``) or when it
        does not verify (``check`` and ``get``; one reject line names ``what``)."""
        return self.auth.get(store, what, *self.prefix, *parts, schema=schema)

    def open(self, key: str, raw: object, what: str, schema: auth.Schema | None = None) -> Any:
        """The verified value of ``raw`` read at ``key``, or None after one reject line
        (no store call: for values read with ``multi_get``, ``compare_set``...)."""
        return self.auth.open(key, raw, what, schema)

    def count(self, store: Any, by: int, *parts: object) -> int:
        """Add ``by`` to the (unsealed) counter at ``parts``; its new value (one ``add``)."""
        return int(store.add(self.key(*parts), by))

    def claim(self, store: Any, what: str, value: object, *parts: object) -> Any:
        """First writer wins: seal ``value`` at ``parts`` unless a record is there (one
        ``compare_set``); the verified record in force, or None when it does not verify."""
        key = self.key(*parts)
        return self.auth.open(key, store.compare_set(key, "", self.auth.seal(key, value)), what)

    def wait(self, store: Any, what: str, *parts: object, timeout_s: float, schema: auth.Schema | None = None,
             fix: str | None = None) -> Any:
        """Block (one ``wait``, at most ``timeout_s``) until the record at ``parts`` is set,
        then read it (one ``get``): its verified value. StoreRecordError TIMEOUT when none
        came in time (or the ``wait`` failed: the store went away), REJECTED when it does
        not verify or fit ``schema`` (after one reject line); ``fix`` replaces the advice
        for a timeout. A failing ``get`` raises the store's own error."""
        key = self.key(*parts)
        try:
            store.wait([key], timedelta(seconds=timeout_s))
        except Exception as e:  # torch's DistStoreError on timeout; another error when the store went away
            raise StoreRecordError(StoreRecordError.TIMEOUT, what, self.label(*parts),
                                   f"none came within {timeout_s:g}s ({type(e).__name__})",
                                   fix or _WAIT_FIX) from None
        value, why = self.auth.checked(key, store.get(key), what, schema)
        if why is not None:
            raise StoreRecordError(StoreRecordError.REJECTED, what, self.label(*parts), why, _REJECT_FIX)
        return value


@functools.lru_cache(maxsize=64)
def space(token: str, *prefix: object) -> Space:
    """The :class:`Space` of ``token`` under ``prefix`` (one object per pair: callers ask
    for it at every call rather than keep it)."""
    return Space(token, *prefix)


class Requests:
    """Numbered requests to one server, in ``space`` under ``parts`` (e.g. ``"to", node``)."""

    def __init__(self, space: Space, *parts: object) -> None:
        self.space = space
        self.parts = parts

    def send(self, store: Any, body: object) -> int:
        """Queue ``body`` (sealed) for the server: one ``add`` on the counter, one ``set``
        of the request. Returns its number."""
        seq = self.space.count(store, 1, *self.parts, "n")
        self.space.put(store, body, *self.parts, seq)
        return seq

    def stop(self, store: Any) -> None:
        """End the server's loop after the requests queued before this one (an ``add``
        and a ``set``, like :meth:`send`). Store errors propagate."""
        self.send(store, STOP)

    def serve(self, store: Any, name: str, *, problem: Callable[[Any], str | None],
              handle: Callable[[dict], bool | None], stopping: Callable[[], bool],
              on_store_error: Callable[[], bool], wait_s: float = 3600.0) -> None:
        """The server's loop, on its own thread and its own ``store`` client: wait (one
        ``wait`` of up to ``wait_s``, then a ``get``) for request 1, 2, ... in turn and
        give each one that verifies and has no ``problem`` (after one reject line naming
        ``name`` otherwise) to ``handle``. Returns at :data:`STOP`, when ``stopping()``
        says so before a wait, when ``handle`` returns False, or when a failed wait (a
        timeout, the store gone) makes ``on_store_error()`` return False. ``handle``
        answers each request itself, failures included: a sender is never left waiting
        on an exception that only this loop saw."""
        seq = 1
        while not stopping():
            key = self.space.key(*self.parts, seq)
            try:
                store.wait([key], timedelta(seconds=wait_s))
                raw = store.get(key)
            except Exception:  # a long wait that timed out, or the store went away with the job
                if not on_store_error():
                    return
                continue
            seq += 1
            req = self.space.open(key, raw, f"{name} {seq - 1} to this node")
            if req == STOP:
                return
            if req is None or auth.reject_if(name, problem(req)):
                continue
            if handle(req) is False:
                return

