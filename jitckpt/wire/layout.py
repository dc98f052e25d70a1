"""On-disk checkpoint layout, atomic publication and validation.

Layout under the job's jit dir (everything 0700 / 0600)::

    <root>/job.json                              which job owns this dir
    <root>/ckpt/step-<S>/shard-<X>/rank-<R>/     one replica's checkpoint
        <files written by the user's save_fn>
        MANIFEST.json                            written last; lists every file + sha256

A replica directory is first filled under a ``.tmp-rank-<R>-<pid>`` name and only
renamed into place after its manifest is fsynced, so a reader that finds
``rank-<R>`` with a manifest whose checksums match holds a complete checkpoint.
Anything else (no manifest, wrong job, missing/extra/corrupt file) is skipped
and never handed to a restore.

This module imports no torch: the launcher uses it to decide restarts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "MANIFEST.json"
JOB_FILE = "job.json"
FORMAT_VERSION = 1
DIR_MODE = 0o700
FILE_MODE = 0o600

_STEP_RE = re.compile(r"^step-(\d+)$")
_SHARD_RE = re.compile(r"^shard-([A-Za-z0-9_.-]+)$")
_RANK_RE = re.compile(r"^rank-(\d+)$")


class CheckpointDirError(RuntimeError):
    """The jit dir cannot be used (unwritable, or owned by another job)."""


@dataclass(frozen=True)
class Replica:
    """A complete, verified replica checkpoint."""

    path: Path
    step: int
    shard: str
    rank: int
    job_id: str
    saved_at: float


def shard_dirname(shard: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", shard):
        raise ValueError(
            f"shard name {shard!r} may only contain letters, digits, '_', '.' and '-'"
        )
    return f"shard-{shard}"


def replica_dir(root: Path, step: int, shard: str, rank: int) -> Path:
    return root / "ckpt" / f"step-{step}" / shard_dirname(shard) / f"rank-{rank}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_private(path: Path) -> None:
    """mkdir -p with 0700 on every directory we create."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            pass


def own_private_dir(path: Path) -> None:
    """``path`` as a directory of this user with mode 0700: created here, or an
    existing one of ours (tightened to 0700). A symlink, a non-directory or another
    user's directory is refused (CheckpointDirError): its owner could swap or plant
    what we write and read there."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    except OSError as e:
        raise CheckpointDirError(f"{path} is not writable: cannot create it ({e.strerror}); "
                                 "choose a path this user can write") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise CheckpointDirError(f"{path} is not a directory of ours ({e.strerror}: a symlink or a file?); "
                                 "remove it or choose another path") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise CheckpointDirError(
                f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): its owner could change "
                "what jitckpt writes there. Remove it (as its owner or root) or choose another path")
        if st.st_mode & 0o7777 != DIR_MODE:
            os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def is_own_private_dir(path: Path) -> bool:
    """An existing directory (not a symlink) of this user that no one else can write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via temp file + fsync + rename + dir fsync."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _list_files(d: Path) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(d):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), d)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


# --- job ownership -----------------------------------------------------------


