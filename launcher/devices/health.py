"""Device health through NVML: what jitrun checks before every (re)start and
on a period while the job runs.

``check()`` asks NVML (the ``pynvml`` module of the ``nvidia-ml-py`` wheel, which
loads ``libnvidia-ml.so.1``; ``JITCKPT_NVML_LIB`` names another file, e.g. the CPU
stand-in in ``build/sim``) about every device of this node. A device is failing when
NVML says it is lost ("fallen off the bus"), reports an uncorrected ECC error, or
delivered a fatal XID event. Without NVML (no driver: every CPU machine) nothing is
checked and nothing is reported failing.

Threads: ``check()`` may run on any thread; ``HealthMonitor`` runs it on a daemon
thread of its own and calls ``on_failing`` there, once per newly failing device (the
agent's callback only hands the list to its main thread and wakes it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from jitckpt.wire import contract

# XIDs after which a device should not be trusted with a job (NVIDIA's XID catalogue):
# 48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 92 high
# single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP errors.
FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})


@dataclass(frozen=True)
class DeviceHealth:
    index: int
    uuid: str
    ok: bool
    reason: str = ""


_lock = threading.Lock()  # nvmlInit/Shutdown are process-wide
_xids: dict[int, int] = {}  # device index -> last fatal XID seen (sticky: a device does not heal)


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    lib = contract.NVML_LIB.get()
    try:
        with _lock:
            if lib:
                # pynvml loads "libnvidia-ml.so.1" by name; the stand-in is given by path
                import ctypes

                if getattr(pynvml, "nvmlLib", None) is None:
                    pynvml.nvmlLib = ctypes.CDLL(lib)
            pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def available() -> bool:
    nv = _nvml()
    if nv is None:
        return False
    nv.nvmlShutdown()
    return True


def check() -> list[DeviceHealth]:
    """Every device of this node, failing or not; [] without NVML."""
    nv = _nvml()
    if nv is None:
        return []
    out = []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            out.append(_one(nv, i))
    finally:
        nv.nvmlShutdown()
    return out


def _one(nv, i: int) -> DeviceHealth:
    try:
        h = nv.nvmlDeviceGetHandleByIndex(i)
        uuid = nv.nvmlDeviceGetUUID(h)
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    except nv.NVMLError as e:
        return DeviceHealth(i, "", False, f"NVML: {e}")
    if i in _xids:
        return DeviceHealth(i, uuid, False, f"XID {_xids[i]}")
    try:
        ecc = nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
    except nv.NVMLError as e:
        if "lost" in str(e).lower():
            return DeviceHealth(i, uuid, False, f"NVML: {e}")
        ecc = 0  # not supported (consumer parts): nothing to say
    if ecc:
        return DeviceHealth(i, uuid, False, f"{ecc} uncorrected ECC error(s)")
    try:
        nv.nvmlDeviceGetName(h)
    except nv.NVMLError as e:
        return DeviceHealth(i, uuid, False, f"NVML: {e}")
    return DeviceHealth(i, uuid, True)


def _poll_xids(nv, timeout_ms: int) -> None:
    """Fatal XID events of every device into ``_xids`` (waits up to ``timeout_ms``)."""
    try:
        es = nv.nvmlEventSetCreate()
    except nv.NVMLError:
        return
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
            except nv.NVMLError:
                continue
        while True:
            try:
                ev = nv.nvmlEventSetWait(es, timeout_ms)
            except nv.NVMLError:  # timeout: no event
                return
            xid = int(ev.eventData)
            if xid in FATAL_XIDS:
                for i in range(nv.nvmlDeviceGetCount()):
                    if _addr(nv.nvmlDeviceGetHandleByIndex(i)) == _addr(ev.device):
                        _xids[i] = xid
            timeout_ms = 0
    finally:
        nv.nvmlEventSetFree(es)


def _addr(handle) -> int | None:
    import ctypes

    return ctypes.cast(handle, ctypes.c_void_p).value


class HealthMonitor:
    def __init__(self, interval_s: float, on_failing: Callable[[list[DeviceHealth]], None],
                 emit: Callable[..., None]) -> None:
        self._interval = interval_s
        self._on_failing = on_failing
        self._emit = emit
        self._seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jitrun-health", daemon=True)

    def start(self) -> HealthMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def poll_once(self) -> list[DeviceHealth]:
        nv = _nvml()
        if nv is not None:
            try:
                _poll_xids(nv, 0)
            finally:
                nv.nvmlShutdown()
        new = [d for d in check() if not d.ok and d.index not in self._seen]
        if new:
            self._seen |= {d.index for d in new}
            for d in new:
                self._emit("device_unhealthy", stage="running", device=d.index, uuid=d.uuid, reason=d.reason)
            self._on_failing(new)
        return new

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll_once()
            except Exception as e:  # health checks never take the job down
                self._emit("health_check_failed", error=f"{type(e).__name__}: {e}")
