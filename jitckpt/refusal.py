"""A worker that refuses to train: what the script asked of jitckpt cannot be made exact.

Under jitrun the worker prints one line and exits ``EXIT_REFUSED``, which jitrun never
restarts: the same script would refuse again on every attempt, and a restart would only spend
``--max-restarts`` in a crash loop. Outside jitrun nothing restarts, so it is an exception.
Main thread only (it ends the process)."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from . import api
from .wire.config import EXIT_REFUSED


def refuse(why: str) -> NoReturn:
    rt = api._get_runtime()
    if not rt.cfg.managed:
        raise RuntimeError(why)
    rt.report("refused", error=why)
    print(f"[jitckpt] rank {rt.cfg.rank}: REFUSED: {why}", file=sys.stderr, flush=True)
    os._exit(EXIT_REFUSED)
