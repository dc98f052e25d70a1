"""A worker's error file (``TORCHELASTIC_ERROR_FILE``): torch's layout, written
so that it is complete or absent, and read back without trusting it.

torch's ``ErrorHandler.record_exception`` opens the file with ``"w"`` (it exists,
0 bytes) and only then writes the JSON; a worker that dies in between (the
agent's SIGTERM after another rank failed, the episode's SIGKILL) leaves it
empty or cut short, and torch's agent, reading it with ``json.load`` in
``ProcessFailure``, dies of the ``JSONDecodeError``. ``write`` puts the bytes in
a temp file of the same directory and renames it over the name: a kill at any
point leaves the old state (no file) or the whole file, never a part, under
that name; at worst a ``.error.json.*.tmp`` file next to it.

``inspect`` says what a file holds, in the terms the agent reports it with:
absent, complete, empty, torn (not complete JSON), unreadable (I/O error, not
UTF-8 text) or malformed (JSON, but not torch's layout). Only "absent" and
"complete" are what torch's ``ProcessFailure`` reads without raising.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import traceback
from dataclasses import dataclass

USABLE = ("absent", "complete")


def payload(exc: BaseException) -> dict:
    """What torch's ``ErrorHandler.record_exception`` writes for ``exc`` (torch 2.13)."""
    return {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": "".join(traceback.format_exception(type(exc), exc,
                                                                                         exc.__traceback__)),
                                      "timestamp": str(int(time.time()))}}}


def write(path: str, exc: BaseException) -> None:
    """Record ``exc`` in the error file ``path``: temp file in the same
    directory, fsync, rename; the temp file is removed when anything fails
    (a kill, which runs nothing, leaves it)."""
    data = json.dumps(payload(exc)).encode()
    d, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=d)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass(frozen=True)
class State:
    name: str  # absent | complete | empty | torn | unreadable | malformed
    detail: str

    @property
    def usable(self) -> bool:
        """Whether torch's ProcessFailure reads the file without raising."""
        return self.name in USABLE


def inspect(path: str | None) -> State:
    """What the error file at ``path`` holds (it may be anything: a worker,
    torch, or another program wrote it, or was killed while doing so)."""
    if not path or not os.path.isfile(path):  # torch's own test for "no error file"
        return State("absent", "no file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        return State("unreadable", f"{type(e).__name__}: {e.strerror or e}")
    if not raw.strip():
        return State("empty", f"{len(raw)} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return State("unreadable", f"{len(raw)} bytes, not UTF-8 text ({e.reason} at byte {e.start})")
    except ValueError as e:
        return State("torn", f"{len(raw)} bytes, not complete JSON ({e})")
    try:
        _torch_fields(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return State("malformed", f"{len(raw)} bytes of JSON without torch's error-file fields "
                                  f"({type(e).__name__}: {e})")
    return State("complete", f"{len(raw)} bytes")


def _torch_fields(data) -> tuple[object, int]:
    """What torch's ``ProcessFailure._get_error_data`` takes from the file (torch 2.13)."""
    message = data["message"]
    if isinstance(message, str):
        return message, int(data.get("timestamp", 0))
    return message, int(message["extraInfo"]["timestamp"])
