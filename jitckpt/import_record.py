"""The third-party packages a worker had imported once training started, recorded per job so
that jitrun's warm-start server imports them before it forks the next attempt's workers.

A restart of a transformers job otherwise spends most of its time importing transformers in
every new worker (seconds) although the previous attempt had it loaded; the fork server only
preloads torch (launcher/warm.py). Written by local rank 0 at the first minibatch (the script
has imported what it trains with by then), read by its agent; also by the fork server
(``jitckpt._warm_imports``), which imports the names it is handed.

Only modules of packages installed in this interpreter's site-packages are recorded (each
package's submodules too, in load order): never a module of the script's own directory or
of the working directory (importing those in the server would run the user's code before
its time, and a same-named file could shadow them), nor a private top-level name. The file
is data: names are validated when read; 0600, written atomically.
"""

from __future__ import annotations

import functools
import json
import os
import re
import site
import sys
import sysconfig
from pathlib import Path

from .wire import contract

FILE = "warm-imports.json"
STATUS_FILE = "warm-imports.status.json"
MAX_NAMES = 5000
# a top-level name not private; its submodules' names may be
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,99}(\.[A-Za-z_][A-Za-z0-9_]{0,99}){0,15}")
# preloaded by the server already, or jitckpt's own (setproctitle: the worker's title, _bootstrap.py)
_SKIP = frozenset({"torch", "jitckpt", "launcher", "jitrun", "setproctitle"})


def site_dirs() -> list[str]:
    """Where installed packages live for this interpreter."""
    paths = sysconfig.get_paths()
    dirs = {paths.get("purelib", ""), paths.get("platlib", "")}
    try:
        dirs.add(site.getusersitepackages())
    except (AttributeError, OSError):
        pass
    return sorted(os.path.realpath(d) + os.sep for d in dirs if d)


@functools.lru_cache(maxsize=4096)
def _real_dir(d: str) -> str:
    # one realpath per directory, not per module: the scan runs at a minibatch start
    return os.path.realpath(d) + os.sep


def installed(origin: str | None, dirs: list[str]) -> bool:
    return bool(origin) and _real_dir(os.path.dirname(origin)).startswith(tuple(dirs))


_inherited: frozenset[str] = frozenset()


def note_inherited() -> None:
    """In a worker forked from the warm-start server, before the script runs: the modules it
    came with, left out of the record (the next server has them too)."""
    global _inherited
    _inherited = frozenset(sys.modules)


def third_party(modules: dict | None = None) -> list[str]:
    """The installed packages' modules loaded in this process, in the order they were first
    loaded. Submodules too: a package that loads lazily (transformers) imports almost nothing
    at its top level, the model and Trainer modules are what costs."""
    mods = sys.modules if modules is None else modules
    dirs = site_dirs()
    tops: dict[str, bool] = {}
    out = []
    for name, mod in list(mods.items()):
        top = name.partition(".")[0]
        if top in _SKIP or mod is None or name in _inherited or not _NAME.fullmatch(name):
            continue
        if top not in tops:
            tops[top] = installed(getattr(mods.get(top), "__file__", None), dirs)
        if tops[top] and installed(getattr(mod, "__file__", None), dirs):
            out.append(name)
    return out[:MAX_NAMES]


def record(root: Path, names: list[str] | None = None) -> None:
    """Write this job's record (atomically, 0600); the agent reads it."""
    names = third_party() if names is None else names
    path = Path(root) / FILE
    tmp = path.with_name(f".{FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"modules": names, "python": sys.version}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(root: Path) -> list[str]:
    """The recorded names that pass validation (none if absent, unreadable, or recorded by
    another Python: its packages may differ)."""
    try:
        data = json.loads((Path(root) / FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("python") != sys.version or not isinstance(data.get("modules"), list):
        return []
    return [n for n in data["modules"][:MAX_NAMES] if isinstance(n, str) and _NAME.fullmatch(n) and n not in _SKIP]


def at_training_start(root: Path | None) -> None:
    """Local rank 0's record, at each attempt's first minibatch; a failure to write it costs
    only the next restart's warm-up, never the job."""
    if root is None or os.environ.get("LOCAL_RANK", "0") != "0" or contract.NO_WARM_IMPORTS.get():
        return
    try:
        names = third_party()
        old = load(root)
        have = set(old)
        new = [n for n in names if n not in have]
        # merged, not replaced: a worker forked from the preloading server has the recorded
        # modules already, and the record is also for the job's next jitrun
        if new:
            record(root, (old + new)[:MAX_NAMES])
    except OSError as e:
        print(f"[jitckpt] warm-start imports not recorded ({e}); a restart imports them in each worker",
              file=sys.stderr, flush=True)