def claim_root(root: Path, job_id: str, identity: str | None = None, command: list[str] | None = None,
               *, record: bool = True) -> None:
    """Create/validate the jit dir for the job ``job_id`` run as ``identity``
    (what makes two runs the same job: the job id, the script and its
    arguments; ``command`` is what the refusal shows of it).

    Raises CheckpointDirError with what to do when the directory is not
    writable or belongs to another job: silently mixing two jobs' checkpoints
    would restore the wrong model. ``record``: write ``job.json`` when absent
    (jitrun does it holding the jit dir's lock, launcher/joblock.py).
    """
    try:
        makedirs_private(root.parent)
        try:
            own_private_dir(root)
        except CheckpointDirError as e:
            raise CheckpointDirError(f"jit dir: {e} (--jit-dir)") from None
        probe = root / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointDirError(
            f"jit dir {str(root)!r} is not writable ({e.strerror}); "
            "pass --jit-dir pointing at a directory this user can write"
        ) from None
    job_file = root / JOB_FILE
    if job_file.exists():
        owner = _read_owner(job_file)
        if owner["job_id"] != job_id:
            raise CheckpointDirError(
                f"jit dir {str(root)!r} belongs to job {owner['job_id']!r} (its {JOB_FILE}){_held(root)}, not to "
                f"this job {job_id!r}; pass a fresh --jit-dir, or --rdzv-id {owner['job_id']} with that job's "
                "command to resume that job")
        theirs = owner.get("identity")
        if identity is not None and theirs is not None and theirs != identity:
            shown = " ".join(owner.get("command") or []) or "another command"
            raise CheckpointDirError(
                f"jit dir {str(root)!r} belongs to job {job_id!r} run as `{shown}`{_held(root)}; this command "
                f"(`{' '.join(command or [])}`) is another job with the same id. Pass a fresh --jit-dir, or run "
                "that job's command to resume it")
        if record and identity is not None and theirs is None:  # written before identities: adopt it
            _write_owner(job_file, {**owner, "identity": identity, "command": list(command or [])})
        return
    if record:
        _write_owner(job_file, {"job_id": job_id, "identity": identity, "command": list(command or []),
                                "created": time.time(), "format": FORMAT_VERSION})


def _read_owner(job_file: Path) -> dict:
    try:
        owner = json.loads(job_file.read_text())
        if not isinstance(owner, dict) or not isinstance(owner["job_id"], str):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointDirError(
            f"{job_file} is unreadable or malformed; remove it or pass another --jit-dir"
        ) from None
    return owner


def _write_owner(job_file: Path, doc: dict) -> None:
    atomic_write_bytes(job_file, json.dumps({k: v for k, v in doc.items() if v is not None}).encode())


def _held(root: Path) -> str:
    """' and holds its checkpoints (steps ...)' for a refusal, or ''."""
    try:
        steps = sorted(int(m.group(1)) for e in os.scandir(root / "ckpt") if (m := _STEP_RE.match(e.name)))
    except OSError:
        steps = []
    if not steps:
        return ""
    shown = ", ".join(map(str, steps[-5:]))
    return (f" and holds its checkpoints (step{'s' if len(steps) > 1 else ''} "
            f"{'..., ' if len(steps) > 5 else ''}{shown})")


