"""Warm worker start: fork workers from a server that has torch imported.

A restart spends most of its time starting Python and importing torch (and
torch._dynamo, which DDP pulls in): seconds, against milliseconds for the JIT
save. jitrun therefore starts multiprocessing's forkserver once per job, with
those modules preloaded, before it imports torch itself (the two imports
overlap, and the server's also overlaps the first rendezvous); every worker of
every attempt is then a fork of that server, and torchrun's agent starts it
through its function-entrypoint path (MultiprocessContext, start method
``forkserver``).

Each forked worker gets the environment torchrun computes for it (RANK,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...) plus jitrun's, applied before
``worker_main`` runs; everything else is the server's environment, captured
when the job started.

The default (``--jit-warm-start off`` gives fresh ``python -u`` processes).
The server is a fresh interpreter started by multiprocessing before any
worker exists: it imports modules, never starts a thread of its own (tested)
and never holds a process group, so a fork inherits no lock held by a thread
that does not exist in the child. A forked worker ends in
``jitckpt._bootstrap._exit`` (os._exit after flushing, no process-group
destructor: see there for the deadlock that avoids), which the agent's
``workers.forked_progress`` takes as done without a value on the return queue.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys

# _server_bind first: the server dies with the agent from then on (jitckpt/parent_death.py)
PRELOAD = ["jitckpt._server_bind", "torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "jitckpt._bootstrap", "jitckpt.api", "jitckpt.hooks", "jitckpt.runtime", "jitckpt.layout", "jitckpt.report",
           "jitckpt.verify.consistency"]


_server_env: dict[str, str] | None = None


def start_server(env: dict[str, str] | None = None) -> None:
    """Start the forkserver now (once) so its imports overlap the agent's own start
    and the rendezvous. ``env``: variables the server starts with that jitrun's
    own environment gets only later (set for the server's start only)."""
    global _server_env
    if _server_env is not None:
        return
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    # The server ignores SIGTERM and SIGINT (inherited over its exec: a blocked mask is not,
    # the spawn resets it): a scheduler's preemption signals every process of the job, and a
    # server killed by it takes the workers down with it (torch sets their parent-death
    # signal to SIGINT) in the middle of their JIT save. It still ends when jitrun does (its
    # alive pipe closes). Its forks inherit SIG_IGN until the worker's runtime puts its own
    # handlers in (jitckpt/_bootstrap.py). Blocked meanwhile here: a signal for jitrun in
    # that window stays pending (Linux never drops a blocked one) and reaches its handler.
    stop = {signal.SIGTERM, signal.SIGINT}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stop}
    try:
        _server_env = dict(os.environ)
        multiprocessing.set_forkserver_preload(PRELOAD)
        multiprocessing.forkserver.ensure_running()
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def changed_env() -> dict[str, str]:
    """What jitrun set in its environment after the server started (the job
    token shared through the rendezvous, a scheduler placement, ...): a forked
    worker would otherwise see the server's values. Empty without a server."""
    if _server_env is None:
        return {}
    return {k: v for k, v in os.environ.items() if _server_env.get(k) != v}


def worker_main(*argv: str) -> None:
    """Entry point of a forked worker: ``argv`` is what would follow
    ``python -u`` (a script and its args, or ``-m module ...``)."""
    from jitckpt import parent_death

    # a fork of the server follows it (and so the agent); under --run-path's spawn the parent is the agent
    server = sys.modules.get("jitckpt._server_bind")
    parent_death.bind_worker(getattr(server, "SERVER_PID", None))
    # `python -u` would have made these unbuffered; the fork inherited buffered ones
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    # A forkserver child inherits "forkserver" as its default start method;
    # a fresh `python` has the platform's. Under the inherited one, the
    # script's own processes (DataLoader workers) would be children of a
    # fork server the rank starts, which outlives a killed rank, so they
    # would never see their parent die and never exit.
    multiprocessing.set_start_method(None, force=True)
    # torchrun's agent has its own SIGINT handler when it starts a worker, so
    # a fresh worker gets Python's default (KeyboardInterrupt) after exec; the
    # fork server kept whatever jitrun inherited (ignored, under `nohup ... &`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from jitckpt import _bootstrap

    sys.argv = ["jitckpt._bootstrap", *argv]
    _bootstrap.main()
