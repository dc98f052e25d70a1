"""The agent's reading of its workers' error files, which must never take it down.

torch's ``ProcessFailure`` (torch.distributed.elastic.multiprocessing.errors)
``json.load``s a failed worker's error file and re-raises whatever that raises.
A worker killed while writing it (torch's writer opens with ``"w"``, then
writes; jitckpt's own writer is atomic, jitckpt/error_file.py) leaves it empty
or cut short, and the agent died of a ``JSONDecodeError`` in the middle of a
recovery: in our ``torchrun_failures`` (recovery/episode.py) or in torch's
``SubprocessContext._capture_process_failures``, which ``_pcontext.wait()``
runs from ``LocalElasticAgent._monitor_workers``.

``TolerantProcessFailure`` reads the file only when it is complete; any other file (empty,
torn, unreadable, not torch's layout) is treated as no file at all, so the
failure is reported from the exit code, as torch does for a worker that wrote
none, with the file's state in the message and, through ``install``'s
callback, in the timeline. ``install`` makes torch's own reads use it: one
module attribute, ``torch.distributed.elastic.multiprocessing.api.ProcessFailure``
(looked up by name at each call in ``_capture_process_failures`` and
``MultiprocessContext._poll``; checked against torch 2.13).

Called on the agent's main thread only (torch's polls run there too).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from jitckpt.error_file import State, inspect
from jitckpt.torch_compat import elastic

# (local rank, error file, its state): the agent's timeline entry for an unusable file
OnUnusable = Callable[[int, str, State], None]
_on_unusable: OnUnusable | None = None


class TolerantProcessFailure(ProcessFailure):
    """torch's ProcessFailure that survives any error file (see the module doc).
    ``error_file_state``: what the file held."""

    def __post_init__(self) -> None:
        path = self.error_file
        state = inspect(path)
        if state.usable:
            try:
                super().__post_init__()
                self.error_file_state = state.name
                return
            except Exception as e:  # changed between the look and torch's read (a process still writing)
                state = State("unreadable", f"changed while read: {type(e).__name__}: {e}")
        self.error_file = os.devnull  # not a regular file: torch's "no error file" path
        super().__post_init__()  # the message from the exit code; error_file becomes "<N/A>"
        self.error_file_state = state.name
        why = "; the worker ended while writing it" if state.name in ("empty", "torn") else ""
        self.message = f"{self.message} (its error file {path} was {state.name}: {state.detail}{why}; not used)"
        if _on_unusable is not None:
            _on_unusable(self.local_rank, path, state)


def install(on_unusable: OnUnusable) -> None:
    """torch's own reads of the error files go through ``TolerantProcessFailure``, and every
    unusable file is handed to ``on_unusable`` (the latest call's)."""
    global _on_unusable
    _on_unusable = on_unusable
    elastic.set_process_failure_class(TolerantProcessFailure)
