"""torchelastic's internals jitrun's agent reaches (see the package's doc): the
launch API's helpers, the dynamic rendezvous handler's state, the process
contexts' return-value plumbing and the error files' reader.

Checked against torch 2.11.0, 2.13.0 and 2.14.1 (their sources read side by
side; tests/test_torch_compat.py resolves every name on each). The agent's
main thread calls these, except ``patch_rendezvous_wait``'s functions, which
run where torch's rendezvous loop runs (the agent's main thread too).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from . import patch

# -- the launch API -------------------------------------------------------------------------------

def addr_and_port(params: Any) -> tuple[str | None, int | None]:
    """The static rendezvous's master address and port, as torchrun's launch_agent derives them."""
    from torch.distributed.launcher.api import _get_addr_and_port

    return _get_addr_and_port(params)


def entrypoint_name(cmd: Any, args: list) -> str:
    """The name torchrun's failure summary gives the job's entry point."""
    from torch.distributed.launcher.api import _get_entrypoint_name

    return _get_entrypoint_name(cmd, args)


# -- the dynamic rendezvous handler -----------------------------------------------------------------

def rdzv_dynamic(handler: Any) -> bool:
    """A DynamicRendezvousHandler (c10d, etcd-v2): rounds, a shared state, keep-alives."""
    return hasattr(handler, "_state_holder") and hasattr(handler, "_bootstrap_store_info")


def rdzv_has_store(handler: Any) -> bool:
    """A handler that keeps the job's TCPStore itself (static; dynamic ones too)."""
    return hasattr(handler, "_store")


def rdzv_store(handler: Any) -> Any:
    """The handler's own TCPStore, None before its first rendezvous (or none at all)."""
    return getattr(handler, "_store", None)


def rdzv_node(handler: Any) -> Any:
    """This agent's node descriptor in the rendezvous state."""
    return handler._this_node


def rdzv_state(handler: Any, sync: bool = False) -> Any:
    """The rendezvous state as this handler last read it (``sync``: read it again first)."""
    if sync:
        handler._state_holder.sync()
    return handler._state_holder.state


def rdzv_can_drop(handler: Any) -> bool:
    return rdzv_dynamic(handler) and hasattr(handler._state_holder, "_sanitize")


def rdzv_drop(handler: Any, nodes: list[Any]) -> None:
    """Remove ``nodes`` from the state by torch's own sanitizer, as if their keep-alives
    had expired (an emptied round advances as torch would); written by the rendezvous
    loop's next sync (compare-and-set)."""
    holder = handler._state_holder
    expired = datetime(1970, 1, 1, tzinfo=timezone.utc)
    for d in nodes:
        holder.state.last_heartbeats[d] = expired
    holder._sanitize()
    holder.mark_dirty()


def rdzv_uncached(handler: Any, join: Callable[[], Any]) -> Any:
    """``join()`` with the state holder's read cache off (``cache_duration``, 1 s)."""
    holder = handler._state_holder
    cached = getattr(holder, "_cache_duration", None)
    if cached is None:
        return join()
    holder._cache_duration = 0
    try:
        return join()
    finally:
        holder._cache_duration = cached


def rdzv_fresh_store_info(handler: Any, info: Any) -> Any:
    """``info`` (a RendezvousInfo) with bootstrap store info built for this round's
    rank, the handler's own copy replaced too (the agent store's address of rank 0)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    server = handler._shared_tcp_store_server
    addr = handler._this_node.addr
    if info.rank == 0 and server is not None:
        fresh = RendezvousStoreInfo.build(0, info.store, local_addr=addr, server_port=server.port)
    else:
        fresh = RendezvousStoreInfo.build(info.rank, info.store, local_addr=addr)
    handler._bootstrap_store_info = fresh
    return type(info)(info.store, info.rank, info.world_size, fresh)


def patch_rendezvous_wait(delay: Callable[[Any], None], method_name: Callable[[int], str]) -> bool:
    """The dynamic rendezvous's sleep between two looks at the state (``_delay``) and its
    caller-name helper (``get_method_name``, inspect.stack() reads every frame's source)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    done = patch(dr, "_delay", lambda orig: delay)
    patch(dr, "get_method_name", lambda orig: method_name)
    return done


# -- process contexts -------------------------------------------------------------------------------

def processes(pcontext: Any) -> list[Any] | None:
    """A multiprocessing context's worker processes (None: not that kind of context)."""
    pc = getattr(pcontext, "_pc", None)
    return None if pc is None else list(pc.processes)


def forked(pcontext: Any) -> bool:
    """Workers started by torch's multiprocessing (they return values through queues)."""
    return hasattr(pcontext, "_ret_vals")


def collect_returns(pcontext: Any) -> dict[int, Any] | None:
    """Read what each forked worker returned so far; a worker that exited 0 without a value
    (jitckpt's bootstrap ends with os._exit(0)) counts as done. The values by local rank
    once every worker is done (and the context released them), else None."""
    pc = pcontext
    for lr in range(pc.nprocs):
        q = pc._ret_vals[lr]
        if lr not in pc._return_values and not q.empty():
            pc._return_values[lr] = q.get()
        elif lr not in pc._return_values and pc._pc.processes[lr].exitcode == 0:
            pc._return_values[lr] = None
    if not pc._is_done():
        return None
    pc._worker_finished_event.set()
    return dict(pc._return_values)


# -- error files ------------------------------------------------------------------------------------

def set_process_failure_class(cls: type) -> None:
    """The class torchelastic builds a failed worker's record with (it reads the error file)."""
    from torch.distributed.elastic.multiprocessing import api as mp_api

    mp_api.ProcessFailure = cls  # type: ignore[misc]
