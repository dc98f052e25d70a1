"""The job's jit dir as ``jitrun`` takes it: which job it is, where, and the lock.

A job is "the same job" when its id (``--rdzv-id``, else a hash of the
command) and its command (the script as typed and its arguments) are the
same: ``identity``. job.json records it, every checkpoint manifest carries
it, and a restore loads only replicas of this identity, so two jobs that
share an id (a second job started with the first one's ``--rdzv-id``, as
jitrun's own hint says, but another seed) never load each other's state.
Editing the script's contents keeps the identity (fixing a bug and
resuming is the usual reason to resume); other arguments are another job.

``claim`` checks the dir is this job's, takes its lock (launcher/joblock.py)
and only then writes job.json, so two jitruns racing for a fresh dir cannot
both own it. Main thread only.
"""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path

from jitckpt.wire import layout

from . import joblock

# what an operator can do something about, said in one line instead of a traceback
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


class DirRefused(RuntimeError):
    """The one line jitrun prints before exiting 2."""


def blank_path_option(args) -> str | None:
    """An empty or whitespace-only path option (``--jit-dir ""`` silently meant the default dir)."""
    for flag, value in (("--jit-dir", getattr(args, "jit_dir", None)), ("--log-dir", getattr(args, "log_dir", None)),
                        ("training script", getattr(args, "training_script", None))):
        if value is not None and not value.strip():
            fix = ("pass the script's path" if flag == "training script"
                   else f"pass a directory, or leave {flag} out for its default")
            return f"{flag} {value!r}: an empty path; {fix}"
    return None


def command_of(args) -> list[str]:
    """The command that makes the job, as typed: ``-m``, the script or program, its arguments."""
    return [*(["-m"] if getattr(args, "module", False) else []), args.training_script, *args.training_script_args]


def identity(job_id: str, command: list[str]) -> str:
    return "id-" + hashlib.sha256("\0".join([job_id, *command]).encode()).hexdigest()[:16]


def claim(root: Path, job_id: str, ident: str, command: list[str], *, one_node: bool) -> joblock.JobLock:
    """Make ``root`` this job's and lock it (DirRefused: why not, one line)."""
    try:
        layout.claim_root(root, job_id, ident, command, record=False)  # another job's dir: nothing created
        lock = joblock.acquire(root, job_id, ident, exclusive=one_node)
    except (layout.CheckpointDirError, joblock.JobBusy) as e:
        raise DirRefused(str(e)) from None
    except OSError as e:
        raise DirRefused(f"jit dir {str(root)!r}: cannot take its lock ({e.strerror or e}); free space there or "
                         "pass --jit-dir on a disk this user can write") from None
    try:
        layout.claim_root(root, job_id, ident, command)
    except (layout.CheckpointDirError, OSError) as e:
        lock.release()
        raise DirRefused(str(e) if isinstance(e, layout.CheckpointDirError) else
                         f"jit dir {str(root)!r}: cannot record the job there ({e.strerror or e}); free space there "
                         "or pass --jit-dir on a larger disk") from None
    return lock
