"""CRIU wrapper for process migration: find, check, dump, verify, restore.

Which binary: ``$JITCKPT_CRIU``, else ``build/criu/criu`` (the link made by
``scripts/build_criu.sh`` / ``make criu``), else the per-machine cache
``$HOME/.cache/jitckpt/criu-4.1.1/criu`` (survives ``make clean``), else
``criu`` on PATH (and /usr/sbin, /sbin).

Migratable workers run as PID 1 of a PID namespace of their own
(:func:`migratable_command`): a restore then recreates that namespace, so it
can never collide with a live PID, and a copy can be restored while the
original (or its zombie, which lingers ~2 s after a dump) still exists. They
keep the parent's mount namespace on purpose: with ``--mount-proc`` the task
sits in a mount namespace of its own, which CRIU would have to dump as well
(it then fails on the first fd it cannot place: "Can't lookup mount=N for
fd=0 path=/dev/null").

Every dump writes ``jitckpt-manifest.json`` (CRC-32C and size of every image
file, written atomically) next to the images; :func:`restore` refuses images
that no longer match it (:func:`verify`). CRC-32C through ISA-L, not sha256: the
checksum guards against corruption on disk and on the wire (the transfer itself is
authenticated by the job's token), and for a 250 MB image sha256 costs ~0.2 s
twice in the migration pause, CRC-32C ~0.01 s. Without ISA-L the manifest says
sha256 and :func:`verify` checks whichever the manifest names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from jitckpt.wire import contract, layout

VERSION = "4.1.1"
MANIFEST = "jitckpt-manifest.json"
DUMP_LOG = "criu-dump.log"
RESTORE_LOG = "criu-restore.log"
# Written by CRIU or by us next to the images but not part of them.
_NOT_IMAGES = {MANIFEST, DUMP_LOG, RESTORE_LOG, "restore.pid", ".manifest.tmp"}
_REPO = Path(__file__).resolve().parent.parent
PROVISION_HINT = "run `make criu` (scripts/build_criu.sh) as root, or set JITCKPT_CRIU=/path/to/criu"


class CriuError(RuntimeError):
    """A CRIU operation failed; the message says what, where and how to fix it."""


class CriuNotFound(CriuError):
    pass


class ImageCorrupt(CriuError):
    pass


def cache_dir() -> Path:
    """Per-machine build cache of scripts/build_criu.sh."""
    env = contract.CRIU_CACHE.get()
    return Path(env) if env else Path.home() / ".cache" / "jitckpt" / f"criu-{VERSION}"


def candidates() -> list[tuple[str, str]]:
    """(where it came from, path) in search order."""
    out: list[tuple[str, str]] = []
    if contract.CRIU.get():
        out.append((f"${contract.CRIU.name}", contract.CRIU.get()))
    out.append(("build/criu/criu", str(_REPO / "build" / "criu" / "criu")))
    out.append(("cache", str(cache_dir() / "criu")))
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = shutil.which("criu", path=path)
    if found:
        out.append(("PATH", found))
    return out


def find_criu() -> str:
    """Path of the criu binary to use; CriuNotFound saying where it looked and what to do."""
    cands = candidates()
    env = contract.CRIU.get()
    if env and not (os.path.isfile(env) and os.access(env, os.X_OK)):
        # An explicit choice that is wrong must not silently fall back to another binary.
        raise CriuNotFound(f"{contract.CRIU.name}={env} is not an executable file; fix or unset it ({PROVISION_HINT})")
    for _, p in cands:
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    looked = ", ".join(p for _, p in cands) + ", criu on PATH"
    raise CriuNotFound(f"criu not found (looked in {looked}); {PROVISION_HINT}")


def _run(cmd: list[str], timeout: float | None) -> subprocess.CompletedProcess:
    # Own session so a timeout kills criu (ours, by PID) without touching its target.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise CriuError(f"{' '.join(cmd[:2])} timed out after {timeout:g}s and was killed; "
                        f"output: {out[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, None)


def version(criu: str | None = None) -> str:
    criu = criu or find_criu()
    cp = _run([criu, "--version"], timeout=10)
    m = re.search(r"Version:\s*(\S+)", cp.stdout)
    return m.group(1) if m else cp.stdout.strip().splitlines()[0] if cp.stdout.strip() else "?"


def check(criu: str | None = None) -> str:
    """Run ``criu check``; return a one-line description, raise CriuError saying why not."""
    criu = criu or find_criu()
    if os.geteuid() != 0:
        raise CriuError(f"{criu}: criu needs root (CAP_SYS_ADMIN) to check, dump or restore; run as root")
    cp = _run([criu, "check"], timeout=60)
    if cp.returncode != 0:
        raise CriuError(f"`{criu} check` failed (exit {cp.returncode}) on kernel {os.uname().release}: "
                        f"{_tail(cp.stdout, 5)}; {PROVISION_HINT} (it builds CRIU {VERSION} with the "
                        "kernel >= 6.16 fix)")
    return f"{criu} (CRIU {version(criu)}), `criu check` passes"


def migratable_command(cmd: Sequence[str], output: str | os.PathLike | None = None) -> list[str]:
    """``cmd`` as PID 1 of its own PID namespace and session leader.

    ``unshare --fork`` keeps unshare as the namespace's parent outside it (its
    exit status is the worker's); :func:`ns_init_pid` finds the worker's host
    PID, the one to dump. Not ``--mount-proc`` (see the module docstring).

    ``output``: a file the worker's stdin/stdout/stderr become (stdin /dev/null,
    the others appended to ``output``), opened inside the namespace so nothing
    else writes to it. Needed for a restore: CRIU restores a regular file only
    when its size is still the one at dump time, and ``unshare`` itself writes
    ("sigprocmask unblock failed") to its stderr when its child is killed by the
    dump; a pipe to a launcher would not survive a move to another node at all.
    On another node the file must be copied with the images (same path)."""
    unshare = shutil.which("unshare", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/bin"]))
    setsid = shutil.which("setsid", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/bin"]))
    if not unshare or not setsid:
        raise CriuError("unshare/setsid not found; install util-linux (apt-get install util-linux)")
    if output is None:
        return [unshare, "--pid", "--fork", setsid, *cmd]
    sh = shutil.which("sh", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/bin"])) or "/bin/sh"
    # sh execs the worker: it is still the namespace's PID 1
    return [unshare, "--pid", "--fork", setsid, sh, "-c", 'exec </dev/null >>"$0" 2>&1; exec "$@"',
            str(output), *cmd]


def _is_ns_init(pid: int) -> bool:
    """Is ``pid`` PID 1 of a PID namespace below its parent's? (psutil does not
    read ``NSpid``.) The wrapper is not always seen with one child only: with the
    CUDA build of torch an earlier child was taken for the worker, and the dump
    of that PID found it gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    ids = line.split()[1:]
                    return len(ids) > 1 and ids[-1] == "1"
    except OSError:
        pass
    return False


