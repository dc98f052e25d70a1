"""``python -m jitckpt._bootstrap (SCRIPT | -m MODULE) [ARGS...]``.

jitrun starts every worker through this module so detection and the phase
hooks are in place before the user's code runs, with no change to that code.
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    from . import api

    api.install()
    argv = sys.argv[1:]
    if not argv:
        sys.exit("usage: python -m jitckpt._bootstrap (SCRIPT | -m MODULE) [ARGS...]")
    if argv[0] == "-m":
        if len(argv) < 2:
            sys.exit("jitckpt._bootstrap: -m needs a module name")
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        import os

        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
