"""Run by jitrun's warm-start fork server at its start (a preload module, launcher/warm.py):
import the packages the job's workers had loaded in its previous attempt, so the next
attempt's forked workers start with them.

The names come from ``JITCKPT_WARM_IMPORTS`` (jitckpt/import_record.py's record). Each is
imported only if it resolves to an installed package (never the working directory's file of
that name); any error is swallowed (the worker imports it itself then). The outcome goes to
``JITCKPT_WARM_STATUS``: the agent forks from this server only if it finished and no import
started a thread (a fork would copy a lock held by a thread the child does not have).
"""

from __future__ import annotations


def _threads() -> int:
    import os

    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _unblock_stop_signals() -> None:
    """This server was spawned by the agent while its thread blocked SIGTERM and SIGINT
    (launcher/warm.py's ``_server_start``), and the mask came along over the exec (seen in
    /proc: the first server's is clear, this one's was not); every fork inherits it, and a
    worker with SIGTERM blocked never hears the agent ask it to save. The server still
    ignores both (SIG_IGN, inherited too), so nothing pending is delivered here."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def _run() -> None:
    import importlib
    import importlib.util
    import json
    import os
    import sys
    import time

    from jitckpt import import_record
    from jitckpt.wire import contract

    t0 = time.monotonic()
    dirs = import_record.site_dirs()
    done, failed = [], []
    for name in [n for n in contract.WARM_IMPORTS.get().split(",") if n]:
        try:
            top = name.partition(".")[0]
            spec = sys.modules[top].__spec__ if top in sys.modules else importlib.util.find_spec(top)
            if spec is None or not import_record.installed(spec.origin, dirs):
                failed.append(name)
                continue
            importlib.import_module(name)
            done.append(name)
        except Exception:  # noqa: BLE001 - a package that fails here is imported by the worker instead
            failed.append(name)
    status = {"ok": _threads() == 1, "threads": _threads(), "imported": len(done), "skipped": failed[:20],
              "seconds": round(time.monotonic() - t0, 3), "pid": os.getpid()}
    path = contract.WARM_STATUS.get()
    if path:
        tmp = f"{path}.{os.getpid()}"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
            json.dump(status, f)
        os.replace(tmp, path)


_unblock_stop_signals()
_run()
