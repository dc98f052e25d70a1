"""jitrun puts this directory on PYTHONPATH for ``--no-python`` programs: a
Python process such a program starts (a shell wrapper's ``exec python
train.py``) gets jitckpt's runtime attached before the user's code runs, as
``python -m jitckpt._bootstrap`` does for Python workers. A program that is
not Python never reads it. Only one ``sitecustomize`` is imported per
interpreter, so the next one on sys.path (the distribution's, a user's) is
run after ours."""

import os
import sys


def _attach() -> None:
    if os.environ.get("RANK") is None:
        return
    try:
        from jitckpt import _bootstrap
        from jitckpt.wire import contract
    except ImportError:  # a Python without jitckpt (and torch): nothing to attach
        return
    if contract.DIR.get() is None:
        return
    try:
        _bootstrap.attach()
    except Exception as e:  # the program still runs, as under torchrun, and says why it is unprotected
        print(f"jitckpt: could not attach to this process ({type(e).__name__}: {e}); it runs without JIT "
              "checkpointing", file=sys.stderr, flush=True)


def _chain() -> None:
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", path)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_attach()
_chain()
