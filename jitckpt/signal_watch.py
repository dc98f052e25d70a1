"""A worker's stop signals under jitrun: SIGTERM and SIGINT mean "take the JIT
checkpoint now". A scheduler's preemption (Slurm's ``scancel``, a pod deletion,
a spot notice: every process of the job), Ctrl-C in the job's terminal, and
jitrun's own request to the healthy ranks of a failure episode all arrive this
way; which one it was is for the agent to tell (launcher/preempt.py). The save
starts at once in forward/backward, or at the next minibatch start after an
optimizer step (runtime.py); a second signal changes nothing here (the first
one's save goes on), jitrun ends the job at once on a second one.

Threads and locks
-----------------
* Python-level handlers (main thread, between two bytecodes): ``_ignore``,
  empty on purpose. They only replace the default actions (terminate; a
  KeyboardInterrupt in whatever the main thread runs, which would end the
  process mid-save); doing the work there could run while the main thread
  holds the runtime's ``_lock`` (not reentrant).
* the C-level handler writes the signal number to the wakeup pipe
  (async-signal-safe), also while the main thread waits in a collective
  with the GIL released; a script's own Python handler for these signals
  (installed after ours) runs as well, the pipe gets the byte all the same.
* watcher thread (``jitckpt-watcher``, daemon): beats the hang watch's
  record, waits on the pipe, reads it under ``exit_lock`` and hands a stop
  signal to ``Runtime.on_stop_signal`` (which may save and end the process).
* main thread, once, when the user's script has ended (``take_pending``,
  from ``Runtime.script_ended``): reads the pipe under ``exit_lock`` too, so
  a signal that a script which catches it itself answered by returning (HF
  Trainer, a ``signal.signal`` handler that stops the loop) is not lost in
  the race with the watcher.
* atexit (``_quiesce``): takes ``exit_lock`` for good, so no store call is in
  flight on the watcher when the interpreter finalizes.

``exit_lock`` is the runtime's ``_exit_lock``; lock order: ``_exit_lock``,
then the runtime's ``_lock``. The read end of the pipe is non-blocking: two
readers under the lock, either may find it empty.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import threading
from typing import Any, Protocol


class Stoppable(Protocol):
    """What the watch needs of the runtime (runtime.Runtime)."""

    _exit_lock: threading.Lock
    waits: Any  # collective_waits.Waits or None: beaten by the watcher

    def on_stop_signal(self, sig: int) -> None: ...


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
HEARTBEAT_S = 0.1  # the watcher's beat period (launcher/recovery/hang.py: STALE_S)


class SignalWatch:
    def __init__(self, rt: Stoppable) -> None:
        self.rt = rt
        self._fd: int | None = None

    def install(self) -> bool:
        """Handlers, wakeup pipe, watcher thread, atexit; False off the main thread (nothing done)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)
        os.set_blocking(r, False)
        self._fd = r
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._ignore)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="jitckpt-watcher", daemon=True).start()
        atexit.register(self._quiesce)
        return True

    @staticmethod
    def _ignore(signum, frame) -> None:
        pass  # see the module docstring: the watcher acts on the wakeup byte

    def _quiesce(self) -> None:
        """At interpreter exit, before finalization: wait for the watcher to
        leave any store call and keep it from starting another. A daemon
        thread that is inside a pybind11 call (TCPStore) when finalization
        starts is ended by pthread_exit in pybind11's noexcept GIL
        re-acquisition: std::terminate, "terminate called without an active
        exception", SIGABRT. The lock is never released: a signal arriving
        now finds an exiting process, which is what the sender wanted."""
        self.rt._exit_lock.acquire()

    def _read(self) -> int | None:
        """The first stop signal in what the pipe holds now (caller holds exit_lock)."""
        assert self._fd is not None
        try:
            data = os.read(self._fd, 64)
        except BlockingIOError:
            return None  # the other reader took it
        return next((int(s) for s in STOP_SIGNALS if int(s) in data), None)

    def _watch(self) -> None:
        # the beat says this process can still run Python: one that holds the GIL for good stops beating
        fd = self._fd
        while True:
            if self.rt.waits is not None:
                self.rt.waits.beat()
            if not select.select([fd], [], [], HEARTBEAT_S)[0]:
                continue
            with self.rt._exit_lock:  # held for good once the interpreter exits
                sig = self._read()
                if sig is not None:
                    self.rt.on_stop_signal(sig)

    def take_pending(self) -> None:
        """A stop signal the watcher has not acted on yet is acted on here (main thread);
        returns after the watcher finished acting on one (a save it runs ends the process)."""
        if self._fd is None:
            return
        with self.rt._exit_lock:
            sig = self._read()
            if sig is not None:
                self.rt.on_stop_signal(sig)
