"""``python -m jitckpt._bootstrap (SCRIPT | -m MODULE) [ARGS...]``.

jitrun starts every worker through this module so detection and the phase
hooks are in place before the user's code runs, with no change to that code.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    from . import api

    rt = api.install()
    argv = sys.argv[1:]
    if not argv:
        sys.exit("usage: python -m jitckpt._bootstrap (SCRIPT | -m MODULE) [ARGS...]")
    try:
        if argv[0] == "-m":
            if len(argv) < 2:
                sys.exit("jitckpt._bootstrap: -m needs a module name")
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        rt.report("finished", step=rt.steps_done)
    except SystemExit as e:
        if e.code in (None, 0):
            rt.report("finished", step=rt.steps_done)
        raise
    except Exception as e:
        # A collective failure that escaped the user's code (e.g. from DDP's
        # buffer broadcast in forward) still leads to the JIT save. Done here
        # and not only in sys.excepthook: a forked worker's uncaught exception
        # never reaches the hook.
        from .runtime import is_collective_error

        if rt.cfg.managed and is_collective_error(e):
            rt.on_collective_error(e)
        raise


if __name__ == "__main__":
    main()
