"""Agents' side of ``jitrun migrate``: the source dumps and ships, the target
restores and watches.

The path of one migration ``g`` of rank R from node A to node B (protocol keys in
:mod:`jitrun.migration.control`):

1. R (and every peer) sees the request at its next minibatch start; R reports
   ``migrating`` to its agent, closes its store clients, tears its group down and
   announces ``paused-<g>.json`` in ``<jit dir>/migrate/ctl/rank<R>/``. Peers tear
   down and wait for the ``resume`` key.
2. A's agent (:func:`migrate_out`, its main thread, from the monitor loop) waits for
   that file, marks R as moved (so R's wrapper exiting is not a failure), dumps R
   with CRIU (``--jit-dir`` tmpfs, images checksummed), and ships the images plus
   the files R holds open that live on A's private disk (its output file, at the
   size of the dump) to B over a direct stream to B's agent (:mod:`jitrun.peers.stream`,
   checked under the job token; the store carries only the announcement and B's port).
3. B's agent (:class:`Target`, a thread with its own store connection) writes the
   files at the same paths, restores R under ``python -m jitrun.migration.criu restore``
   (a child subreaper that forwards stop signals), writes R's resume file with B's
   environment and says ``restored``.
4. A sets the ``resume`` key once every moving rank of ``g`` is restored: every
   rank rebuilds its group under a fresh store prefix and trains on. No minibatch
   is redone; R's script is not re-run.

From then on A counts R as running as long as B's helper runs and takes R's exit
code from B (``exit`` key); A's stop signals reach R through B (``signal`` key).

Failure of the migration itself (CRIU killed or failing, an image corrupted, the
target absent or not restoring) sets ``failed``: the peers take the JIT save at
that minibatch start and exit; R takes it too when it still runs (the dump did not
happen), and jitrun's restart path restores the job from those replicas. Nothing is
lost and every step is an event (``migration_*``) with seconds and sizes.

Threads: :func:`migrate_out` runs on the agent's main thread and uses only the
coordination-store connection it is given; each :class:`Target` has its own
connection for its request loop and one more per restored worker (the
``_watch_restored`` thread: exit code out, signals in). Nothing here is shared
between threads but the events log (thread-safe).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from jitckpt import migrate_worker
from jitckpt.sealed_store import Requests, Space, StoreRecordError, space
from jitckpt.wire import auth, contract, layout

from ..events import EventLog
from ..migration import device_loss
from ..peers import peer_files, stream, transfer
from . import control as migrate
from . import criu

PAUSED_TIMEOUT_S = 60.0


def restore_timeout_s() -> float:
    return contract.MIGRATE_TIMEOUT.get()


class MigrationError(RuntimeError):
    def __init__(self, stage: str, why: str) -> None:
        super().__init__(f"{stage}: {why}")
        self.stage = stage
        self.why = why


def mig(token: str) -> Space:
    """The agents' records of ``jitrun migrate`` (labels ``mig/...``)."""
    return space(token, "mig")


def requests_to(token: str, node: str) -> Requests:
    """The migration requests to the :class:`Target` of ``node``."""
    return Requests(mig(token), "to", node)


PORT = auth.Schema({"port": int})
ANSWER = auth.Schema({"ok": bool}, {"why": str, "pid": int, "restore_s": (int, float), "recv_s": (int, float),
                                    "node": str})
OUTPUT = "output"  # the name the worker's output file travels under
_TID = re.compile(r"^[0-9a-f]{32}$")
_IMAGE = re.compile(r"^img/[A-Za-z0-9_.-]+$")
REQUEST = auth.Schema(
    {"id": str, "rank": int, "files": list, "manifest_sha256": str, "output": (str, type(None))},
    {"gen": int, "resume": dict, "ctl": str, "device": dict})
DEVICE = auth.Schema({"dir": str, "epoch": int, "uuid": str})


def _request_problem(req: Any) -> str | None:
    """Why ``req`` is no migration request (its id names files and keys: 32 hex digits)."""
    why = REQUEST.problem(req)
    if why is None and not _TID.match(req["id"]):
        why = f"id {req['id']!r:.40}"
    return why


# -- source -------------------------------------------------------------------------------