def ns_init_pid(outer_pid: int, timeout: float = 10.0) -> int:
    """Host PID of the process that the wrapper (PID ``outer_pid``) started as
    PID 1 of its own PID namespace."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            outer = psutil.Process(outer_pid)
            kids = outer.children()
            # not reaped yet: its parent (the agent, waiting here) cannot before this returns
            done = not kids and outer.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            done = True
        if done:
            raise CriuError(f"unshare (PID {outer_pid}) exited before its worker was seen")
        init = next((k.pid for k in kids if _is_ns_init(k.pid)), None)
        if init is not None:
            return init
        if time.monotonic() > deadline:
            raise CriuError(f"unshare (PID {outer_pid}) started no worker within {timeout:g}s")
        time.sleep(0.01)


@dataclass
class DumpResult:
    images_dir: Path
    seconds: float
    image_bytes: int
    manifest: Path


def _common(tcp_established: bool, network_lock: str, shell_job: bool) -> list[str]:
    args = []
    if tcp_established:
        # No iptables on these machines: the network lock must be nftables.
        args += ["--tcp-established", "--network-lock", network_lock]
    if shell_job:
        args.append("--shell-job")
    return args


def _tail(text: str, n: int = 15) -> str:
    # CRIU cannot raise its own RLIMIT_NOFILE in these containers and logs it as an
    # Error although the dump goes on: leave it out so it is not taken for the cause.
    lines = [ln for ln in text.splitlines() if ln.strip() and "Can't setup RLIMIT_NOFILE" not in ln]
    return "\n".join(lines[-n:])


def _hints(log: str) -> str:
    """What to do about the CRIU failures seen on these machines."""
    hints = []
    if re.search(r"Can't get 1:(16|34) opt", log):
        hints.append("this CRIU lacks the kernel >= 6.16 SO_PASSCRED/SO_PASSSEC fix: " + PROVISION_HINT)
    if "Can't lookup mount" in log:
        hints.append("the task has a mount namespace of its own (unshare --mount-proc?); start it with "
                     "jitrun.migration.criu.migratable_command, which keeps the parent's")
    if "nested pid namespace" in log:
        hints.append("that PID is the parent of a PID namespace (unshare?); dump the namespace's PID 1 "
                     "(jitrun.migration.criu.ns_init_pid)")
    if re.search(r"has bad size|has changed size|Can't open file .* on restore", log):
        hints.append("a file the process had open is missing or changed since the dump; copy it to "
                     "the same path on this node (with the images)")
    if re.search(r"Can't fork for|already (exists|in use)|clone3? .*File exists", log):
        hints.append("a PID the images need is taken; run workers as PID 1 of their own PID namespace "
                     "(launcher.criu.migratable_command)")
    if "nft" in log and re.search(r"(?i)error", log) and "network-lock" in log:
        hints.append("nftables network lock failed: needs nf_tables in the kernel and libnftables")
    if "session leader" in log and "outside" in log:
        hints.append("the task's session leader is outside the dumped tree: start it under setsid "
                     "(launcher.criu.migratable_command does)")
    elif "tty" in log.lower() and "shell-job" not in log:
        hints.append("the task is attached to a terminal/session outside it: use setsid or shell_job=True")
    return ("; what to do: " + "; ".join(hints)) if hints else ""


def _fail(what: str, cp: subprocess.CompletedProcess, log_path: Path) -> CriuError:
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    return CriuError(f"{what} failed (exit {cp.returncode}); {log_path} ends:\n"
                     f"{_tail(log) or _tail(cp.stdout) or '(empty)'}{_hints(log + cp.stdout)}")


def dump(pid: int, images_dir: str | os.PathLike, *, leave_running: bool = False,
         tcp_established: bool = True, network_lock: str = "nftables", shell_job: bool = False,
         extra_args: Sequence[str] = (), criu: str | None = None, timeout: float | None = 300.0
         ) -> DumpResult:
    """``criu dump`` of the tree rooted at ``pid`` into ``images_dir`` (created, must be
    empty), then the checksum manifest. Without ``leave_running`` the tree is killed."""
    criu = criu or find_criu()
    d = Path(images_dir)
    from jitckpt.wire import layout

    layout.makedirs_private(d)  # the images hold the whole memory of the process
    os.chmod(d, 0o700)
    if any(d.iterdir()):
        raise CriuError(f"images dir {d} is not empty; dump into a fresh directory")
    cmd = [criu, "dump", "-t", str(pid), "-D", str(d), "-o", DUMP_LOG,
           *_common(tcp_established, network_lock, shell_job), *extra_args]
    if leave_running:
        cmd.append("--leave-running")
    t0 = time.monotonic()
    cp = _run(cmd, timeout)
    secs = time.monotonic() - t0
    if cp.returncode != 0:
        raise _fail(f"criu dump of PID {pid} ({pid_facts(pid)} when it failed) into {d}", cp, d / DUMP_LOG)
    manifest = write_manifest(d, extra={"pid": pid, "criu": version(criu), "dump_seconds": round(secs, 4)})
    size = sum(f["size"] for f in json.loads(manifest.read_text())["files"].values())
    return DumpResult(d, secs, size, manifest)


def pid_facts(pid: int) -> str:
    """What a process is, for an error that names it: a dump that could not seize its
    target says whether the target was gone or what it was instead."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            kids = [c.pid for c in p.children()]
            return f"{p.name()}, {p.status()}, parent {p.ppid()}, children {kids or 'none'}"
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.Error as e:
        return f"unreadable: {e}"


