"""Evidence that another node's agent is gone, in about a second.

torch's rendezvous declares a node dead when its keep-alive has not been
written for ``keep_alive_interval x keep_alive_max_attempt`` (15 s by
default), and the job-wide decision waited a fixed grace for every node's
inventory. When a node vanishes, its peers' collectives with it fail at once;
what is missing is proof that its agent is not merely slow. Every agent
therefore bumps a counter in the job's coordination store every ``PULSE_S``
(``Pulse``); a reader that sees a counter stand still for ``QUIET_S``
(``Silence``) holds that evidence. It is used only after a failure: the
decision stops waiting for a silent node's inventory, and a silent node is
dropped from the rendezvous at once (``rdzv.drop_silent``).

The counter's key is derived under the job token (a stranger cannot find it);
its value is a bare count: a forged bump can only make a dead agent look
alive, which costs the keep-alive expiry of before, never a live node.
A counter that never moved (0: an agent of an older jitrun, or one whose
store connection failed) is no evidence either way.

Threads: ``Pulse`` owns the ``jitrun-pulse`` thread and its own store
connection; ``Silence`` belongs to the agent's main thread (the rendezvous's
waits run there too). No locks.
"""

from __future__ import annotations

import threading
import time

from jitckpt.wire import auth

PULSE_S = 0.2
QUIET_S = 1.0  # five beats missed


def _key(token: str, node_id: str) -> str:
    return auth.of(token).key("alive", node_id)


def _name_key(rdzv_node: str) -> tuple[str, ...]:
    return ("rdzv-node", rdzv_node)


class Pulse:
    """This agent's beat under ``node_id``; ``rdzv_node`` (its name in torch's
    rendezvous state) is mapped to it by a sealed record, once."""

    def __init__(self, store, token: str, node_id: str, rdzv_node: str | None) -> None:
        from ..peers.transfer import own_connection

        self._store = own_connection(store, 10.0)
        self._key = _key(token, node_id)
        if rdzv_node is not None:
            auth.of(token).put(self._store, node_id, *_name_key(rdzv_node))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jitrun-pulse", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
            except Exception:
                return  # the store is gone (the job ended, or node 0 with it): nothing to tell
            self._stop.wait(PULSE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2 * PULSE_S + 1.0)


class Silence:
    """Which of some agents stopped beating, as seen by this reader."""

    def __init__(self, store, token: str, quiet_s: float = QUIET_S) -> None:
        self._store = store
        self._token = token
        self._quiet_s = quiet_s
        self._seen: dict[str, tuple[int, float]] = {}  # node id -> (count, when it last moved)
        self._names: dict[str, str] = {}

    def silent(self, node_ids: list[str]) -> set[str]:
        now = time.monotonic()
        out = set()
        for n in node_ids:
            try:
                count = int(self._store.add(_key(self._token, n), 0))
            except Exception:
                continue
            if count == 0:
                continue
            last = self._seen.get(n)
            if last is None or last[0] != count:
                self._seen[n] = (count, now)
            elif now - last[1] >= self._quiet_s:
                out.add(n)
        return out

    def node_of(self, rdzv_node: str) -> str | None:
        """The node id an agent sealed for its rendezvous name (None: not one of ours)."""
        if rdzv_node not in self._names:
            got = auth.of(self._token).get(self._store, f"rendezvous name {rdzv_node}", *_name_key(rdzv_node))
            if not isinstance(got, str):
                return None  # not yet written, or not an agent of this job: asked again next time
            self._names[rdzv_node] = got
        return self._names[rdzv_node]