def migrate_out(*, coord_store, worker_store, token: str, root: Path, gen: int, req: dict, rank: int,
                pid: int, ctl: Path, output: str | None, store_addr: tuple[str, int], attempt: int,
                events: EventLog) -> dict:
    """Move local rank ``rank`` (its namespace init is host PID ``pid``) for migration
    ``gen``. Returns ``{"id", "to", ...timings}`` when it runs on the target;
    raises MigrationError (after telling R and its peers) otherwise."""
    to = str(req["to"])
    t0 = time.monotonic()
    stage = "pause"
    images = root / "migrate" / "img" / f"g{gen}-rank{rank}"
    dumped = False
    try:
        paused = _wait_paused(ctl / f"rank{rank}" / f"paused-{gen}.json", pid)
        if paused.get("inet_socket_fds"):
            raise MigrationError(stage, f"rank {rank} still holds inet sockets after teardown "
                                        f"(fds {paused['inet_socket_fds']}); a restore elsewhere would fail")
        stage = "dump"
        shutil.rmtree(images, ignore_errors=True)
        d = criu.dump_with_test_faults(pid, images)
        dumped = True
        # (verified where it is restored: a check here, right after the manifest was
        # computed from these very files, would only add a read of every page)
        t_dump = time.monotonic()
        events.emit("migration_dumped", gen=gen, rank=rank, to=to, image_bytes=d.image_bytes,
                    dump_s=round(d.seconds, 4), teardown_s=paused.get("teardown_s"), step=paused.get("step"))
        stage = "transfer"
        resume = {"gen": gen, "prefix": prefix(token, attempt, gen), "store": list(store_addr)}
        shipped = ship(coord_store, token, images, output, to,
                       {"gen": gen, "rank": rank, "resume": resume, "ctl": str(ctl)})
        stage = "restore"
        tid, sent, t_sent, got = shipped.tid, shipped.sent, shipped.t_sent, shipped.got
        if got is None:
            raise MigrationError(stage, f"node {to} did not restore rank {rank} within {restore_timeout_s():.0f}s "
                                        "(no jitrun agent with --jit-migratable on there, or it is gone)")
        if not got.get("ok"):
            raise MigrationError(stage, f"node {to}: {got.get('why')}")
    except Exception as e:  # whatever broke, the job must fall back, not lose its agent
        why = e.why if isinstance(e, MigrationError) else f"{type(e).__name__}: {e}"
        fail(worker_store, token, gen, rank, ctl, f"{stage} failed: {why}")
        events.emit("migration_failed", gen=gen, rank=rank, to=to, stage=stage, error=why, dumped=dumped,
                    seconds=round(time.monotonic() - t0, 3))
        raise MigrationError(stage, why) from None
    finally:
        shutil.rmtree(images, ignore_errors=True)  # restored or useless: either way not kept in memory
    done = {"id": tid, "to": to, "dump_s": round(d.seconds, 4), "transfer_s": round(t_sent - t_dump, 4),
            "restore_s": got.get("restore_s"), "image_bytes": d.image_bytes, "sent_bytes": sent,
            "pid": got.get("pid"), "pause_s": round(time.monotonic() - t0, 4)}
    events.emit("migration_restored", gen=gen, rank=rank, **done)
    return done


@dataclass
class Shipped:
    tid: str
    sent: int  # bytes
    t_sent: float  # monotonic: the last byte left
    got: dict | None  # the target's answer ({"ok", "pid", "restore_s", ...} or {"ok": False, "why"}); None: none came


def ship(coord_store, token: str, images: Path, output: str | None, to: str, body: dict) -> Shipped:
    """Send a dumped worker's ``images`` (plus its ``output`` file, held open on this
    node's private disk) to the :class:`Target` of node ``to`` with request ``body``
    (``rank``; ``resume`` and ``ctl`` for a jitrun migrate, ``device`` for a lost
    device) and wait for its answer. Raises MigrationError when no target listens."""
    tid = uuid.uuid4().hex
    files = [(f"img/{p.name}", p) for p in sorted(images.iterdir()) if p.is_file()]
    if not (output and Path(output).is_file()):
        output = None
    if output:
        files.append((OUTPUT, Path(output)))
    # the target is an agent of this job: it sealed its port under the job token
    got = mig(token).get(coord_store, f"listening port of node {to}", "to", to, "port", schema=PORT)
    if got is None:
        raise MigrationError("transfer", f"no jitrun agent of this job with --jit-migratable on listens on node {to}")
    requests_to(token, to).send(coord_store, {"id": tid, "files": [[rel, p.stat().st_size] for rel, p in files],
                                              "output": output, "manifest_sha256": criu_manifest_sha(images), **body})
    sent = stream.send_stream(to, got["port"], token, tid, files, timeout_s=restore_timeout_s())
    t_sent = time.monotonic()
    return Shipped(tid, sent, t_sent, _wait_answer(coord_store, token, tid, restore_timeout_s()))


