"""cffi (ABI mode) binding to the LD_PRELOAD shim ``libjitintercept.so``.

The shim must already be in the process (``LD_PRELOAD``): interposition only
works for a library loaded before the CUDA runtime, so this module never
loads it; it looks the control API up in the global namespace. Without the
shim, ``loaded()`` is False, the read-only helpers return empty values and
``set_hang_handler`` raises RuntimeError. This module must not import torch.

The hang handler runs on the shim's watchdog thread. Before calling it the
watchdog asks threads parked in a blocking CUDA/NCCL call to release the GIL
(signal-based, see libintercept/README.md), so the handler runs even when the
main thread is stuck holding the GIL. While it runs, cudaMemcpy and
cudaMemcpyAsync go to a private stream, so saving device state cannot
deadlock behind the hung collective.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cffi

__all__ = [
    "counters",
    "dump_replay_log",
    "loaded",
    "minibatch_begin",
    "optimizer_marks",
    "replay",
    "set_hang_handler",
    "stat",
    "timeout_s",
]

# The control API's declarations come from the shim's own header: one source
# for C and Python. Read when the shim is found in the process (the header
# sits in the same checkout as the build jitrun preloads).
HEADER = Path(__file__).resolve().parents[1] / "libintercept" / "include" / "jitintercept.h"

_ffi = cffi.FFI()
_lock = threading.Lock()
_lib: Any = None
_probed = False
# The cffi callback object must outlive every call the watchdog may make.
_callback: Any = None


def cdef_from_header(text: str) -> str:
    """The declarations of ``jitintercept.h`` as cffi's ``cdef`` takes them:
    comments, the C++ guard and preprocessor lines dropped."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", " ", text, flags=re.S)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    return "\n".join(ln for ln in lines if ln.strip())


def _declare() -> None:
    try:
        text = HEADER.read_text()
    except OSError as e:
        raise RuntimeError(
            f"libjitintercept.so is preloaded but its header {HEADER} cannot be read ({e.strerror}): "
            "jitckpt must run from the checkout the shim was built in"
        ) from e
    _ffi.cdef(cdef_from_header(text))


def _shim() -> Any:
    global _lib, _probed
    if _probed:  # per-step callers (minibatch_begin) skip the lock
        return _lib
    with _lock:
        if not _probed:
            # Probe by symbol first: without the shim nothing needs declaring.
            if hasattr(ctypes.CDLL(None), "jitintercept_loaded"):
                _declare()
                lib = _ffi.dlopen(None)
                if lib.jitintercept_loaded() == 1:
                    _lib = lib
            _probed = True
        return _lib


def loaded() -> bool:
    """True when libjitintercept.so is loaded in this process."""
    return _shim() is not None


def set_hang_handler(fn: Callable[[dict[str, Any]], None]) -> None:
    """Registers ``fn(event)``, called on a hang or NCCL error.

    ``event`` has at least "event" ("hang" or "error"), "t", "rank",
    "waited_s" and "collective". After ``fn`` returns the shim applies
    JITCKPT_ON_HANG (report / exit / abort); a handler that saves and exits
    should call ``os._exit``.
    """
    global _callback
    lib = _shim()
    if lib is None:
        raise RuntimeError("libjitintercept.so is not preloaded in this process")

    def _on_event(event_json: Any, _user: Any) -> None:
        fn(json.loads(_ffi.string(event_json).decode()))

    def _on_error(exc_type: Any, exc: Any, tb: Any) -> None:
        # Runs on the watchdog thread: nobody else would ever see the error.
        sys.excepthook(exc_type, exc, tb)

    cb = _ffi.callback("jitintercept_handler_fn", _on_event, onerror=_on_error)
    with _lock:
        _callback = cb
    lib.jitintercept_set_handler(cb, _ffi.NULL)


def minibatch_begin() -> None:
    """Clears the replay log at the start of a minibatch (call from the step hook)."""
    lib = _shim()
    if lib is not None:
        lib.jitintercept_minibatch_begin()


def optimizer_marks() -> tuple[Callable[[], None], Callable[[], None]] | None:
    """The shim's optimizer phase marks (begin, end), called by the runtime's
    optimizer pre/post hooks: in recover mode a fault noticed before
    ``begin`` is replayed in place, one after it falls back (the parameters
    may be half updated). None without the shim."""
    lib = _shim()
    if lib is None:
        return None
    return lib.jitintercept_optimizer_begin, lib.jitintercept_optimizer_end


def counters() -> dict[str, int]:
    """Per-symbol call counts of every interposed CUDA/NCCL entry point."""
    lib = _shim()
    if lib is None:
        return {}
    out: dict[str, int] = {}
    for i in range(lib.jitintercept_counter_count()):
        name = _ffi.string(lib.jitintercept_counter_name(i)).decode()
        out[name] = int(lib.jitintercept_counter(name.encode()))
    return out


def stat(name: str) -> int:
    """Internal statistic ("triggers", "redirected_memcpy", "gil_released", ...); -1 if unknown."""
    lib = _shim()
    return -1 if lib is None else int(lib.jitintercept_stat(name.encode()))


def timeout_s() -> float | None:
    """The watchdog's current hang timeout in seconds (fixed or adaptive); None without the shim.

    Keep it below the process group's own timeout so the shim detects first.
    """
    lib = _shim()
    return None if lib is None else float(lib.jitintercept_timeout_s())


def dump_replay_log(path: str) -> None:
    """Writes the current minibatch's replay log as JSON lines to ``path``."""
    lib = _shim()
    if lib is None:
        raise RuntimeError("libjitintercept.so is not preloaded in this process")
    rc = lib.jitintercept_dump_replay_log(str(path).encode())
    if rc != 0:
        raise OSError(-rc, f"cannot write replay log to {path}")


def replay() -> int:
    """Re-executes the current minibatch's log; 0 on success (see jitintercept.h)."""
    lib = _shim()
    if lib is None:
        raise RuntimeError("libjitintercept.so is not preloaded in this process")
    return int(lib.jitintercept_replay())