def _image_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file() and p.name not in _NOT_IMAGES)


def _crc32c_file(path: Path) -> str:
    import mmap

    from jitckpt.ec.codec import crc32c

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return f"{crc32c(b''):08x}"
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
            return f"{crc32c(mm):08x}"


def _checksum_kind() -> str:
    try:
        from jitckpt.ec.codec import crc32c

        crc32c(b"")
        return "crc32c"
    except Exception:  # no ISA-L on this node: still checksummed, only slower
        return "sha256"


_CHECKSUM = {"crc32c": _crc32c_file, "sha256": layout.sha256_file}


def write_manifest(images_dir: str | os.PathLike, extra: dict | None = None) -> Path:
    """Checksum + size of every image file into ``jitckpt-manifest.json``, atomically
    (temp file, fsync, rename): a half-written manifest never passes for a whole one."""
    d = Path(images_dir)
    kind = _checksum_kind()
    files = {p.name: {kind: _CHECKSUM[kind](p), "size": p.stat().st_size} for p in _image_files(d)}
    body = json.dumps({"format": 2, **(extra or {}), "files": files}, indent=1, sort_keys=True)
    tmp = d / ".manifest.tmp"
    with open(tmp, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / MANIFEST)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return d / MANIFEST


def verify(images_dir: str | os.PathLike) -> dict:
    """Check every image file against the manifest; return the manifest or raise
    ImageCorrupt naming each bad file."""
    d = Path(images_dir)
    mpath = d / MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise ImageCorrupt(f"{mpath} missing: not a jitckpt CRIU dump, or the dump did not finish; "
                           "dump again") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ImageCorrupt(f"{mpath} unreadable ({e}); the images cannot be trusted, dump again") from None
    bad = []
    for name, want in sorted(files.items()):
        p = d / name
        kind = next((k for k in _CHECKSUM if k in want), None)
        if not p.is_file():
            bad.append(f"{name}: missing")
        elif p.stat().st_size != want.get("size"):
            bad.append(f"{name}: size {p.stat().st_size}, manifest says {want.get('size')}")
        elif kind is None:
            bad.append(f"{name}: the manifest gives no checksum (crc32c or sha256)")
        elif _CHECKSUM[kind](p) != want[kind]:
            bad.append(f"{name}: {kind} differs from the manifest")
    extra = [p.name for p in _image_files(d) if p.name not in files]
    bad += [f"{n}: not in the manifest" for n in extra]
    if bad:
        raise ImageCorrupt(f"CRIU images in {d} are corrupt, refusing to restore: " + "; ".join(bad[:8])
                           + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else "")
                           + "; copy them again from the source node or dump again")
    if not files:
        raise ImageCorrupt(f"{mpath} lists no image files; dump again")
    return manifest


