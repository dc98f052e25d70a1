"""Erasure-coded in-memory snapshots on peer nodes: the worker's side (where the
chunks live and the node inventory are ``ec_files``; the memory cap ``ec_memory``).

Every ``JITCKPT_EC_EVERY`` minibatches, at the start of a minibatch (the runtime's ``Event.SNAPSHOT``, called where the
state is consistent), the registered save_fn writes into a private tmpfs staging directory; a background thread
packs it (``ec_pack.pack_dir``), encodes it with ``ec.Codec(k, m)`` and places the k + m chunks of this rank's
stripe on distinct nodes' ``/dev/shm/jitckpt-<job>/ec/`` over a gloo group of its own (``ec_group``), so a chunk
outlives the worker processes and any m node losses leave every stripe decodable.

A version (= the step) becomes current only when every chunk of every rank is in place: each rank writes a
commit record on its node after an all-gather of "placed" flags on the EC group, and only after a second
all-gather ("committed everywhere") the older version is dropped, so at most two versions exist and the newest
committed one is decodable whatever moment a failure strikes.

Never blocks or fails training: the main thread only runs save_fn (as a JIT save would) and enqueues; all ranks
enqueue one item per due step (a skipped one as ``None``) so the background threads stay in lockstep, and a
version any rank could not stage is dropped by all; an error in the EC path is logged and disables it for this
process (the job keeps training, the last committed version stays).

Memory (``--jit-ec-max-mem``, ``JITCKPT_EC_MAX_MEM`` as jitrun resolved it on each node): the first all-gather
of every version carries each rank's stripe size and its node's cap, so every rank computes the same
``node_needs`` (``VERSIONS_HELD`` x the chunks a node holds + its ranks' staging) and, if any node is over its
cap, all disable EC snapshots together before anything is placed, with one ``ec_disabled`` event (rank 0) and
a stderr line naming the numbers and the flag (``over_cap_message``). Checked at every version from the first.
When the job ends the agent removes ``job_root`` (``launcher/ec_clean.py``; also ``jitrun clean``).

This module imports no torch at import time.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from ..listeners import Event
from ..wire import contract, layout
from . import files as ec_files
from . import memory as ec_memory
from . import pack as ec_pack
from .schedule import Schedule

if TYPE_CHECKING:
    from ..runtime import Runtime



def log(msg: str) -> None:
    print(f"[jitckpt] {msg}", file=sys.stderr, flush=True)


def enabled(env=os.environ) -> bool:
    """jitrun was given --jit-ec-every N > 0 (the agent and its workers share the variable)."""
    try:
        return contract.EC_EVERY.get(env) > 0
    except ValueError:
        return False


def parse_code(text: str | None) -> tuple[int, int] | None:
    """``"K+M"`` -> (k, m); ``""``/``"auto"`` -> None (fit to the node count). ValueError with the fix."""
    if text is None or text.strip() in ("", "auto"):
        return None
    m = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"EC code {text!r}: expected K+M, e.g. 2+1 (K data chunks, M parity chunks)")
    k, mm = int(m.group(1)), int(m.group(2))
    if k < 1 or k + mm > 255:
        raise ValueError(f"EC code {text!r}: need K >= 1 and K + M <= 255")
    return k, mm


# -- the EC process group (worker side) ------------------------------------------------------------------

_group_lock = threading.Lock()
_group: Group | None = None
_generation = 0  # groups let go so far (release_group): part of the next group's store prefix
_snapshotter: Snapshotter | None = None  # this process's, for release_group


class Group:
    """A gloo ProcessGroup of its own (not the user's default group), built from the agent's store, with
    the node topology and the small collectives the EC path needs (on the raw group: it is not registered
    with torch.distributed, so the ``dist.*`` functions do not take it)."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.node = int(os.environ.get("GROUP_RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        attempt = contract.attempt()
        job = ec_pack.job_key(contract.JOB_ID.get() or "job")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        # the attempt in the prefix: the agent's store outlives a round, this group does not
        prefix = dist.PrefixStore(f"jitckpt-ec/{job}/{attempt}/{_generation}", store)
        self.pg = dist.ProcessGroupGloo(prefix, self.rank, self.world, timedelta(seconds=timeout_s))
        self._store = store  # keep the client alive as long as the group
        topo = self.allgather_ints([self.node, self.local_rank])
        self.node_of = [t[0] for t in topo]
        self.nodes = sorted(set(self.node_of))
        self.ranks_on: dict[int, list[int]] = {n: sorted(r for r in range(self.world) if self.node_of[r] == n)
                                               for n in self.nodes}

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        import torch

        t = torch.tensor(values, dtype=torch.int64)
        outs = [torch.empty_like(t) for _ in range(self.world)]
        self.pg.allgather([outs], [t]).wait()
        return [o.tolist() for o in outs]

    def all_ok(self, ok: bool) -> bool:
        return all(v[0] for v in self.allgather_ints([int(bool(ok))]))

    def allgather_json(self, obj) -> list:
        """JSON, never pickle: what peers send is data."""
        import torch

        raw = json.dumps(obj).encode()
        n = max(v[0] for v in self.allgather_ints([len(raw)]))
        t = torch.zeros(n, dtype=torch.uint8)
        if raw:
            t[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        outs = [torch.empty_like(t) for _ in range(self.world)]
        self.pg.allgather([outs], [t]).wait()
        return [json.loads(bytes(o.numpy()).rstrip(b"\0").decode()) for o in outs]

    def leader(self) -> bool:
        """The lowest rank of this node: the one that deletes on the node's behalf."""
        return self.ranks_on[self.node][0] == self.rank


def ec_group(timeout_s: float) -> Group:
    """The process's EC group, built on first use (a collective: every rank must get here)."""
    global _group
    with _group_lock:
        if _group is None:
            _group = Group(timeout_s)
        return _group


def release_group(idle_timeout_s: float = 30.0) -> None:
    """Let the EC group go, and with it its gloo sockets and store client: a CRIU dump cannot
    carry inet sockets, and the moved rank's peers rebuild with it (migrate_worker.teardown).
    Every rank calls it at the same minibatch start, once the version in flight, if any, is
    done; the next snapshot builds a new group under a new store prefix."""
    global _group, _generation
    snap = _snapshotter
    if snap is not None and not snap.wait_idle(idle_timeout_s):
        log(f"rank {snap.rank}: an EC snapshot still runs after {idle_timeout_s:g} s; its group is let go anyway")
    with _group_lock:
        _group = None
        _generation += 1


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def group_timeout() -> float:
    return contract.ec_op_timeout_s(contract.TIMEOUT.get())


# -- snapshots (worker side) -----------------------------------------------------------------------------


class Snapshotter:
    """Takes the snapshots of one worker process (see the module docstring)."""

    def __init__(self, rt: Runtime, every: int, code: tuple[int, int] | None, adaptive: bool = False) -> None:
        self.rt = rt
        self.every = every
        self.schedule = Schedule(every, adaptive)
        self.code = code
        self.job = rt.cfg.job_id or "job"
        self.rank = rt.cfg.rank
        self.last_step = -1
        self.disabled = False
        self.busy = threading.Event()  # the thread is working on a staged snapshot
        self.committed: int | None = None  # newest version this process saw committed (tests, logs)
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="jitckpt-ec", daemon=True)
        self._started = False
        self.cap, self.cap_how = _cap_from_env()
        self.over_cap: dict | None = None  # why snapshots were disabled for the memory cap (tests, logs)
        # cost accounting (scripts/bench_ec.py --overhead): main-thread stall per staged snapshot, CPU time of
        # the background thread per version; printed at exit by rank 0 when JITCKPT_EC_STATS is set
        self.stall_s: list[float] = []
        self.stall_cpu_s: list[float] = []
        self.bg_cpu_s: list[float] = []
        global _snapshotter
        _snapshotter = self

    # main thread -----------------------------------------------------------------

    def on_snapshot(self, post_step: bool = False) -> None:
        """At a minibatch start (runtime): every ``every`` steps, save_fn into staging and enqueue.

        ``post_step``: called at a collective after an optimizer step, which may be a barrier after the
        training loop rather than a minibatch start; as for a JIT save there (runtime._jit_save), the
        snapshot is only kept if save_fn labelled its state with jitckpt.checkpoint_step()."""
        rt = self.rt
        step = rt.steps_done
        if self.disabled or step <= self.last_step or step == 0:
            return
        if rt.save_fn is None or rt.deferred is not None or rt.saving:
            return  # a JIT save is coming (it wins) or nothing to save: every rank sees the same
        try:
            item = self.schedule.due(step, group_timeout)
        except TimeoutError as e:  # the EC thread is stuck in a version: it times out and disables EC too
            self.disabled = True
            log(f"rank {self.rank}: EC snapshots disabled at step {step}: {e}")
            return
        if item is None:
            return
        proposal = self.schedule.propose(self._cost(), rt.minibatch_s())
        self.last_step = step
        if not self._started:
            self._started = True
            self._thread.start()
        if self.busy.is_set() or not self._q.empty():
            # the previous snapshot is still on its way: this step's is dropped by every rank (the
            # "staged" all-gather), training never waits for the EC path
            self._q.put((step, None, item, proposal))
            return
        stage = ec_files.job_root(self.job) / "stage" / f"r{self.rank}.s{step}"
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            old = os.umask(0o077)
            try:
                ec_files.private_root(self.job)
                if stage.exists():
                    shutil.rmtree(stage)
                layout.makedirs_private(stage)
                read, rt.step_read = rt.step_read, False
                rt.save_fn(str(stage))
                labelled, rt.step_read = rt.step_read, read  # a JIT save keeps its own record
            finally:
                os.umask(old)
            if post_step and not labelled:
                raise RuntimeError("taken at a collective after an optimizer step and save_fn did not call "
                                   "jitckpt.checkpoint_step(), so its step label cannot be trusted")
        except Exception as e:  # never fail training
            log(f"rank {self.rank}: EC snapshot at step {step} skipped ({type(e).__name__}: {e})")
            shutil.rmtree(stage, ignore_errors=True)
            self._q.put((step, None, item, proposal))
            return
        self.busy.set()
        self.stall_s.append(time.perf_counter() - t0)
        self.stall_cpu_s.append(time.thread_time() - c0)
        self._q.put((step, stage, item, proposal))
        rt.injector.maybe_fire("snapshot", step)  # tests: a signal while the version is on its way

    def _cost(self) -> float | None:
        """One snapshot's cost on this rank, from the last ones: the stall plus the background CPU
        (the first version also built the EC group: left out once there are others)."""
        if not self.stall_s:
            return None
        return self.stall_s[-1] + (_median((self.bg_cpu_s[1:] or self.bg_cpu_s)[-5:]) or 0.0)

    def wait_idle(self, timeout_s: float) -> bool:
        """Until every version handed to the thread is done (False: not within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self._q.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def drain(self, timeout_s: float = 30.0) -> None:
        """At process exit: let the snapshot in flight finish (all ranks end after the same steps)."""
        if self._started and not self.disabled:
            self._q.put(None)
            self._thread.join(timeout_s)
        if contract.EC_STATS.get() and self.rank == 0:
            print("[jitckpt] EC stats: " + json.dumps(self.stats()), file=sys.stderr, flush=True)

    def stats(self) -> dict:
        """What the snapshots cost this process so far (seconds) and what came of them."""
        med = _median
        return {"rank": self.rank, "every": self.every, "interval": self.schedule.interval,
                "adaptive": self.schedule.adaptive, "staged": len(self.stall_s), "versions": len(self.bg_cpu_s),
                "committed": self.committed, "disabled": self.disabled, "stall_s_median": med(self.stall_s),
                "stall_s_total": sum(self.stall_s), "stall_cpu_s_median": med(self.stall_cpu_s),
                # the first version also sets up the EC gloo group: left out of the median when there are others
                "bg_cpu_s_median": med(self.bg_cpu_s[1:] or self.bg_cpu_s),
                "bg_cpu_s_total": sum(self.bg_cpu_s)}

    # background thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            step, stage, n, proposal = item
            c0 = time.thread_time()
            try:
                if not self.disabled:
                    self._version(step, stage, n, proposal)
                    if stage is not None:
                        self.bg_cpu_s.append(time.thread_time() - c0)
            except Exception as e:  # a peer gone, a timeout: the job is failing or EC is broken here
                self.disabled = True
                log(f"rank {self.rank}: EC snapshots disabled after an error at step {step} "
                    f"({type(e).__name__}: {e}); training goes on, the last committed version stays")
            finally:
                self.schedule.release(n)  # (agreed already unless the version failed before its all-gather)
                if stage is not None:
                    shutil.rmtree(stage, ignore_errors=True)
                    self.busy.clear()
                self._q.task_done()

    def _version(self, step: int, stage: Path | None, item: int, proposal: int) -> None:
        from . import codec as _ec

        g = ec_group(group_timeout())
        code = self.code or ec_pack.default_code(len(g.nodes))
        k, m = code
        buf = None
        if stage is not None:
            try:
                buf, _man = ec_pack.pack_dir(stage, align=k)
            except Exception as e:
                log(f"rank {self.rank}: EC snapshot at step {step}: pack failed ({e}); skipped")
        d = ec_files.ec_dir(self.job)
        try:
            ec_files.private_root(self.job)
        except layout.CheckpointDirError as e:  # every rank then skips this version (the "staged" all-gather)
            log(f"rank {self.rank}: EC snapshot at step {step}: {e}; skipped")
            buf = None
        if buf is not None and self.committed is None and g.leader():
            # Partial versions of an earlier attempt: never mixed with ours. Before the all-gather
            # below, which no rank of this node passes before its leader: a rank past it may
            # already be writing this version's (still uncommitted) chunks here.
            layout.makedirs_private(d)
            ec_files.drop_uncommitted(self.job, d)
        # [staged, stripe size, this node's cap, proposed interval]: the memory check below and the
        # schedule (ec/schedule.py) need no collective of their own
        sizes = g.allgather_ints([int(buf is not None), len(buf) if buf is not None else 0, self.cap, proposal])
        self.schedule.agree(item, [s[3] for s in sizes])
        if not all(s[0] for s in sizes):
            if self.rank == 0:
                log(f"EC snapshot at step {step} skipped by every rank: rank(s) "
                    f"{[r for r, s in enumerate(sizes) if not s[0]]} had none (busy or failed)")
            return
        assert buf is not None
        codec = _ec.Codec(k, m)
        tolerate = ec_pack.max_node_losses(len(g.nodes), k, m) if len(g.nodes) > 1 else 0
        plan = self._plan(g, k, m, tolerate)
        if self._over_cap(g, step, sizes, plan, codec):
            return
        layout.makedirs_private(d)
        chunks = codec.encode(buf)
        ok = self._place(g, step, k, m, codec, sizes, chunks, plan, d)
        if not g.all_ok(ok):
            log(f"rank {self.rank}: EC snapshot at step {step} not committed: a chunk could not be placed")
            return
        shards = g.allgather_json(self.rt.shard)
        rec = {"job": ec_pack.job_key(self.job), "step": step, "attempt": self.rt.cfg.attempt, "k": k, "m": m,
               "world_size": g.world, "nodes": len(g.nodes), "tolerate": tolerate, "t": time.time(),
               "stripes": {str(r): {"size": sizes[r][1], "csize": codec.chunk_size(sizes[r][1]),
                                    "shard": shards[r]} for r in range(g.world)}}
        layout.atomic_write_bytes(d / ec_files.commit_name(self.job, step, self.rank), json.dumps(rec).encode())
        if not g.all_ok(True):  # every node holds the record before anything older goes
            return
        self.committed = step
        if g.leader():
            ec_files.drop_other_versions(self.job, d, keep=step)

    def _over_cap(self, g: Group, step: int, sizes, plan, codec) -> bool:
        """--jit-ec-max-mem: does every node's share (two versions of its chunks + its staging) fit under
        its cap? Every rank computes the same from the all-gathered sizes and caps, so all disable together
        (the older committed version, if any, stays). One event (rank 0) and one stderr line per node over."""
        needs = ec_memory.node_needs(g.node_of, [s[1] for s in sizes], plan, codec.chunk_size)
        over = []
        for n, need in needs.items():
            cap = min(sizes[r][2] for r in need["ranks"])
            if need["need_bytes"] > cap:
                over.append((n, need, cap))
        if not over:
            return False
        self.disabled = True
        n, need, cap = max(over, key=lambda o: o[1]["need_bytes"] - o[2])
        self.over_cap = {"node": n, "need_bytes": need["need_bytes"], "cap_bytes": cap, "step": step}
        mine = next((o for o in over if o[0] == g.node), None)
        if self.rank == 0 or (mine is not None and g.leader()):
            nn, nneed, ncap = mine or (n, need, cap)
            how = self.cap_how if nn == g.node else "that node's --jit-ec-max-mem"
            log("ERROR: " + ec_memory.over_cap_message(step, nn, nneed, ncap, how)
                + (f" ({len(over)} node(s) over their caps)" if len(over) > 1 else ""))
        if self.rank == 0:
            self.rt.report("ec_disabled", reason="memory_cap", step=step, ec_node=n, ec_nodes_over=[o[0] for o in over],
                           need_bytes=need["need_bytes"], cap_bytes=cap, versions=ec_files.VERSIONS_HELD,
                           chunks=need["chunks"], chunk_bytes=need["chunk_bytes"], staged_bytes=need["staged_bytes"],
                           flag="--jit-ec-max-mem",
                           message=ec_memory.over_cap_message(step, n, need, cap,
                                                    self.cap_how if n == g.node else "--jit-ec-max-mem"))
        return True

    @staticmethod
    def _plan(g: Group, k: int, m: int, tolerate: int) -> list[tuple[int, int, int]]:
        """(owner rank, chunk index, rank that writes it): chunk i of rank r's stripe goes to the node
        ``placement`` names; on the owner's own node the owner writes it, elsewhere a rank of that node
        chosen round-robin so that receiving is spread over the node's ranks."""
        plan = []
        for r in range(g.world):
            nodes = ec_pack.placement(g.nodes, k, m, tolerate=tolerate, offset=g.nodes.index(g.node_of[r]))
            for i, n in enumerate(nodes):
                ranks = g.ranks_on[n]
                plan.append((r, i, r if n == g.node_of[r] else ranks[(r + i) % len(ranks)]))
        return plan

    def _place(self, g: Group, step: int, k: int, m: int, codec, sizes, chunks, plan, d: Path) -> bool:
        import torch

        me = self.rank
        recvs = []
        for r, i, dst in plan:
            if dst == me and r != me:
                t = torch.empty(codec.chunk_size(sizes[r][1]), dtype=torch.uint8)
                recvs.append((r, i, t, g.pg.recv([t], r, i)))
        sends = []
        for r, i, dst in plan:
            if r == me and dst != me:
                t = torch.frombuffer(chunks[i], dtype=torch.uint8)  # never empty: a pack has a header
                sends.append((t, g.pg.send([t], dst, i)))
        ok = True

        def write(r: int, i: int, payload) -> bool:
            try:
                tag = ec_pack.ChunkTag(self.job, step, r, 0, i, k, m, sizes[r][1])
                ec_pack.write_chunk(d, tag, payload)
                return True
            except Exception as e:  # /dev/shm full: this version is not committed
                log(f"rank {me}: EC chunk {i} of rank {r} at step {step} not written: {e}")
                return False

        for r, i, dst in plan:
            if r == me and dst == me:
                ok = write(r, i, chunks[i]) and ok
        for r, i, t, w in recvs:
            w.wait()
            ok = write(r, i, t.numpy()) and ok
        for _t, w in sends:
            w.wait()
        return ok


def _cap_from_env() -> tuple[int, str]:
    """This node's cap as jitrun resolved it (JITCKPT_EC_MAX_MEM); outside jitrun, the default."""
    raw = contract.EC_MAX_MEM.get()
    if raw:
        try:
            return int(raw), contract.EC_MAX_MEM_HOW.get() or f"{contract.EC_MAX_MEM.name}={raw}"
        except ValueError:
            log(f"{contract.EC_MAX_MEM.name}={raw!r} is not a number of bytes; using the default cap")
    try:
        return ec_memory.resolve_max_mem(None)
    except ValueError:
        return 1 << 62, "no cap (MemAvailable unknown)"


_snapshotter: Snapshotter | None = None


def install(rt: Runtime) -> Snapshotter | None:
    """Attach snapshots to the runtime when jitrun asked for them (JITCKPT_EC_EVERY > 0); else nothing."""
    global _snapshotter
    try:
        every = contract.EC_EVERY.get()
        code = parse_code(contract.EC_CODE.get())
    except ValueError as e:
        log(f"EC snapshots off: {e}")
        return None
    if every <= 0 or not rt.cfg.managed or not os.environ.get("MASTER_ADDR"):
        return None
    import atexit

    snap = Snapshotter(rt, every, code, adaptive=contract.EC_ADAPTIVE.get())
    rt.listeners.add(Event.SNAPSHOT, snap.on_snapshot)
    atexit.register(snap.drain)
    _snapshotter = snap
    return snap
