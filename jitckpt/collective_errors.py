"""Telling a collective failure (a peer gone, a timed-out collective) from the rank's own error."""

from __future__ import annotations

from . import faults as _faults


def is_collective_error(exc: BaseException) -> bool:
    """Errors that mean "a peer is gone or the collective timed out", as raised
    by torch's gloo/nccl backends, as opposed to this rank's own failure."""
    try:
        import torch.distributed as dist

        if isinstance(exc, (dist.DistError,)):
            return True
    except ImportError:  # pragma: no cover
        pass
    if not isinstance(exc, RuntimeError) or isinstance(exc, _faults.InjectedFault):
        return False
    msg = str(exc)
    return any(m in msg for m in ("third_party/gloo", "gloo/transport", "NCCL", "ProcessGroup",
                                  "Connection closed by peer", "Connection reset by peer",
                                  "Timed out waiting", "Application timeout caused pair closure"))


def find_collective_error(exc: BaseException | None) -> BaseException | None:
    """``exc`` or the first collective error it was raised from or while
    handling (``__cause__``/``__context__``): a framework that wraps the error,
    or exits with ``sys.exit`` from its ``except`` clause, keeps it there."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if is_collective_error(exc):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


__all__ = ["find_collective_error", "is_collective_error"]
