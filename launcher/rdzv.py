"""What jitrun needs from torch's dynamic rendezvous beyond torchrun's use of it.

1. Every round republishes where the workers' store is. torch 2.13 builds the
   workers' bootstrap address (MASTER_ADDR/MASTER_PORT under the round's key
   prefix) only in a node's first round: in a later round the rank-0 agent
   keeps its old answer and never writes the keys for the new round, so a
   replacement node (or a spare) joining round k > 0 waits for
   ``/torch.rendezvous.<id>.<k>/MASTER_ADDR`` until it times out, and plain
   torchrun fails the same way. After each round, rank 0 writes its store's
   address for the round and every other node reads it, so a node whose rank
   changed between rounds also follows the store that rank 0 now hosts.
2. The job-wide attempt number: the rendezvous round, the same on every node
   (a replacement agent's own restart count starts at 0). Workers key their
   per-attempt store space on it.
3. The coordination store: the rendezvous backend's own store (the c10d
   endpoint), which outlives any agent but the one hosting the endpoint, used
   for job-wide decisions (``decide``) and replica transfers (``transfer``).
4. Hot spares: while the job is healthy a node waiting to join is reported
   once and not admitted (torchrun would restart every worker to let it in);
   it joins when a failure makes the job re-rendezvous.
5. A restart's rendezvous costs milliseconds, not most of a second
   (``_speed_up``): torch names each rendezvous event by calling
   ``inspect.stack()`` twice, which reads the source of every frame (0.3-1 s
   per round on one node, measured); a round-0 node sleeps a random 0-0.3 s to
   spread load on the backend, and a node waiting for others polls the
   backend once a second, and its state holder answers from a one-second
   cache. Here the name comes from the frame itself, there is no skew sleep
   (a job has at most a few thousand agents, each making one request per poll
   of one TCPStore), the cache is off while a rendezvous runs (``elastic.rdzv_uncached``)
   and the poll period is ``POLL_S`` for up to ``POLL_NODES`` nodes, longer in
   proportion beyond: every poll reads the whole rendezvous state, which names
   every node, so a fixed period made the endpoint's traffic grow as the
   square of the node count (with the period scaled it grows linearly: at most
   POLL_NODES / POLL_S state reads a second, measured by
   ``scripts/bench_scale.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from jitckpt.torch_compat import elastic, patch, patched

log = logging.getLogger(__name__)


_dynamic = elastic.rdzv_dynamic


def is_static(handler) -> bool:
    """torchrun's default when no rendezvous flag is given, and the classic
    ``--nnodes/--node-rank/--master-addr`` form: one TCPStore hosted by node
    rank 0's agent, no rounds, no membership changes."""
    return handler.get_backend() == "static" and elastic.rdzv_has_store(handler)


def node_name(handler) -> str | None:
    """This agent's name in a dynamic rendezvous's state (None: not dynamic)."""
    return str(elastic.rdzv_node(handler)) if _dynamic(handler) else None


def current_round(handler) -> int | None:
    if not _dynamic(handler):
        return None
    return int(elastic.rdzv_state(handler).round)


def job_attempt(handler, restarts: int) -> int:
    """The job-wide attempt number, the same on every node: the rendezvous
    round under a dynamic backend (a replacement agent's own restart count
    starts at 0), the worker group's restart count under static, where every
    node's group restarts as a whole (a failure on one node is handled by
    every agent through the coordination store) and membership never
    changes."""
    r = current_round(handler)
    return restarts if r is None else r


def coordination_store(handler):
    """The backend store without the per-round prefix, or None. Static:
    node rank 0's TCPStore (every agent of the job reaches it), created here
    if the agent has not rendezvoused yet, as its first rendezvous would."""
    if _dynamic(handler):
        return elastic.rdzv_store(handler)
    if is_static(handler):
        if elastic.rdzv_store(handler) is None:
            handler.next_rendezvous()
        return elastic.rdzv_store(handler)
    return None


def mark_succeeded(handler, token: str) -> None:
    """An agent whose workers finished the job says so before closing the rendezvous."""
    from jitckpt.wire import auth

    store = coordination_store(handler)
    if store is not None:
        try:
            auth.of(token).put(store, True, "job-succeeded")
        except Exception:
            pass  # the endpoint went first: waiting agents then report no success


def job_succeeded(handler, token: str) -> bool:
    """Did an agent of the job (a sealed record, not anyone's key) say it finished?"""
    from jitckpt.wire import auth

    store = coordination_store(handler)
    try:
        return store is not None and auth.of(token).get(store, "job success mark", "job-succeeded") is True
    except Exception:
        return False


def _read_key(token: str) -> str:
    # a count, not a record: a forged bump only lets the host leave early (a spare then says so)
    from jitckpt.wire import auth

    return auth.of(token).key("job-outcome-read")


def waiting_nodes(handler) -> int:
    """Nodes waiting to join (spares, in torch's wait or redundancy list)."""
    if not _dynamic(handler):
        return 0
    try:
        st = elastic.rdzv_state(handler, sync=True)
        return len(st.wait_list) + len(st.redundancy_list)
    except Exception:
        return 0


