"""Worker side of CRIU process migration: pause, teardown, rebuild.

At a step boundary (no collective in flight, parameters consistent) a rank
that is to be migrated, and every peer of it, does:

1. :func:`teardown`: destroy every process group and drop *every* reference to
   it and to its store, so gloo's TCP pairs, its listening socket, its epoll
   device thread and its run-loop threads are really gone, and the TCPStore
   client connections are closed. What is left is checked (:func:`inventory`):
   a process that still holds an inet socket cannot be restored on a node
   without that address, so teardown reports it.
2. :func:`wait_resume`: poll (no fd kept open) for ``resume-<gen>.json`` in the
   rank's control dir. The migrated rank is dumped and restored meanwhile;
   after the restore the control dir is the *target* node's (the process is
   restored into the restoring agent's mount namespace), and the agent there
   writes the file. Peers get the same file from their own agents.
3. :func:`rebuild`: apply the resume file's environment (e.g. the new node's
   ``GLOO_SOCKET_IFNAME``), connect a new TCPStore client and build the default
   group under a fresh store prefix (``<prefix>``: a new rendezvous, no stale
   keys of the old group).

What breaks when this is not done (measured, torch 2.13 gloo, CRIU 4.1.1):

* ``destroy_process_group()`` alone leaves the gloo backend alive while any
  reference to it exists (jitckpt's ``_bootstrap._kept`` keeps one on purpose,
  a user's DDP reducer another): 3 threads, an epoll fd, a listening socket
  bound to the node's address and established pairs to the peers. CRIU dumps
  them with ``--tcp-established``, but a restore on another node fails (the
  address does not exist there) and the peers have closed their ends anyway.
  Dropping the last reference joins the threads; :func:`teardown` does it after
  every work item has finished (no run-loop thread is then releasing a work
  item that needs the GIL, the deadlock ``_bootstrap`` avoids by keeping
  groups).
* the store clients (the group's, jitckpt's Reporter) are sockets too: closed
  here, reconnected by :func:`rebuild` / the caller.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from .sealed_store import Space, space
from .wire import auth, contract

RESUME = "resume-{gen}.json"
PAUSED = "paused-{gen}.json"


def inventory() -> dict:
    """What this process holds that matters for a dump: sockets (by kind), pipes,
    files under /dev/shm, thread count. Read from /proc by hand: psutil lists inet
    sockets and regular files, not pipes, unix sockets or anon inodes."""
    inet = set()
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            for line in Path(f"/proc/self/net/{proto}").read_text().splitlines()[1:]:
                parts = line.split()
                if len(parts) > 9:
                    inet.add(parts[9])
        except OSError:
            pass
    sockets, inet_fds, pipes, shm, other = [], [], [], [], []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            ino = target[8:-1]
            (inet_fds if ino in inet else sockets).append(int(fd))
        elif target.startswith("pipe:"):
            pipes.append(int(fd))
        elif target.startswith("/dev/shm/"):
            shm.append(target)
        elif target.startswith("anon_inode:"):
            other.append(target)
    return {"threads": len(os.listdir("/proc/self/task")), "inet_socket_fds": sorted(inet_fds),
            "other_socket_fds": sorted(sockets), "pipe_fds": sorted(pipes), "shm_files": sorted(shm),
            "anon_inodes": sorted(other)}


def teardown(extra_stores: list | None = None, wait_sockets: bool = True) -> dict:
    """Destroy every process group and release it and its store for real; return
    :func:`inventory` after it. ``extra_stores``: a list whose store objects the
    caller also wants closed (cleared in place). ``wait_sockets``: wait (up to 1 s)
    until the process holds no inet socket; a rank that is not dumped keeps its store
    connection, so for it the wait would always last the full second, and the job's
    pause with it (the moved rank rebuilds its group only with every peer)."""
    import torch.distributed as dist

    _detach_ddp()
    if dist.is_initialized():
        dist.destroy_process_group()
    # jitckpt._bootstrap keeps destroyed groups referenced until os._exit (a
    # destructor deadlock with in-flight work items); at a step boundary every work
    # item has finished, so they are let go, including groups the script destroyed
    # earlier.
    import torch.distributed.distributed_c10d as c10d

    getattr(c10d.destroy_process_group, "__jitckpt_kept__", []).clear()
    ec = sys.modules.get(f"{__package__}.ec.snapshot")  # EC snapshots keep a gloo group of their own
    if ec is not None:
        ec.release_group()
    if extra_stores is not None:
        extra_stores.clear()
    # The backend's destructor joins its threads when the last reference goes. A
    # reference cycle may still hold it (a full collection costs ~0.1-0.2 s with torch
    # loaded, so only then), and the kernel may need a moment to close the ends.
    inv = inventory()
    deadline = time.monotonic() + 1.0
    collected = False
    while wait_sockets and inv["inet_socket_fds"] and time.monotonic() < deadline:
        if not collected:
            gc.collect()
            collected = True
        else:
            time.sleep(0.01)
        inv = inventory()
    return inv


_ddp_detached: list = []  # weak references to DDP modules whose reducer teardown dropped
_ddp_known: list = []  # weak references to every DDP module built (jitckpt.hooks: track_ddp)


def track_ddp(module) -> None:
    """Called from DDP's constructor (jitckpt.hooks): a teardown then finds the modules
    without scanning the heap (0.3-0.5 s with torch loaded, measured)."""
    import weakref

    _ddp_known.append(weakref.ref(module))


def _detach_ddp() -> None:
    """A DDP module's reducer (and its logger) hold the process group: drop them so the
    group really goes (and group objects baked into functions' default arguments);
    :func:`_attach_ddp` builds them again on the new default group (what DDP's own
    ``__setstate__`` does). The modules are the ones :func:`track_ddp` saw; without
    jitckpt's hooks (a script driving this module itself) the heap is scanned once."""
    import sys
    import types
    import weakref

    from .torch_compat.worker import detach_ddp

    try:
        from torch.distributed import ProcessGroup
        from torch.nn.parallel import DistributedDataParallel as DDP
    except ImportError:  # pragma: no cover
        return
    mods = [m for m in (r() for r in _ddp_known) if m is not None]
    if not _ddp_known:
        mods = [o for o in gc.get_objects() if _is(o, DDP)]
    for o in mods:
        if getattr(o, "reducer", None) is None:
            continue
        detach_ddp(o)
        _ddp_detached.append(weakref.ref(o))
    # module-level functions only: where a default argument is evaluated at import
    for mod in list(sys.modules.values()):
        for fn in list(getattr(mod, "__dict__", {}).values()):
            if type(fn) is types.FunctionType:
                _drop_group_defaults(fn, ProcessGroup)


def _is(o, cls: type) -> bool:
    import warnings

    with warnings.catch_warnings():  # isinstance() on torch's deprecated reduce_op proxy warns
        warnings.simplefilter("ignore")
        try:
            return isinstance(o, cls)
        except ReferenceError:
            return False


def _drop_group_defaults(fn, group_type: type) -> None:
    """A default argument evaluated while a group existed keeps it alive for good:
    ``torch.distributed.nn.functional`` has ``group=group.WORLD`` on every function, so
    importing it after ``init_process_group`` (measured: it is, in a plain torchrun
    worker) pins the default group, its gloo sockets and its store client. None means
    "the default group" to every collective, so it is what they get instead."""
    d = fn.__defaults__
    if d and any(isinstance(v, group_type) for v in d):
        fn.__defaults__ = tuple(None if isinstance(v, group_type) else v for v in d)
    kw = fn.__kwdefaults__
    if kw and any(isinstance(v, group_type) for v in kw.values()):
        fn.__kwdefaults__ = {k: None if isinstance(v, group_type) else v for k, v in kw.items()}


def _attach_ddp() -> int:
    """Rebuild the reducer of every DDP module :func:`_detach_ddp` detached, on the
    (new) default group. Its buckets start in parameter order again and are rebuilt
    after the first minibatch, as at the job's start: with 2 ranks the sums are the
    same bit for bit; with more, gloo's ring may add an element's shares in another
    order while the buckets differ from the unmigrated run's (not checked here)."""
    from .torch_compat.worker import attach_ddp

    n = 0
    for ref in _ddp_detached:
        ddp = ref()
        if ddp is None:
            continue
        attach_ddp(ddp)
        n += 1
    _ddp_detached.clear()
    return n


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def wait_resume(ctl_dir: str | os.PathLike, gen: int, timeout: float | None = None, poll_s: float = 0.02) -> dict:
    """Block until ``<ctl_dir>/resume-<gen>.json`` exists; return its content.
    Polls by path, holding no fd between polls (a dump may land at any time)."""
    path = Path(ctl_dir) / RESUME.format(gen=gen)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            pass
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no {path} within {timeout:g}s")
        time.sleep(poll_s)


def rebuild(resume: dict, rank: int, world_size: int, timeout_s: float = 60.0):
    """Apply ``resume['env']``, connect to ``resume['store']`` ([host, port]) and
    init the default gloo group under store prefix ``resume['prefix']``. Returns
    the TCPStore client (the caller keeps it only as long as it needs it)."""
    import torch.distributed as dist

    for k, v in (resume.get("env") or {}).items():
        os.environ[k] = str(v)
    host, port = resume["store"]
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    dist.init_process_group(resume.get("backend", "gloo"), store=dist.PrefixStore(resume["prefix"], store),
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    _attach_ddp()
    return store


def _pdeathsig(sig: int | None) -> int:
    """Set this process's parent-death signal (None: 0, off); return the previous one."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    old = ctypes.c_int(0)
    libc.prctl(2, ctypes.byref(old), 0, 0, 0)  # PR_GET_PDEATHSIG
    libc.prctl(1, sig or 0, 0, 0, 0)  # PR_SET_PDEATHSIG
    return old.value


def pause(ctl_dir: str | os.PathLike, gen: int, rank: int, world_size: int, *, step: int,
          extra_stores: list | None = None, timeout: float | None = None,
          stop: Callable[[], str | None] | None = None):
    """teardown, announce ``paused-<gen>.json`` (with the inventory), wait for
    ``resume-<gen>.json`` (MigrationFailed when it says ``failed``, ``stop()`` gives a
    reason or ``timeout`` passes), rebuild. Returns (resume dict, new store client)."""
    t0 = time.monotonic()
    inv = teardown(extra_stores)
    # jitrun's wrapper made the worker die with it (PR_SET_PDEATHSIG); CRIU restores that,
    # and the restored task's parent is criu itself until it exits: the signal would kill
    # it right after a restore. Off across the dump, on again under its new parent.
    pdeath = _pdeathsig(None)
    write_json(Path(ctl_dir) / PAUSED.format(gen=gen), {"pid": os.getpid(), "rank": rank, "step": step,
                                                        "teardown_s": round(time.monotonic() - t0, 4), **inv})
    try:
        resume = _wait_resume_file(Path(ctl_dir), gen, timeout, stop)
    finally:
        _pdeathsig(pdeath)
    t0 = time.monotonic()
    store = rebuild(resume, rank, world_size)
    write_json(Path(ctl_dir) / f"rebuilt-{gen}.json", {"rebuild_s": round(time.monotonic() - t0, 4)})
    return resume, store


# -- store-driven migration (jitrun migrate; protocol in jitrun.migration.control) -------------------


def records(token: str) -> Space:
    """The job-wide records of ``jitrun migrate`` (labels ``migrate/...``; the protocol is
    listed in jitrun.migration.control)."""
    return space(token, "migrate")


def _ranks(rec: dict) -> str | None:
    return None if auth.int_list(rec["ranks"]) and all(r >= 0 for r in rec["ranks"]) else "ranks"


REQUEST = auth.Schema({"ranks": list, "to": str, "t": (int, float)}, nested=_ranks)
RESUME_RECORD = auth.Schema({"gen": int, "prefix": str, "store": list},
                     nested=lambda r: None if len(r["store"]) == 2 and isinstance(r["store"][0], str)
                     and auth.is_a(r["store"][1], int) else "store")


def read_request(store, token: str, gen: int) -> dict | None:
    return records(token).get(store, f"migration request {gen}", gen, "req", schema=REQUEST)


class Watch:
    """At every minibatch start: one ``add(gen, 0)`` on the job's store (~0.1 ms).

    Every rank must pause at the *same* minibatch start: a rank whose poll at the
    start of step s came just before the request would run step s's collectives
    against peers that paused at s and tore their groups down. So the first rank to
    see a request fixes the pause step, s+1, with one ``compare_set`` (first writer
    wins) and every rank pauses at the start of that step. That step has not begun
    anywhere: a data-parallel rank reaches the start of s+1 only after every rank
    joined step s's all-reduce, hence after it had polled at the start of s. A rank
    without per-step collectives that sees the request later than that pauses at
    once: with nothing in flight between ranks, no peer can be stranded."""

    def __init__(self, store, token: str) -> None:
        self.store = store
        self.token = token
        self.seen = records(token).count(store, 0, "gen")
        self.pending: tuple[int, dict, int] | None = None

    def poll(self, step: int) -> tuple[int, dict] | None:
        """The request to pause for at the start of minibatch ``step``, or None."""
        if self.pending is None:
            n = records(self.token).count(self.store, 0, "gen")
            if n <= self.seen:
                return None
            self.seen = n
            deadline = time.monotonic() + 10
            while not self.store.check([records(self.token).key(n, "req")]):  # the requester is between add and set
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.005)
            req = read_request(self.store, self.token, n)
            if req is None:
                return None  # not a request of the job: ignored (one line)
            won = records(self.token).claim(self.store, f"pause step of migration {n}", step + 1, n, "at")
            if not auth.is_a(won, int):
                return None
            self.pending = (n, req, won)
        n, req, at = self.pending
        if step < at:
            return None
        self.pending = None
        return n, req


class MigrationFailed(RuntimeError):
    """The migration this rank paused for will not happen (its agent said why, or the
    rank was asked to stop meanwhile): the caller takes the JIT save and exits, so the
    job restarts from this minibatch start with nothing lost."""


def moving_ranks(req: dict) -> list[int]:
    """The ranks a request moves: ``{"ranks": [...]}`` (a whole node), or ``{"rank": R}``."""
    return [int(r) for r in req["ranks"]]


def _wait_store_resume(store, token: str, gen: int, timeout: float | None,
                       stop: Callable[[], str | None] | None) -> dict:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        why = records(token).get(store, f"failure of migration {gen}", gen, "failed")
        if isinstance(why, str):
            raise MigrationFailed(f"migration {gen} failed: {why}")
        res = records(token).get(store, f"resume of migration {gen}", gen, "resume", schema=RESUME_RECORD)
        if res is not None:
            return res
        why = stop() if stop is not None else None
        if why:
            raise MigrationFailed(f"migration {gen} abandoned: {why}")
        if deadline is not None and time.monotonic() > deadline:
            raise MigrationFailed(f"migration {gen}: no resume within {timeout:g}s")
        time.sleep(0.02)


def at_minibatch_start(watch: Watch, rank: int, world_size: int, ctl_root: str | os.PathLike, *, step: int,
                       stores: list, timeout: float | None = 300.0,
                       before_close: Callable[[int, dict], None] | None = None,
                       stop: Callable[[], str | None] | None = None):
    """Called at a minibatch start. Without a request: None. With one: every rank tears
    its group down and announces it. A moving rank first calls ``before_close(gen,
    req)`` (its last word on the store, e.g. a report to its agent), then closes every
    store client in ``stores`` (the watch's included), announces ``paused-<g>.json`` in
    its control dir, waits there for ``resume-<g>.json`` (it is dumped and restored
    meanwhile; a resume file with ``failed`` raises MigrationFailed) and reconnects; a
    peer keeps its store client and waits for the ``resume`` key (or ``failed``:
    MigrationFailed). ``stop()``: a reason to give up waiting (e.g. a SIGTERM), or
    None. Returns (gen, request, new store client or None, new Watch)."""
    got = watch.poll(step)
    if got is None:
        return None
    gen, req = got
    token = watch.token
    if rank in moving_ranks(req):
        if before_close is not None:
            before_close(gen, req)
        records(token).put(watch.store, {"step": step}, gen, "paused", rank)
        watch.store = None  # the caller's Watch must not keep the connection open across the dump
        ctl = Path(ctl_root) / f"rank{rank}"
        ctl.mkdir(parents=True, exist_ok=True)
        _, store = pause(ctl, gen, rank, world_size, step=step, extra_stores=stores, timeout=timeout, stop=stop)
        return gen, req, store, Watch(store, token)
    inv = teardown(wait_sockets=False)  # not dumped: its sockets stay, by design
    records(token).put(watch.store, {"step": step, **inv}, gen, "paused", rank)
    res = _wait_store_resume(watch.store, token, gen, timeout, stop)
    rebuild(res, rank, world_size)
    return gen, req, None, watch


def _wait_resume_file(ctl: Path, gen: int, timeout: float | None, stop: Callable[[], str | None] | None) -> dict:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            res = wait_resume(ctl, gen, timeout=0.5)
        except TimeoutError:
            why = stop() if stop is not None else None
            if why:
                raise MigrationFailed(f"migration {gen} abandoned: {why}") from None
            if deadline is not None and time.monotonic() > deadline:
                raise MigrationFailed(f"migration {gen}: no resume within {timeout:g}s") from None
            continue
        if res.get("failed"):
            raise MigrationFailed(f"migration {gen} failed: {res['failed']}")
        return res


def migration_point(rt: Any) -> bool:
    """jitrun migrate (launcher/migration/control.py): at a minibatch start nothing is in flight,
    so the process groups can go, the moving ranks be dumped and restored elsewhere
    and every rank rebuild. A migration that fails leaves the groups (and DDP's
    reducers) torn down: True, and a deferred save that the caller must take at once,
    before anything that needs a group (DDP's buffer broadcast, a replica check, the
    user's collective) runs, so the restart loses nothing."""
    from .wire.report import for_worker

    def before_close(gen: int, req: dict) -> None:
        rt.report("migrating", gen=gen, step=rt.steps_done, to=req.get("to"), pid=os.getpid(),
                  ctl=str(_migration_ctl(rt)))
        stores.append(rt.reporter._store)
        rt.reporter = None  # its connection must not survive into the dump

    stores: list = []
    try:
        got = at_minibatch_start(rt._migration, rt.cfg.rank, rt.cfg.world_size, _migration_ctl(rt),
                                 step=rt.steps_done, stores=stores, before_close=before_close,
                                 stop=lambda: rt.deferred)
    except MigrationFailed as e:
        if rt.reporter is None:
            rt.reporter = for_worker(rt.cfg)
        with rt._lock:
            if rt.deferred is None:
                rt.deferred = f"migration failed: {e}"
        rt.report("failure_detected", reason="migration_failed", phase=rt.phase.value,
                  step=rt.steps_done, error=str(e), minibatch_s=rt.minibatch_s())
        return True
    if got is None:
        return False
    gen, req, store, watch = got
    rt._migration = watch
    if store is not None:  # this rank moved: its new store client
        rt.reporter = for_worker(rt.cfg, store)
    digest = rt.verifier.after_migration(gen) if rt.verifier is not None else None
    rt.report("migrated" if store is not None else "migration_resumed", gen=gen, step=rt.steps_done,
              pid=os.getpid(), node=contract.NODE.get() or None, fingerprint=digest)
    return False


def _migration_ctl(rt: Any) -> Path:
    return Path(rt.cfg.root or ".") / "migrate" / "ctl"