def restore(images_dir: str | os.PathLike, *, tcp_established: bool = True, network_lock: str = "nftables",
            shell_job: bool = False, verify_first: bool = True, extra_args: Sequence[str] = (),
            criu: str | None = None, timeout: float | None = 300.0, as_child: bool = False) -> int:
    """``criu restore --restore-detached`` of ``images_dir``; return the restored root's
    host PID. Its parent becomes the nearest child subreaper (or init): a caller that
    wants to wait for it sets PR_SET_CHILD_SUBREAPER first. ``as_child``: the root is
    restored as the caller's own child (``--restore-sibling``; the caller reaps it). That
    is the only way a root whose parent-death signal is set survives: restored detached,
    its parent is criu, which exits right after, and the kernel sends the signal then.
    A migratable worker's main thread carries one (its wrapper sets it: the worker dies
    with it), and CRIU dumps it with the process."""
    criu = criu or find_criu()
    d = Path(images_dir)
    if verify_first:
        verify(d)
    (d / RESTORE_LOG).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="jitckpt-restore-") as tmp:
        pidfile = Path(tmp) / "pid"
        cmd = [criu, "restore", "-D", str(d), "-o", RESTORE_LOG, "--restore-detached",
               *(["--restore-sibling"] if as_child else []),
               "--pidfile", str(pidfile), *_common(tcp_established, network_lock, shell_job), *extra_args]
        cp = _run(cmd, timeout)
        if cp.returncode != 0:
            raise _fail(f"criu restore of {d}", cp, d / RESTORE_LOG)
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError) as e:
            raise CriuError(f"criu restore of {d} succeeded but wrote no PID ({e})") from None