def criu_manifest_sha(images: Path) -> str:
    return hashlib.sha256((images / criu.MANIFEST).read_bytes()).hexdigest()


def release_peers(worker_store, token: str, gen: int, n_moving: int, n_mine: int, resume: dict) -> bool:
    """This agent's moving ranks of ``gen`` are restored: count them in; the agent that
    completes the count lets every rank rebuild. True if it was this one."""
    if worker_store.add(migrate.key(token, gen, "moved"), n_mine) >= n_moving:
        migrate.resume(worker_store, token, gen, resume["prefix"], tuple(resume["store"]))
        return True
    return False


def prefix(token: str, attempt: int, gen: int) -> str:
    # a fresh key space for the rebuilt groups: no stale keys of the torn-down ones
    return f"jitckpt/attempt_{attempt}/migration_{gen}"


def fail(worker_store, token: str, gen: int, rank: int, ctl: Path, why: str) -> None:
    """Peers (store key) and the rank itself, if its process still runs (resume file)
    take the JIT save at their minibatch start."""
    try:
        migrate.put(worker_store, token, why, gen, "failed")
    except Exception:
        pass
    d = ctl / f"rank{rank}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".resume-{gen}.tmp"
        tmp.write_text(json.dumps({"gen": gen, "failed": why}))
        os.replace(tmp, d / f"resume-{gen}.json")
    except OSError:
        pass


def _wait_paused(path: Path, pid: int) -> dict:
    deadline = time.monotonic() + PAUSED_TIMEOUT_S
    while True:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            pass
        if not psutil.pid_exists(pid):
            raise MigrationError("pause", f"the worker (PID {pid}) ended before it paused")
        if time.monotonic() > deadline:
            raise MigrationError("pause", f"no {path} within {PAUSED_TIMEOUT_S:.0f}s")
        time.sleep(0.01)


def _wait_answer(store, token: str, tid: str, timeout_s: float) -> dict | None:
    """The target's answer to request ``tid``; None when none came (or the store went)."""
    try:
        return mig(token).wait(store, f"answer of migration target for {tid}", tid, "restored", timeout_s=timeout_s,
                               schema=ANSWER)
    except StoreRecordError as e:
        if e.kind == StoreRecordError.TIMEOUT:
            return None
        return {"ok": False, "why": "its answer does not verify under the job token"}


# -- remote workers, seen from the source ----------------------------------------------------


