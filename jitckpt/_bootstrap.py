"""``python -m jitckpt._bootstrap (SCRIPT | -m MODULE) [ARGS...]``.

jitrun starts every worker through this module so detection and the phase
hooks are in place before the user's code runs, with no change to that code.

How a worker ends
-----------------
Every worker managed by jitrun ends in ``_exit``: it reports, runs the atexit
handlers, flushes the files the script opened (open/io.open) and
stdout/stderr, and leaves with ``os._exit``, so no process-group destructor
ever runs. Destroying a ProcessGroupGloo joins its
run-loop threads while holding the GIL; a run-loop thread that is releasing a
finished work item whose thread-local state holds a Python object (a
``SafePyObject``) needs the GIL for that, and the two wait for each other
forever. It happens when the last reference to a group goes away, most often
when the user's ``main()`` returns after ``destroy_process_group()`` and
drops its DDP model (the reducer held the group). It was seen in about one
forked (warm-start) worker in ten; fresh processes have the same race. So
groups that the script destroys are kept referenced (``_keep_groups``) until
the process ends.
"""

from __future__ import annotations

import atexit
import io
import os
import runpy
import signal
import sys
import traceback
import weakref
from typing import NoReturn

_kept: list[object] = []  # destroyed process groups, referenced until os._exit


def _keep_groups() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from .torch_compat import patch
    from .torch_compat.worker import process_groups

    def make(orig):
        def destroy_process_group(group=None):
            _kept.extend(process_groups() if group is None else [group])
            return orig(group)

        # the list itself, for migrate_worker.teardown: this module usually runs as __main__
        # (python -m jitckpt._bootstrap), so "jitckpt._bootstrap._kept" would be another copy
        destroy_process_group.__jitckpt_kept__ = _kept
        destroy_process_group.__doc__ = orig.__doc__
        return destroy_process_group

    patch(c10d, "destroy_process_group", make, dist)


_opened: weakref.WeakSet = weakref.WeakSet()  # files the script opened for writing


def _track_open() -> None:
    """Remember every file the script opens through open()/io.open()
    (Path.open and os.fdopen go through io.open), so the end of the process
    flushes them in microseconds. A scan of every object for files (~300k
    objects with torch imported) took 0.1-0.3 s here, and a failing rank's
    death, which its peers detect, would wait for it."""
    import builtins

    orig = io.open
    if getattr(orig, "__jitckpt_wrapped__", None):
        return

    def open(*args, **kwargs):  # noqa: A001 - the builtin's name, on purpose
        f = orig(*args, **kwargs)
        try:
            if f.writable():
                _opened.add(f)
        except (ValueError, TypeError):  # closed already, or not weak-referenceable
            pass
        return f

    open.__jitckpt_wrapped__ = orig
    open.__doc__ = orig.__doc__
    builtins.open = io.open = open


def _flush_files() -> None:
    """What interpreter finalization would have flushed: the files the script
    left open, then stdout/stderr."""
    for f in [*list(_opened), sys.stdout, sys.stderr]:
        try:
            if not f.closed:
                f.flush()
        except Exception:  # a broken pipe or a file the script left unusable
            pass


def _exit(code: int) -> NoReturn:
    try:
        atexit._run_exitfuncs()
    finally:
        _flush_files()
        os._exit(code)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # as the interpreter does for sys.exit("message")
    return 1


def attach() -> None:
    """The runtime for a Python process started by a ``--no-python`` program
    (jitckpt/_autoload/sitecustomize.py): what ``main`` sets up before the
    script. The end of the process is the interpreter's, and no "finished"
    report is sent: an atexit handler cannot tell a clean end from
    ``sys.exit(1)``; the agent learns it from the exit code instead."""
    from . import api, parent_death

    parent_death.bind_worker()
    api.install()
    _set_title(sys.argv if sys.argv and sys.argv[0] else ["python"])
    _keep_groups()
    _track_open()


def _install():
    from . import api, parent_death

    if not sys.modules.get("jitckpt._server_bind"):  # a fork of the warm server was bound in worker_main
        parent_death.bind_worker()
    rt = api.install()
    # a warm worker inherits SIGTERM ignored from the fork server (launcher/warm.py); under
    # jitrun the runtime's handler replaced it, elsewhere the default action comes back
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return rt


def main() -> NoReturn:
    rt = _install()
    argv = sys.argv[1:]
    if not argv:
        sys.exit("usage: python -m jitckpt._bootstrap (SCRIPT | -m MODULE) [ARGS...]")
    if argv[0] == "-m" and len(argv) < 2:
        sys.exit("jitckpt._bootstrap: -m needs a module name")
    _set_title(argv)
    _keep_groups()
    _track_open()
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        # A framework that caught a collective failure and exits (Hydra, a
        # try/except around main()): the error is this exception's context.
        rt.script_ended(e)
        code = _exit_code(e)
    except KeyboardInterrupt as e:
        # under jitrun SIGINT is a stop signal (a save), not this exception; a script
        # that raised it itself or reset the handler still has a save it asked for
        rt.script_ended(e)
        traceback.print_exc()
        _flush_files()
        # as the interpreter ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    except BaseException as e:
        # A collective failure that escaped the user's code (e.g. from DDP's
        # buffer broadcast in forward) still leads to the JIT save: the
        # excepthook jitckpt installed does it (and then never returns).
        sys.excepthook(type(e), e, e.__traceback__)
        rt.script_ended(e)
        _record_error(e)
        _exit(1)
    else:
        rt.script_ended(None)
    if code == 0:
        # loaded: for a rank restored after the last minibatch, which never
        # reaches the training-start report
        fp = rt.verifier.at_end() if rt.verifier is not None else None
        rt.report("finished", step=rt.steps_done, loaded=rt.loaded, fingerprint=fp)
    try:
        rt.injector.maybe_fire("exit", rt.steps_done)  # tests: a crash as the process ends
    except BaseException as e:
        sys.excepthook(type(e), e, e.__traceback__)
        _exit(1)
    _exit(code)


def _set_title(argv: list[str]) -> None:
    """What ``ps``/``top``/``py-spy`` show for this worker: jitrun, the global
    rank, the world size and the user's program with its arguments. A worker
    forked from the warm-start server would otherwise show the server's
    command line, and nobody could tell which process is rank 3."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None:
        return
    try:
        from setproctitle import setproctitle
    except ImportError:  # an install without it: the title stays the interpreter's
        return
    prog = [os.path.basename(argv[0]), *argv[1:]] if argv[0] != "-m" else argv
    setproctitle(f"jitrun[rank {rank}/{world or '?'}] " + " ".join(prog))


def _record_error(e: BaseException) -> None:
    """The error file torchrun's failure summary reads (what @record writes),
    complete or absent: the agent SIGTERMs a failing worker while it writes it
    when another rank failed first (jitckpt/error_file.py)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        from .error_file import write

        write(path, e)
    except Exception as err:  # the failure itself still ends the process with exit 1
        print(f"[jitckpt] could not write the error file {path}: {type(err).__name__}: {err}", file=sys.stderr)


if __name__ == "__main__":
    main()