# -- jitrun's migratable workers (--jit-migratable on) ---------------------------------

CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
_FORWARD = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT")


def migratable_worker_command(cmd: Sequence[str], output_template: str) -> list[str]:
    """What jitrun runs per rank with ``--jit-migratable on``:
    ``python -m jitrun.migration.criu exec TEMPLATE -- cmd...``.

    Unlike ``unshare --fork`` (which blocks SIGTERM while it waits, so torchrun's
    stop signal never reached the worker and no JIT save ran) the wrapper forwards
    every stop signal to the worker, the namespace's PID 1 (which receives them
    because jitckpt installs handlers), and exits as the worker did.
    ``output_template`` is formatted with the worker's environment
    (``{RANK}``, ``{TORCHELASTIC_RESTART_COUNT}``, ...): the file its output goes to."""
    import sys

    return [sys.executable, "-m", "jitrun.migration.criu", "exec", output_template, "--", *cmd]


def _exec_main(argv: list[str]) -> int:
    """The wrapper of :func:`migratable_worker_command` (``python -m jitrun.migration.criu exec``)."""
    import ctypes
    import signal

    template, sep, *cmd = argv
    if sep != "--" or not cmd:
        raise SystemExit("usage: python -m jitrun.migration.criu exec OUTPUT_TEMPLATE -- CMD...")
    output = template.format_map({**os.environ, "PID": os.getpid()})
    from jitckpt.wire import layout

    layout.makedirs_private(Path(output).parent)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        raise SystemExit(f"unshare(CLONE_NEWPID): {os.strerror(ctypes.get_errno())} (needs root)")
    # blocked until the handlers are in place: a signal between fork and handler is kept
    sigs = [getattr(signal, s) for s in _FORWARD]
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            # the worker dies with its wrapper (an agent's SIGKILL of the wrapper, a timeout's
            # killpg of the wrapper's session): it is in a session of its own, nobody else would
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() == 1:  # the wrapper died before the prctl (parent is the namespace-less init)
                os._exit(137)
            # 0600: a migration target gives the file it receives that mode, and CRIU
            # checks that the reopened file's mode is the dumped one
            fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            os.fchmod(fd, 0o600)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.closerange(3, 1 << 16)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
            os.execvp(cmd[0], cmd)
        finally:
            os._exit(127)
    for s in sigs:
        signal.signal(s, lambda signum, frame: os.kill(pid, signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
    return _wait_as(pid)


def _wait_as(pid: int) -> int:
    """Wait for child ``pid`` and end the way it ended (its signal re-raised)."""
    import signal

    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        except ChildProcessError:
            # dumped by CRIU (killed) and already reaped, or restored elsewhere
            return 0
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # (its handler cannot be set, nor does it need to be)
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.WEXITSTATUS(status)


PR_SET_CHILD_SUBREAPER = 36


def restore_and_wait_command(images_dir: str | os.PathLike | None = None) -> list[str]:
    """How an agent restores a migrated worker: ``python -m jitrun.migration.criu restore IMAGES``
    restores it as this helper's child (the helper is a child subreaper), prints
    ``RESTORED <pid> <seconds>`` (or ``FAILED <why>`` and exits 3), forwards the
    agent's stop signals to it and exits as it did, like the ``exec`` wrapper does for
    a worker started in place. The agent keeps no subreaper role itself: it would
    adopt every orphan of the node and could reap none of them without stealing
    torchrun's exit statuses.

    Without ``images_dir`` the helper starts ahead: it imports what it needs, then
    reads the images dir as one line from its stdin (EOF or an empty line: exit 3
    without restoring). A migration target starts it when a request arrives, so the
    interpreter start (~0.1 s) overlaps the transfer instead of adding to the pause."""
    import sys

    return [sys.executable, "-m", "jitrun.migration.criu", "restore", "-" if images_dir is None else str(images_dir)]


def _restore_main(argv: list[str]) -> int:
    import ctypes
    import signal
    import sys

    (images,) = argv
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # the agent died: stop the worker too
    if images == "-":
        _checksum_kind()  # ISA-L loaded before the wait, not after
        images = sys.stdin.readline().strip()
        if not images:
            print("FAILED no images dir given (the transfer failed)", flush=True)
            return 3
    sigs = [getattr(signal, s) for s in _FORWARD]
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    t0 = time.monotonic()
    try:
        pid = restore(images, as_child=True)
    except CriuError as e:
        print("FAILED " + " ".join(str(e).split()), flush=True)
        return 3
    print(f"RESTORED {pid} {time.monotonic() - t0:.4f}", flush=True)
    sys.stdout.close()
    os.close(1)
    for s in sigs:
        signal.signal(s, lambda signum, frame: os.kill(pid, signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
    return _wait_as(pid)


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "exec":
        raise SystemExit(_exec_main(sys.argv[2:]))
    if len(sys.argv) == 3 and sys.argv[1] == "restore":
        raise SystemExit(_restore_main(sys.argv[2:]))
    raise SystemExit("usage: python -m jitrun.migration.criu exec OUTPUT_TEMPLATE -- CMD... | restore IMAGES_DIR")


# Test hook of the migration paths: break a dump to prove the fallback.


def dump_with_test_faults(pid: int, images: Path, **kw) -> DumpResult:
    """``criu.dump``, broken as ``JITCKPT_TEST_MIGRATE_FAULT`` says (tests prove the
    fallbacks with it): ``kill-criu`` (the dumper dies mid-dump) or ``corrupt-image``
    (one page of the images flipped after a good dump)."""
    fault = contract.TEST_MIGRATE_FAULT.get()
    if fault == "kill-criu":
        # CRIU killed mid-dump: the dumper is SIGKILLed by its own parent shell
        script = _kill_criu_script(images.parent)
        try:
            return dump(pid, images, extra_args=["--action-script", str(script)], **kw)
        finally:
            script.unlink(missing_ok=True)
    d = dump(pid, images, **kw)
    if fault == "corrupt-image":
        victim = max((p for p in images.iterdir() if p.name.startswith("pages-")), key=lambda p: p.stat().st_size)
        with open(victim, "r+b") as fh:
            b = fh.read(1)
            fh.seek(0)
            fh.write(bytes([b[0] ^ 0xFF]))
    return d


def _kill_criu_script(where: Path) -> Path:
    """Test hook: an action script that SIGKILLs the dumping criu at its first action
    (``post-dump``: images written, the tasks still frozen), as an OOM killer would."""
    p = where / "kill-criu.sh"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] && kill -9 $PPID\nexit 0\n')
    p.chmod(0o700)
    return p
