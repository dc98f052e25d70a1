"""Warm worker start: fork workers from a server that has torch imported.

A restart spends most of its time starting Python and importing torch (and
torch._dynamo, which DDP pulls in): seconds, against milliseconds for the JIT
save. jitrun therefore starts multiprocessing's forkserver once per job, with
those modules preloaded, while the first rendezvous runs; every worker of
every attempt is then a fork of that server, and torchrun's agent starts it
through its function-entrypoint path (MultiprocessContext, start method
``forkserver``).

Each forked worker gets the environment torchrun computes for it (RANK,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...) plus jitrun's, applied before
``worker_main`` runs; everything else is the server's environment, captured
when the job started.

Experimental (``--jit-warm-start on``): in about one run in ten a forked
worker deadlocks when its script returns. Dropping the DDP reducer destroys
ProcessGroupGloo while holding the GIL; the destructor joins a gloo run-loop
thread that is releasing a finished work item whose thread-local state holds
a Python object (a torch-function-mode stack entry), which needs the GIL.
Fresh processes have not shown it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import sys

PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "jitckpt.hooks",
           "jitckpt.runtime", "jitckpt.layout", "jitckpt.report"]


def start_server() -> None:
    """Start the forkserver now so its imports overlap the rendezvous."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()


def worker_main(*argv: str) -> None:
    """Entry point of a forked worker: ``argv`` is what would follow
    ``python -u`` (a script and its args, or ``-m module ...``)."""
    # `python -u` would have made these unbuffered; the fork inherited buffered ones
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    from jitckpt import _bootstrap

    sys.argv = ["jitckpt._bootstrap", *argv]
    _bootstrap.main()
