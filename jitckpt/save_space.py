"""Room for a JIT save, and what a failed one leaves: nothing.

A JIT save is the job's one chance to keep the minibatch it is in, and a
full disk is its likeliest failure. Before the save the free space of the
jit dir is compared with the size of this shard's newest checkpoint there
(the state does not change size between minibatches); a save that fails
(``torch.save`` on a full tmpfs says ``unexpected pos`` and nothing of space)
has its staging directory removed on every path, and a failure on a disk
with under ``NEAR_FULL`` bytes left, or with ENOSPC/EDQUOT anywhere in its
chain, becomes ``NoSpace``: one line naming the directory, the bytes needed
and free, and the fix. Older checkpoints are never touched, so the newest
complete one stays the restore source.

Called by the thread that owns the save (runtime.py); no state of its own.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import re
import shutil
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .wire import layout

NEAR_FULL = 1 << 20  # a write failing with less than this free is taken as the disk being full
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class NoSpace(OSError):
    """The jit dir's disk cannot take this save. ``needed``: bytes the save
    needs at least (None: unknown); ``free``: bytes free there."""

    def __init__(self, directory: Path, needed: int | None, free: int | None, why: str,
                 at_least: bool = False) -> None:
        super().__init__(errno.ENOSPC, why)
        self.directory = Path(directory)
        self.needed = needed
        self.at_least = at_least  # ``needed`` is what was written when the disk filled: more is needed
        self.free = free
        self.why = why

    def __str__(self) -> str:
        need = "unknown" if self.needed is None else ("more than " if self.at_least else "") + fmt(self.needed)
        have = "unknown" if self.free is None else fmt(self.free)
        return (f"no space for the JIT checkpoint in {self.directory}: {self.why}; needed {need}, free {have}. "
                "Free space there or pass --jit-dir on a larger disk, then rerun the same command: it resumes "
                "from the newest complete checkpoint, which is kept")

    def release(self) -> None:
        """Drop the failed save's exception and recount the free bytes: a writer the
        save_fn left open (torch.save's, referenced from that exception's frames)
        holds the blocks of the removed temp file until then."""
        self.__cause__ = self.__context__ = None
        traceback.clear_frames(self.__traceback__)  # contextlib's __exit__ frame holds the first exception too
        self.__traceback__ = None
        gc.collect()
        free = free_bytes(self.directory)
        if free is not None:
            self.free = free

    def fields(self) -> dict:
        return {"dir": str(self.directory), "needed": self.needed, "free": self.free}


def free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def tree_bytes(path: Path) -> int:
    total = 0
    for cur, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(cur, n)).st_size
            except OSError:
                pass
    return total


_STEP = re.compile(r"^step-(\d+)$")


def last_size(root: Path, shard: str) -> tuple[int, int] | None:
    """(step, bytes) of this shard's newest published replica here, from its manifest."""
    base = Path(root) / "ckpt"
    try:
        steps = sorted((int(m.group(1)) for e in os.scandir(base) if (m := _STEP.match(e.name))), reverse=True)
    except OSError:
        return None
    for step in steps:
        d = base / f"step-{step}" / layout.shard_dirname(shard)
        try:
            ranks = [e.path for e in os.scandir(d) if e.name.startswith("rank-")]
        except OSError:
            continue
        for r in ranks:
            try:
                files = json.loads((Path(r) / layout.MANIFEST).read_text())["files"]
                return step, sum(int(f["size"]) for f in files.values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
    return None


def check_room(root: Path, shard: str) -> None:
    """Raise NoSpace when the disk has less room than this shard's last checkpoint took."""
    last = last_size(root, shard)
    free = free_bytes(root)
    if last is None or free is None or free >= last[1]:
        return
    raise NoSpace(root, last[1], free, f"the disk has less room than the last checkpoint of shard {shard} "
                                       f"(step {last[0]}) took")


def _out_of_space(e: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError) and cur.errno in _SPACE_ERRNOS:
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


@contextmanager
def staged(root: Path, step: int, shard: str, rank: int) -> Iterator[Path]:
    """The staging directory of a save (layout.staging_dir); removed whatever
    goes wrong, and a failure on a full disk raised as NoSpace."""
    tmp: Path | None = None
    try:
        check_room(root, shard)
        tmp = layout.staging_dir(root, step, shard, rank)
        yield tmp
    except NoSpace:
        raise
    except BaseException as e:
        written = tree_bytes(tmp) if tmp is not None and tmp.exists() else 0
        free = free_bytes(root)  # before the removal: what the save ran into
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and (_out_of_space(e) or (free is not None and free < NEAR_FULL)):
            last = last_size(root, shard)
            bigger = last is not None and last[1] > written
            raise NoSpace(root, last[1] if bigger else written, free_bytes(root),
                          f"the disk filled after {fmt(written)} of it were written ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else ''})", at_least=not bigger) from e
        raise
