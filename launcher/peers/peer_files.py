"""What a peer may make this node write: names, sizes and modes checked here.

Files arrive from other nodes (replica transfers, migrated workers' images). The
receiver decides where they go and with which mode; a peer only names files
relative to a directory the receiver chose, and announces sizes the receiver
caps. Nothing here trusts the sender, authenticated or not: a token holder on a
compromised node must not get a write outside the receiver's directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from jitckpt.wire import layout

MAX_NAME = 1024
MAX_FILES = 100_000
# room left on the receiving file system after a transfer (a node must not fill its own disk)
HEADROOM = 64 << 20


class RefusedFile(ValueError):
    pass


def safe_relpath(name: object) -> str:
    """``name`` if it is a plain relative path (no absolute path, no ``..``/``.``, no
    empty or control-character component), else RefusedFile."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise RefusedFile(f"file name {name!r:.80}: not a name")
    if name.startswith("/") or "\\" in name or any(ord(c) < 32 or c == "\x7f" for c in name):
        raise RefusedFile(f"file name {name!r:.80}: absolute, or with a backslash or control character")
    parts = name.split("/")
    if any(p in ("", ".", "..") or len(p) > 255 for p in parts):
        raise RefusedFile(f"file name {name!r:.80}: an empty, '.' or '..' component")
    return name


def file_list(files: object, *, cap: int | None = None, where: Path | None = None) -> list[tuple[str, int]]:
    """An announced [[name, size], ...] as checked (name, size) pairs: safe names, no
    duplicates, sizes that fit ``cap`` bytes in total and the free space of ``where``."""
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise RefusedFile("the file list is not a list of at most 100000 entries")
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    total = 0
    for item in files:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise RefusedFile(f"file list entry {item!r:.80} is not [name, size]")
        name, size = item
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise RefusedFile(f"size of {name!r:.80} is {size!r:.40}")
        name = safe_relpath(name)
        if name in seen:
            raise RefusedFile(f"{name!r:.80} is announced twice")
        seen.add(name)
        total += size
        out.append((name, size))
    if cap is not None and total > cap:
        raise RefusedFile(f"{total} bytes announced, more than the {cap} expected")
    if where is not None:
        free = shutil.disk_usage(where).free
        if total + HEADROOM > free:
            raise RefusedFile(f"{total} bytes announced; {where} has {free} bytes free")
    return out


def open_new(base: Path, name: str) -> int:
    """A new file ``base/name`` (0600, never through a symlink), its missing
    directories created 0700; returns the descriptor."""
    dest = base / safe_relpath(name)
    layout.makedirs_private(dest.parent)
    real_base, real_parent = os.path.realpath(base), os.path.realpath(dest.parent)
    if os.path.commonpath([real_base, real_parent]) != real_base:
        raise RefusedFile(f"{name!r:.80} resolves outside {base}")
    return os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, layout.FILE_MODE)