class Remote:
    """A rank that runs on another node after a migration: its exit code and the
    signals sent to it go through the coordination store."""

    def __init__(self, store, token: str, tid: str, to: str) -> None:
        self._store = store
        self._token = token
        self.tid = tid
        self.to = to
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None:
            try:
                code = mig(self._token).get(self._store, f"exit code of migrated worker {self.tid}", self.tid, "exit")
                if auth.is_a(code, int):
                    self._code = code
            except Exception:
                self._code = -int(signal.SIGKILL)  # the job's store is gone: nothing runs there any more
        return self._code

    def wait(self, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._code if self._code is not None else -int(signal.SIGKILL)

    def send(self, sig: int) -> None:
        try:
            # one record per signal, numbered by the counter: a forged bump of the
            # counter finds no record to deliver, an old signal is never sent again
            n = mig(self._token).count(self._store, 1, self.tid, "signals")
            mig(self._token).put(self._store, int(sig), self.tid, "signal", n)
        except Exception:
            pass


# -- target -----------------------------------------------------------------------------


class Target:
    """Restores migrated workers addressed to this node (``--to <its address>``)."""

    def __init__(self, store, token: str, node: str, root: Path, events: EventLog) -> None:
        self._store = transfer.own_connection(store, 30.0)
        # images come straight from the source agent, on this node's job address
        self._listener = stream.listen(node)
        mig(token).put(self._store, {"port": self._listener.getsockname()[1]}, "to", node, "port")
        self._conn_of = store
        self._token = token
        self._node = node
        self._root = root
        self._events = events
        self._stopping = False
        self.helpers: list[subprocess.Popen] = []
        self._thread = threading.Thread(target=self._run, name="jitrun-migration-target", daemon=True)

    def start(self) -> Target:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the request loop and every worker restored here (agent exit)."""
        self._stopping = True
        for h in self.helpers:
            if h.poll() is None:
                h.send_signal(signal.SIGTERM)
        try:
            requests_to(self._token, self._node).stop(self._conn_of)
        except Exception:
            pass
        self._thread.join(5.0)
        self._listener.close()

    def _run(self) -> None:
        requests_to(self._token, self._node).serve(
            self._store, "migration request", problem=_request_problem, handle=self._handle,
            stopping=lambda: self._stopping, on_store_error=self._store_failed)

    def _store_failed(self) -> bool:
        if self._stopping:
            return False
        time.sleep(1.0)  # the store may come back (a rendezvous moving): not a busy retry meanwhile
        return True

    def _handle(self, req: dict) -> None:
        try:
            self._restore(req)
        except Exception as e:  # tell the source instead of leaving it waiting
            self._answer(req["id"], {"ok": False, "why": f"{type(e).__name__}: {e}"})
            self._events.emit("migration_failed", gen=req.get("gen"), rank=req.get("rank"), stage="restore",
                              error=f"{type(e).__name__}: {e}", node=self._node)

    def _answer(self, tid: str, body: dict) -> None:
        try:
            mig(self._token).put(self._store, body, tid, "restored")
        except Exception:
            pass

    def _checked(self, req: dict) -> tuple[list[tuple[str, int]], Path | None]:
        """The request's file list and the output file's path here, or RefusedFile: only
        images (``img/<name>``) and the worker's output file, which lands at the one path
        it can have on this node (``<jit dir>/migrate/out/rank<R>.a<N>.log``, the same
        path as on the source: CRIU reopens it there); the control paths must be this
        node's own."""
        rank = req["rank"]
        files = peer_files.file_list(req["files"], where=self._root)
        names = [rel for rel, _ in files]
        if any(not (_IMAGE.match(rel) or rel == OUTPUT) for rel in names) or f"img/{criu.MANIFEST}" not in names:
            raise peer_files.RefusedFile(f"files {names[:8]}: only img/<name> (with img/{criu.MANIFEST}) and "
                                         f"{OUTPUT!r} are taken")
        out: Path | None = None
        if (OUTPUT in names) != (req["output"] is not None):
            raise peer_files.RefusedFile("the output file and its path come together or not at all")
        if req["output"] is not None:
            mine = self._root / "migrate" / "out"
            m = re.fullmatch(re.escape(str(mine)) + rf"/rank{rank}\.a\d+\.log", req["output"])
            if m is None:
                raise peer_files.RefusedFile(f"output path {req['output']!r:.200} is not rank {rank}'s output file "
                                             f"under this node's {mine} (the jit dir must be the same path on "
                                             "every node that takes migrated workers)")
            out = Path(req["output"])
        if "device" in req:
            if DEVICE.problem(req["device"]) is not None or \
                    req["device"]["dir"] != str(device_loss.control_dir(self._root)):
                raise peer_files.RefusedFile("the device request is not for this node's control directory")
        elif req.get("ctl") != str(self._root / "migrate" / "ctl") or \
                migrate_worker.RESUME_RECORD.problem(req.get("resume")) is not None:
            raise peer_files.RefusedFile("the control directory or resume record is not this job's on this node")
        return files, out

    def _restore(self, req: dict) -> None:
        tid, gen, rank = req["id"], int(req.get("gen", 0)), int(req["rank"])
        files, output = self._checked(req)
        base = self._root / "migrate" / "in" / tid
        stage = base / "recv"
        shutil.rmtree(base, ignore_errors=True)
        layout.makedirs_private(stage)
        t0 = time.monotonic()
        helper = subprocess.Popen(criu.restore_and_wait_command(), stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                                  start_new_session=True)
        try:
            stream.recv_stream(self._listener, self._token, tid, files, stage, restore_timeout_s())
            t_recv = time.monotonic()
            images = stage / "img"
            if hashlib.sha256((images / criu.MANIFEST).read_bytes()).hexdigest() != req["manifest_sha256"]:
                raise peer_files.RefusedFile("the images' manifest is not the one the request names")
            if output is not None:
                # the file the worker holds open, at the same path here; our mode (CRIU
                # checks it: the source creates it with the same one)
                layout.makedirs_private(output.parent)
                os.chmod(stage / OUTPUT, layout.FILE_MODE)
                os.replace(stage / OUTPUT, output)
            if "device" not in req:
                ctl = self._root / "migrate" / "ctl" / f"rank{rank}"
                layout.makedirs_private(ctl)
        except BaseException:
            helper.communicate(b"\n", timeout=30)  # told nothing: it exits without restoring
            shutil.rmtree(base, ignore_errors=True)
            raise
        assert helper.stdin is not None and helper.stdout is not None
        try:
            helper.stdin.write(f"{images}\n".encode())
            helper.stdin.close()
        except OSError:
            pass  # it died starting: its stdout says nothing, handled below
        line = helper.stdout.readline().decode(errors="replace").strip()
        if not line.startswith("RESTORED "):
            helper.wait()
            shutil.rmtree(base, ignore_errors=True)
            why = line[len("FAILED "):] if line.startswith("FAILED ") else f"restore helper exited {helper.returncode}"
            raise RuntimeError(why)
        self.helpers.append(helper)
        _, pid, secs = line.split()
        shutil.rmtree(base, ignore_errors=True)  # CRIU needs the images no more
        self._hand_over(req, rank, gen)
        self._answer(tid, {"ok": True, "pid": int(pid), "restore_s": float(secs),
                           "recv_s": round(t_recv - t0, 4), "node": self._node})
        self._events.emit("migration_arrived", gen=gen, rank=rank, pid=int(pid), restore_s=float(secs),
                          recv_s=round(t_recv - t0, 4), node=self._node)
        self._record_rank(rank, {"pid": int(pid), "node": self._node, "host": socket.gethostname(),
                                 "migrated_in": True})
        threading.Thread(target=self._watch_restored, args=(helper, tid, rank, int(pid)), daemon=True,
                         name=f"jitrun-migrated-rank{rank}").start()

    def _hand_over(self, req: dict, rank: int, gen: int) -> None:
        """Tell the restored process how to go on: a parked process whose device died
        attaches the device named in the request (device_loss.py); a migrated worker
        reads its resume file (the job's store prefix, this node's network settings)."""
        if "device" in req:
            dev = req["device"]
            here = device_loss.control_dir(self._root)
            layout.makedirs_private(here)
            device_loss.answer(here, device_loss.Request(rank, 0, int(dev["epoch"]), "", Path()), str(dev["uuid"]))
            return
        env = {contract.NODE.name: self._node}
        for k in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
            if k in os.environ:
                env[k] = os.environ[k]
        ctl = self._root / "migrate" / "ctl" / f"rank{rank}"
        tmp = ctl / f".resume-{gen}.tmp"
        tmp.write_text(json.dumps({**req["resume"], "env": env}))
        os.replace(tmp, ctl / f"resume-{gen}.json")

    def _record_rank(self, rank: int, entry: dict | None) -> None:
        """Where a migrated-in rank runs now, in this node's ranks.json."""
        try:
            layout.update_ranks(self._root, {rank: entry} if entry else None, drop=() if entry else (rank,))
        except OSError:
            pass  # the jit dir went with the job

    def _watch_restored(self, helper: subprocess.Popen, tid: str, rank: int, pid: int) -> None:
        """Exit code out, stop signals in, until the restored worker ends."""
        store = transfer.own_connection(self._conn_of, 30.0)
        seen = 0
        gap = 0.0
        while True:
            code = helper.poll()
            if code is not None:
                break
            try:
                n = mig(self._token).count(store, 0, tid, "signals")
                while seen < n:
                    key = mig(self._token).key(tid, "signal", seen + 1)
                    if not store.check([key]):
                        # its sender is between add and set: next look; never set (a forged
                        # count) after a while: skipped
                        gap = gap or time.monotonic()
                        if time.monotonic() - gap < 2.0:
                            break
                    gap = 0.0
                    seen += 1
                    if not store.check([key]):
                        continue
                    sig = mig(self._token).open(key, store.get(key), f"signal {seen} to migrated rank {rank}")
                    if sig not in _SIGNALS:
                        continue
                    # the helper forwards catchable signals; SIGKILL would end only the helper
                    if sig == signal.SIGKILL:
                        os.kill(pid, sig)
                    else:
                        helper.send_signal(sig)
            except ProcessLookupError:
                pass  # ended meanwhile: poll() says so next
            except Exception:
                pass  # the store went with the job: the helper dies with this agent (PDEATHSIG)
            try:
                helper.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        self._events.emit("worker_exit", rank=rank, exitcode=code, migrated=True, node=self._node)
        self._record_rank(rank, None)
        try:
            mig(self._token).put(store, code, tid, "exit")
        except Exception:
            pass


_SIGNALS = {int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                             signal.SIGUSR2, signal.SIGCONT, signal.SIGKILL)}