def read_identity(root: Path) -> str | None:
    try:
        return json.loads((root / JOB_FILE).read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        return None


RANKS_FILE = "ranks.json"
_ranks_lock = threading.Lock()  # the agent's main thread and its migration target thread both update it


def update_ranks(root: Path, ranks: dict[int, dict] | None = None, *, drop: tuple[int, ...] = (),
                 replace: bool = False) -> None:
    """``<root>/ranks.json``: global rank -> {pid, node, host, attempt} of the
    ranks running on this node now, so an operator can find rank R's process
    to profile, attach to or stop. Each node's file lists its own ranks.
    ``replace``: this node's agent started its workers; entries of ranks
    migrated in (``"migrated_in"``) whose process still lives are kept."""
    with _ranks_lock:
        path = root / RANKS_FILE
        try:
            old = json.loads(path.read_text())["ranks"]
        except (OSError, ValueError, KeyError, TypeError):
            old = {}
        if replace:
            old = {r: v for r, v in old.items()
                   if isinstance(v, dict) and v.get("migrated_in") and _alive(v.get("pid"))}
        cur = {**old, **{str(r): v for r, v in (ranks or {}).items()}}
        for r in drop:
            cur.pop(str(r), None)
        doc = {"t": time.time(), "ranks": dict(sorted(cur.items(), key=lambda kv: int(kv[0])))}
        atomic_write_bytes(path, json.dumps(doc, indent=1).encode())


def _alive(pid: object) -> bool:
    """A process of that PID exists (signal 0; one owned by another user counts)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


FINISHED_FILE = "FINISHED.json"


def mark_finished(root: Path) -> None:
    """The job ended with exit 0: its checkpoints describe a finished run,
    and running the same command again starts a new one (``retire_finished``)."""
    atomic_write_bytes(root / FINISHED_FILE, json.dumps({"finished": time.time()}).encode())


def finished_at(root: Path) -> float | None:
    """When the previous run in ``root`` finished, or None."""
    try:
        return float(json.loads((root / FINISHED_FILE).read_text())["finished"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def retire_finished(root: Path) -> Path:
    """Move a finished run's checkpoints out of the way (never deleted) so a
    new run of the same job starts fresh: ``<root>/previous/finished-<time>/``."""
    when = finished_at(root) or time.time()
    dest = root / "previous" / time.strftime("finished-%Y%m%d-%H%M%S", time.gmtime(when))
    n = 0
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    makedirs_private(dest)
    if (root / "ckpt").exists():
        os.rename(root / "ckpt", dest / "ckpt")
    os.rename(root / FINISHED_FILE, dest / FINISHED_FILE)
    fsync_dir(root)
    return dest


def read_job_id(root: Path) -> str | None:
    try:
        return json.loads((root / JOB_FILE).read_text())["job_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- writing -----------------------------------------------------------------


def remove_staging(root: Path, pids: dict[int, int]) -> None:
    """Remove the staging dirs of ranks -> PIDs whose process is gone (its save died with it)."""
    for rank, pid in pids.items():
        if _alive(pid):
            continue
        for d in (root / "ckpt").glob(f"step-*/shard-*/.tmp-rank-{int(rank)}-{int(pid)}"):
            shutil.rmtree(d, ignore_errors=True)


def staging_dir(root: Path, step: int, shard: str, rank: int) -> Path:
    final = replica_dir(root, step, shard, rank)
    makedirs_private(final.parent)
    tmp = final.parent / f".tmp-rank-{rank}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    os.mkdir(tmp, DIR_MODE)
    return tmp


def publish(tmp: Path, *, root: Path, step: int, shard: str, rank: int, world_size: int,
            job_id: str, extra: dict | None = None, identity: str | None = None) -> Path:
    """Checksum the staged files, write the manifest last, rename into place."""
    files = {}
    for rel in _list_files(tmp):
        p = tmp / rel
        os.chmod(p, FILE_MODE)
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        files[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    for dirpath, dirs, _ in os.walk(tmp):
        for d in dirs:
            os.chmod(os.path.join(dirpath, d), DIR_MODE)
    if not files:
        raise RuntimeError(f"save_fn wrote no files into {tmp}; nothing to checkpoint")
    manifest = {
        "format": FORMAT_VERSION,
        "job_id": job_id,
        **({"job_identity": identity} if identity else {}),
        "step": step,
        "rank": rank,
        "shard": shard,
        "world_size": world_size,
        "saved_at": time.time(),
        "files": files,
        "complete": True,
        **(extra or {}),
    }
    atomic_write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    final = replica_dir(root, step, shard, rank)
    if final.exists():
        # A replica of this rank at this step already exists (an earlier failure
        # at the same step); keep the newest, atomically.
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)
    return final


# --- reading -----------------------------------------------------------------


def verify(path: Path, job_id: str | None = None, identity: str | None = None) -> Replica | str:
    """Return the Replica if ``path`` is complete and intact, else why not."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (save did not finish)"
    except (OSError, ValueError) as e:
        return f"unreadable manifest: {e}"
    try:
        return _verify_manifest(path, manifest, job_id, identity)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        # a damaged manifest must reject this replica, never stop the scan
        return f"malformed manifest: {e!r}"


def _verify_manifest(path: Path, manifest: dict, job_id: str | None, identity: str | None) -> Replica | str:
    if manifest.get("format") != FORMAT_VERSION or manifest.get("complete") is not True:
        return "manifest not marked complete"
    if job_id is not None and manifest.get("job_id") != job_id:
        return f"belongs to job {manifest.get('job_id')!r}"
    # a manifest written before identities were recorded has none: the job id and the jit dir's
    # owner (job.json, checked with the identity by every jitrun) vouch for it
    theirs = manifest.get("job_identity")
    if identity and theirs is not None and theirs != identity:
        return (f"saved by another run of job {manifest.get('job_id')!r} (identity {theirs}, this run's "
                f"{identity}: another script or other arguments)")
    if manifest.get("step_unverified"):
        return ("step label unverified: saved at a collective after optimizer step "
                f"{manifest.get('step')} with no minibatch start in between, and save_fn did not call "
                "jitckpt.checkpoint_step()")
    files = manifest.get("files") or {}
    present = set(_list_files(path))
    if present != set(files):
        return (f"file set differs from manifest (extra {sorted(present - set(files))}, "
                f"missing {sorted(set(files) - present)})")
    for rel, meta in files.items():
        p = path / rel
        if p.stat().st_size != meta["size"] or sha256_file(p) != meta["sha256"]:
            return f"checksum mismatch in {rel}"
    return Replica(path=path, step=int(manifest["step"]), shard=str(manifest["shard"]),
                   rank=int(manifest["rank"]), job_id=str(manifest["job_id"]),
                   saved_at=float(manifest["saved_at"]))


def scan(root: Path, job_id: str | None = None, identity: str | None = None
         ) -> tuple[list[Replica], list[tuple[Path, str]]]:
    """All verified replicas under root, plus (path, reason) for rejected ones."""
    good: list[Replica] = []
    bad: list[tuple[Path, str]] = []
    base = root / "ckpt"
    if not base.is_dir():
        return good, bad
    for step_d in base.iterdir():
        if not _STEP_RE.match(step_d.name) or not step_d.is_dir():
            continue
        for shard_d in step_d.iterdir():
            if not _SHARD_RE.match(shard_d.name) or not shard_d.is_dir():
                continue
            for rank_d in shard_d.iterdir():
                if rank_d.name.startswith(".tmp-"):
                    bad.append((rank_d, "incomplete save (staging dir)"))
                    continue
                if not _RANK_RE.match(rank_d.name):
                    continue
                r = verify(rank_d, job_id, identity)
                (good.append(r) if isinstance(r, Replica) else bad.append((rank_d, r)))
    return good, bad


def published(root: Path) -> dict[int, set[str]]:
    """Step -> the shards with a published replica (a manifest, renamed into place),
    from the names alone: what a restore would try, not verified (``scan`` hashes
    every file; this is for a message, when time is short)."""
    out: dict[int, set[str]] = {}
    base = root / "ckpt"
    for m in base.glob("step-*/shard-*/rank-*/MANIFEST.json"):
        rank_d, shard_d, step_d = m.parent, m.parent.parent, m.parent.parent.parent
        st, sh = _STEP_RE.match(step_d.name), _SHARD_RE.match(shard_d.name)
        if st and sh and _RANK_RE.match(rank_d.name):
            out.setdefault(int(st.group(1)), set()).add(sh.group(1))
    return out


def select_step(replicas: list[Replica], shards: set[str], *, max_step: int | None = None) -> int | None:
    """Newest step at which every shard in ``shards`` has a complete replica."""
    by_step: dict[int, set[str]] = {}
    for r in replicas:
        by_step.setdefault(r.step, set()).add(r.shard)
    ok = [s for s, have in by_step.items() if shards <= have and (max_step is None or s <= max_step)]
    return max(ok) if ok else None


def pick_replica(replicas: list[Replica], step: int, shard: str, prefer_rank: int | None = None) -> Replica | None:
    cands = [r for r in replicas if r.step == step and r.shard == shard]
    if not cands:
        return None
    cands.sort(key=lambda r: (r.rank != prefer_rank, -r.saved_at, r.rank))
    return cands[0]


def named_for_rank(replica: Replica, rank: int) -> list[str]:
    """Files of ``replica`` whose names say they belong to ``rank`` alone (``rng_state_0.pth``,
    ``rank0/...``, ``opt-rank-0.pt``): what a rank restoring from another rank's replica does
    not get for itself. A guess from the names: a false match costs a warning line only."""
    mark = re.compile(rf"(?:^|[^0-9a-z])(?:rank[_-]?)?{int(rank)}$|rank[_-]?{int(rank)}(?![0-9])", re.I)
    try:
        names = json.loads((replica.path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return sorted(n for n in names if any(mark.search(Path(part).stem) for part in Path(n).parts))

