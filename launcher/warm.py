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

A restart's workers also start with what the script imported: once the first attempt's
local rank 0 recorded its packages (jitckpt/import_record.py), the agent starts a second
server that preloads them too (``prepare_next``, while the first attempt trains), and forks
the next attempt's workers from it if it finished those imports without starting a thread
(``use_next``), else from the first.

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

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time
from pathlib import Path

from jitckpt.wire import contract

# _server_bind first: the server dies with the agent from then on (jitckpt/parent_death.py)
PRELOAD = ["jitckpt._server_bind", "torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "jitckpt._bootstrap", "jitckpt.api", "jitckpt.hooks", "jitckpt.runtime", "jitckpt.wire.layout",
           "jitckpt.wire.report", "jitckpt.verify.consistency"]


_server_env: dict[str, str] | None = None


def start_server(env: dict[str, str] | None = None) -> None:
    """Start the forkserver now (once) so its imports overlap the agent's own start
    and the rendezvous. ``env``: variables the server starts with that jitrun's
    own environment gets only later (set for the server's start only)."""
    global _server_env
    if _server_env is not None:
        return
    with _server_start(env):
        _server_env = dict(os.environ)
        multiprocessing.set_forkserver_preload(PRELOAD)
        multiprocessing.forkserver.ensure_running()


@contextlib.contextmanager
def _server_start(env: dict[str, str] | None):
    """``env`` set, SIGTERM and SIGINT ignored and blocked while a server is spawned."""
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
        yield
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Next:
    """A second server, started while the first attempt trains, that also imports what the
    job's workers imported (jitckpt/import_record.py): the next attempt forks from it once it
    reported its imports done and thread-free. Main thread only (the agent's)."""

    def __init__(self, modules: list[str], status: Path) -> None:
        self.modules, self.status = modules, status
        self.server = multiprocessing.forkserver.ForkServer()
        status.unlink(missing_ok=True)
        # jitrun's environment now: the first server's plus what jitrun set since, which
        # workers are handed anyway (changed_env)
        with _server_start({contract.WARM_IMPORTS.name: ",".join(modules), contract.WARM_STATUS.name: str(status)}):
            self.server.set_forkserver_preload([*PRELOAD, "jitckpt._warm_imports"])
            self.server.ensure_running()

    def status_now(self) -> dict | None:
        """The server's report once its imports are done (None before)."""
        try:
            st = json.loads(self.status.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return st if isinstance(st, dict) else None


_next: _Next | None = None
_using_next = False
_record_seen: int | None = None  # the record's mtime when last read


def prepare_next(root: Path) -> list[str] | None:
    """Once the job's record exists, start the server that preloads it (once per jitrun);
    the names it will import, or None (no warm start, no record yet, or already started)."""
    global _next, _record_seen
    if _server_env is None or _next is not None or contract.NO_WARM_IMPORTS.get():
        return None
    from jitckpt import import_record

    try:
        seen = os.stat(Path(root) / import_record.FILE).st_mtime_ns
    except OSError:
        return None
    if seen == _record_seen:  # read already (every tick asks)
        return None
    _record_seen = seen
    modules = import_record.load(root)
    if not modules:  # the script imported nothing the first server lacks
        return None
    _next = _Next(modules, Path(root) / import_record.STATUS_FILE)
    return modules


NEXT_WAIT_S = 30.0


def use_next(wait_s: float = NEXT_WAIT_S) -> dict | None:
    """Before a restart's workers start: fork them from the preloading server once it said
    its imports are done, waiting for that up to ``wait_s``: it started importing before the
    failure, so it is done sooner than a fresh worker importing the same (measured: a restart
    that forked from the first server while the second was still importing was slower than
    one without it, both competing for the CPU). Stays on the first server if the second
    started a thread, or never answered. Its status when it switched, else None."""
    global _using_next
    if _next is None or _using_next:
        return None
    deadline = time.monotonic() + wait_s
    while (st := _next.status_now()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if st is None or st.get("ok") is not True:
        return None
    fs = multiprocessing.forkserver
    fs.ensure_running = _next.server.ensure_running
    fs.connect_to_new_process = _next.server.connect_to_new_process
    fs.get_inherited_fds = _next.server.get_inherited_fds
    fs.set_forkserver_preload = _next.server.set_forkserver_preload
    _using_next = True
    return st


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
    from jitckpt import import_record, parent_death

    import_record.note_inherited()  # what the server had loaded: never worth recording

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