def outcome_read(handler, token: str) -> None:
    """A waiting node has read the job's outcome (the host may go now)."""
    store = coordination_store(handler)
    try:
        if store is not None:
            store.add(_read_key(token), 1)
    except Exception:
        pass


def wait_outcome_read(handler, token: str, n: int, timeout_s: float = 5.0) -> bool:
    """Keep the store up until ``n`` waiting nodes read the outcome: an agent
    that hosts the rendezvous store takes it along when it exits, and a spare
    that then finds no store cannot tell success from failure."""

    store = coordination_store(handler)
    deadline = time.monotonic() + timeout_s
    while store is not None and time.monotonic() < deadline:
        try:
            if store.add(_read_key(token), 0) >= n:
                return True
        except Exception:
            return False
        time.sleep(POLL_S)
    return False


def join_timeout_s(handler) -> float | None:
    try:
        return handler.settings.timeout.join.total_seconds()
    except AttributeError:
        return None


POLL_S = 0.05
POLL_NODES = 16
_poll_s = POLL_S  # this process's period: set by ``install`` from the job's size


def spare_look_s() -> float:
    """How often a healthy agent reads the rendezvous state for waiting spares."""
    return max(0.5, 10 * _poll_s)


def poll_period(max_nodes: int) -> float:
    """The rendezvous poll period of a job of up to ``max_nodes`` nodes."""
    return POLL_S * max(1.0, max_nodes / POLL_NODES)


# called in every wait of a rendezvous (the agent's main thread); see drop_silent
_while_waiting: Callable[[], None] | None = None


def drop_silent(handler, silence, on_drop: Callable[[list[str]], None]) -> None:
    """While this agent waits in a rendezvous, a participant of the last round
    whose agent stopped beating (``recovery.alive``) is removed from the
    rendezvous state at once, by torch's own sanitizer as if its keep-alive had
    expired, instead of after ``keep_alive_interval x keep_alive_max_attempt``.
    ``silence()`` gives the current ``alive.Silence`` (None: no evidence)."""
    global _while_waiting
    if not elastic.rdzv_can_drop(handler):
        return

    def check() -> None:
        s = silence()
        me = elastic.rdzv_node(handler)
        others = [d for d in elastic.rdzv_state(handler).participants if d != me]
        if s is None or not others:
            return
        ids = {d: s.node_of(str(d)) for d in others}
        gone = s.silent([i for i in ids.values() if i is not None])
        dropped = [d for d, i in ids.items() if i in gone]
        if not dropped:
            return
        elastic.rdzv_drop(handler, dropped)
        on_drop([str(d) for d in dropped])

    _while_waiting = check


def _speed_up() -> None:
    import sys

    def get_method_name(depth: int = 2) -> str:
        # inspect.stack()[depth].function, without reading any source file
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    def delay(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):
            return  # the round-0 skew
        if _while_waiting is not None:
            try:
                _while_waiting()
            except Exception as e:  # evidence is an optimisation: the keep-alive expiry still works
                log.debug("lost-node check failed: %s", e)
        time.sleep(min(seconds, _poll_s))

    elastic.patch_rendezvous_wait(delay, get_method_name)


def install(handler, *, on_spare: Callable[[int], None] | None = None,
            healthy: Callable[[], bool] | None = None) -> None:
    """Patch ``handler`` (a DynamicRendezvousHandler) in place; a no-op for
    other handlers (static, etcd-v1), which have neither problem."""
    if not _dynamic(handler) or patched(handler.next_rendezvous):
        return
    global _poll_s
    try:
        _poll_s = poll_period(int(handler.settings.max_nodes))
    except (AttributeError, TypeError, ValueError):
        _poll_s = POLL_S
    _speed_up()

    def next_rendezvous(orig_next):
        def run():
            info = elastic.rdzv_uncached(handler, orig_next)
            if not handler.use_agent_store or info.bootstrap_store_info is None:
                return info
            return elastic.rdzv_fresh_store_info(handler, info)

        return run

    last_look = [-1e9]

    def num_nodes_waiting(orig_waiting) -> Callable[[], int]:
        return lambda: _waiting(orig_waiting)

    def _waiting(orig_waiting) -> int:
        # torch's agent asks on every monitor tick and each answer reads the whole
        # state (every node's entry); a healthy job only reports spares, so it looks
        # at most once per spare_look_s()
        if healthy is not None and healthy():
            now = time.monotonic()
            if now - last_look[0] < spare_look_s():
                return 0
            last_look[0] = now
        n = orig_waiting()  # torch counts its wait list only: a node that came to a full job is
        spares = n + len(getattr(elastic.rdzv_state(handler), "redundancy_list", ()))  # in the redundancy list
        if spares and healthy is not None and healthy():
            if on_spare is not None:
                on_spare(spares)
            return 0
        return n

    # this handler object's methods, not its class's
    patch(handler, "next_rendezvous", next_rendezvous)
    patch(handler, "num_nodes_waiting", num_nodes_waiting)
