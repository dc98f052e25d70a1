"""Wake the agent when something happens, instead of polling on a period.

torchrun's agent sleeps ``--monitor-interval`` between looks at its workers;
every event on the failure path (a worker exit, a worker's report) then waits
up to that long to be seen, and jitrun's failure handling looked again every
20 ms. ``Wakeup.wait`` blocks until a worker process ends (a pidfd per
process becomes readable) or a worker reports (a thread blocked in the
store's ``wait`` on the next report slot writes to a pipe), or the timeout
passes. The timeout remains for what has no event: sampling the workers' CPU
time (a hung or stopped process's last sign of life) and noticing a process
that is stopped.

Threads: the agent's main thread calls ``wait``/``watch``/``close``; the
``jitrun-report-waiter`` thread only blocks on its own store connection and
writes one byte to the pipe. Shared state: ``_stop`` (an Event) and the pipe;
no locks. The waiter's store wait has no short timeout (each expiry logs a
C++ warning into the job's output); a slot whose writer died is filled with a
wake record by the report reader that skips it; to end it at the end of the job, the main thread sets ``_stop``
and fills the slot the waiter waits on with a ``_wake`` record if that slot
is still empty (compare_set: never over a real report; readers skip it), so
the waiter returns at once even when that slot's writer died between its two
calls. A thread still inside a store call when the interpreter exits aborts
the process, so ``close`` says whether the waiter ended.
"""

from __future__ import annotations

import os
import select
import threading
from datetime import timedelta

from jitckpt.wire import auth
from jitckpt.wire.report import JOB, WAKE, Stream

# The waiter's store wait: a timeout logs two C++ warnings into the job's output, so it is
# long. A slot whose writer died between its two calls is filled with a wake record by the
# reader that skips it (jitckpt.wire.report), which moves the waiter on; after this long
# the waiter also goes past an empty slot by itself when later ones exist.
WAIT_S = 3600.0


class Cadence:
    """When the monitor loop reads the store: at once after a wake-up (a report or an exit),
    else once per ``period_s``. This node's reports wake the loop themselves; what only
    polling finds (another node's failure mark, the job-wide stream) can wait that long,
    and each read is a round trip through the store's thread, which on a busy node takes
    a core from the ranks. Main thread only."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._next = 0.0

    def due(self, woken: bool, now: float) -> bool:
        if woken or now >= self._next:
            self._next = now + self.period_s
            return True
        return False


class Wakeup:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._pidfds: dict[int, int] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._watching: tuple[str, int] | None = None
        self._token: str | None = None
        self._stream = JOB
        self._next = 0  # the slot the waiter waits on (written by the waiter only)
        self._old: list[threading.Thread] = []  # waiters of earlier store addresses

    # -- reports ------------------------------------------------------------

    def watch(self, store_addr: tuple[str, int], token: str, stream: str = JOB) -> None:
        """Wake on every report written to ``stream`` (this node's) of the workers' store at
        ``store_addr`` from now on (a new address replaces the old watch; the
        old waiter ends at its next wake-up or when its store goes away)."""
        if store_addr == self._watching:
            return
        self._stop.set()
        self._old = [t for t in [*self._old, self._thread] if t is not None and t.is_alive()]
        self._watching, self._token, self._stream = store_addr, token, stream
        self._next = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store_addr, token, stream, self._stop),
                                        name="jitrun-report-waiter", daemon=True)
        self._thread.start()

    def _run(self, addr: tuple[str, int], token: str, stream: str, stop: threading.Event) -> None:
        from jitckpt.wire.report import connect

        s = Stream(auth.of(token), stream)
        try:
            store = connect(*addr)
            nxt = store.add(s.counter, 0) + 1
        except Exception:
            return  # the store is gone (job ending); the timeout path still works
        while not stop.is_set():
            if stop is self._stop:  # an earlier address's waiter does not steer the current one
                self._next = nxt
            try:
                # the slot is set once its writer finished the report
                store.wait([s.slot(nxt)], timedelta(seconds=WAIT_S))
            except Exception:
                if stop.is_set():
                    return
                try:
                    # a slot whose writer died between add and set stays
                    # empty; go past it when later slots exist (the reader
                    # skips it too)
                    if store.add(s.counter, 0) > nxt:
                        nxt += 1
                except Exception:
                    return  # the store is gone
                continue
            nxt += 1
            self.poke()

    def poke(self) -> None:
        """Wake the monitor loop now (any thread)."""
        try:
            os.write(self._w, b"r")
        except BlockingIOError:
            pass  # a wakeup is already pending

    # -- waiting ------------------------------------------------------------

    def wait(self, pids: list[int], timeout_s: float) -> bool:
        """Return when a process of ``pids`` has ended, a report arrived, or
        ``timeout_s`` passed; False only in the last case."""
        fds = [self._r]
        for pid in pids:
            fd = self._pidfd(pid)
            if fd is None:
                return True  # already reaped: something to look at now
            fds.append(fd)
        for pid in set(self._pidfds) - set(pids):
            os.close(self._pidfds.pop(pid))
        ready, _, _ = select.select(fds, [], [], max(timeout_s, 0.0))
        if self._r in ready:
            try:
                while os.read(self._r, 4096):
                    pass
            except BlockingIOError:
                pass
        return bool(ready)

    def _pidfd(self, pid: int) -> int | None:
        fd = self._pidfds.get(pid)
        if fd is None:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return None
            self._pidfds[pid] = fd
        return fd

    # -- end ----------------------------------------------------------------

    def _stop_thread(self) -> bool:
        if self._thread is None:
            return True
        self._stop.set()
        if self._watching is not None and self._token is not None and self._next:
            try:
                from jitckpt.wire.report import connect

                a = auth.of(self._token)
                key = Stream(a, self._stream).slot(self._next)
                wake = a.seal(key, {"event": WAKE, "t": 0.0, "rank": None})
                connect(*self._watching, timeout_s=2.0).compare_set(key, "", wake)
            except Exception:
                pass  # the store is gone: the waiter's wait has failed already
        self._thread.join(timeout=2.0)
        stopped = not self._thread.is_alive()
        self._thread = None
        return stopped

    def close(self) -> bool:
        """End the waiter; False if a thread is still inside a store call."""
        stopped = self._stop_thread()
        for t in self._old:
            t.join(timeout=0.5)
        stopped = stopped and not any(t.is_alive() for t in self._old)
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        return stopped
