"""Restore from an erasure-coded snapshot, inside ``get_checkpoint_path``.

When the job's decision chose an EC version (the ``RestorePlan``'s ``ec_step``), every restarted rank,
before ``get_checkpoint_path`` returns:

1. lists the chunks of that step in its node's ``/dev/shm`` and all-gathers the lists (and commit records)
   over the EC gloo group (node numbering may have changed since the snapshot: chunks are found by content);
2. receives every surviving chunk of its own stripe from a rank of a node that holds it (sent as the whole
   chunk file, header included) and reads its node's own directly; ``read_chunk`` checks the job, the tag
   and the payload checksum, a bad chunk counts as lost (all survivors are fetched, so up to m bad or lost
   chunks are tolerated without a second round);
3. decodes (``Codec``), then ``ec_pack.unpack`` checks every file's sha256 before writing, and the files are
   published as an ordinary replica directory with MANIFEST.json (``layout.publish``, marked ``source: ec``),
   so the normal path of ``get_checkpoint_path`` verifies and returns it;
4. all-gathers success: if any rank failed, every rank falls back to the plan's ``step`` (the
   persistent step the decision prepared, or a fresh start), loudly, so no rank trains on other state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..wire import contract, layout
from . import files as ec_files
from . import pack as ec_pack
from . import snapshot as ec_snapshot
from .snapshot import log

if TYPE_CHECKING:
    from ..runtime import Runtime


def restore(rt: Runtime, plan: contract.RestorePlan) -> contract.RestorePlan:
    """Decode the plan's EC step into this rank's jit dir, agreed job-wide: the plan with
    that step on success, else with its fallback (a replica step, or a fresh start).
    Collective over the ranks; the caller runs it once per process."""
    cfg = rt.cfg
    assert plan.ec_step is not None
    step = plan.ec_step
    fallback = "none" if plan.step is None else str(plan.step)
    ok, why = False, ""
    try:
        g = ec_snapshot.ec_group(ec_snapshot.group_timeout())
    except Exception as e:
        g, why = None, f"EC group: {type(e).__name__}: {e}"
    if g is not None:
        try:
            ok, why = _fetch_decode(rt, g, step)
        except Exception as e:  # a peer's failure surfaces here too: still answer the all-gather
            ok, why = False, f"{type(e).__name__}: {e}"
        try:
            everyone = g.all_ok(ok)
        except Exception as e:
            everyone, why = False, why or f"agreement failed: {e}"
    else:
        everyone = False
    if everyone:
        log(f"rank {cfg.rank}: restored step {step} from the EC snapshot in peers' memory")
        rt.report("ec_restored", step=step)
        return plan.decoded()
    log(f"rank {cfg.rank}: WARNING: EC snapshot of step {step} could not be restored job-wide "
        f"({why or 'another rank failed'}); falling back to "
        f"{'a FRESH START' if fallback == 'none' else 'step ' + fallback}")
    rt.report("ec_restore_failed", step=step, error=why[:300], fallback=fallback)
    return plan.fallback()


def _fetch_decode(rt: Runtime, g: ec_snapshot.Group, step: int) -> tuple[bool, str]:
    """Bring this rank's stripe of EC ``step`` here (chunks on this node read from /dev/shm, the rest
    received from the rank that serves them), decode it and publish it as a replica checkpoint."""
    job = rt.cfg.job_id or "job"
    inv = ec_files.scan_node(job)
    commit = next((c for c in inv["commits"] if int(c["step"]) == step), None)
    invs = g.allgather_json({"node": g.node, "chunks": [c for c in inv["chunks"] if c[0] == step], "commit": commit})
    rec = commit or next((i["commit"] for i in invs if i["commit"]), None)
    recvs, local = _exchange(g, job, step, invs)
    why = _unusable(rec, step, g, rt.shard)
    if why is not None:
        for _i, _t, w in recvs:
            w.wait()
        return False, why
    assert rec is not None
    k, m, size = int(rec["k"]), int(rec["m"]), int(rec["stripes"][str(g.rank)]["size"])
    got = _valid_chunks(job, g.rank, dict(step=step, rank=g.rank, stripe=0, k=k, m=m, size=size), local, recvs)
    if len(got) < k:
        return False, f"{len(got)} valid chunk(s) of rank {g.rank}'s stripe survive, {k} needed"
    from . import codec as _ec

    _publish(rt, step, _ec.Codec(k, m).decode(dict(sorted(got.items())[:k]), size))
    return True, ""


def _exchange(g: ec_snapshot.Group, job: str, step: int, invs: list[dict]) -> tuple[list, list[int]]:
    """Send the chunks this rank serves, post receives for the ones it lacks; every rank computes the same
    plan (the server of (stripe rank, index) is the lowest rank of a node that lists it). Returns the
    pending receives (index, tensor, work) and the indices to read from this node."""
    import torch

    d = ec_files.ec_dir(job)
    server: dict[tuple[int, int], tuple[int, int]] = {}  # -> (rank, file size)
    for r, i in enumerate(invs):
        for _s, owner, stripe, index, fsize in i["chunks"]:
            if stripe == 0 and (owner, index) not in server:
                server[(owner, index)] = (r, fsize)
    me = g.rank
    recvs, sends, local = [], [], []
    for (owner, index), (srv, fsize) in sorted(server.items()):
        if owner >= g.world:
            continue
        if g.node_of[srv] == g.node_of[owner]:
            if owner == me:
                local.append(index)  # on this node: read it from /dev/shm
            continue
        if owner == me:
            t = torch.empty(fsize, dtype=torch.uint8)
            recvs.append((index, t, g.pg.recv([t], srv, index)))
        elif srv == me:
            name = ec_pack.chunk_name(ec_pack.ChunkTag(job, step, owner, 0, index, 1, 0, 0))
            raw = bytearray((d / name).read_bytes())
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            sends.append((t, g.pg.send([t], owner, index)))
    for _t, w in sends:
        w.wait()
    return recvs, local


def _unusable(rec: dict | None, step: int, g: ec_snapshot.Group, shard: str) -> str | None:
    """Why the commit record of ``step`` cannot restore this rank, or None."""
    if rec is None:
        return f"no commit record of EC step {step} on any node"
    stripe = rec["stripes"].get(str(g.rank))
    if stripe is None or int(rec["world_size"]) != g.world:
        return f"EC step {step} was taken with {rec['world_size']} ranks, not {g.world}"
    if str(stripe.get("shard")) != shard:
        return f"EC stripe of rank {g.rank} holds shard {stripe.get('shard')!r}, this rank has {shard!r}"
    return None


def _valid_chunks(job: str, me: int, expect: dict, local: list[int], recvs: list) -> dict[int, bytearray]:
    """Chunk index -> payload of every chunk that passes its header and CRC checks; the rest are lost."""
    d = ec_files.ec_dir(job)
    got: dict[int, bytearray] = {}
    bad: list[str] = []
    for index in local:
        name = ec_pack.chunk_name(ec_pack.ChunkTag(job, expect["step"], me, 0, index, expect["k"], expect["m"],
                                                   expect["size"]))
        try:
            _tag, payload = ec_pack.read_chunk(d / name, job, index=index, **expect)
            got[index] = payload
        except (OSError, ec_pack.ChunkError) as e:
            bad.append(str(e))
    try:
        stage = ec_files.private_root(job) / "stage"
        layout.makedirs_private(stage)
    except layout.CheckpointDirError:  # not ours (scan_node found nothing there): a private temp dir
        stage = Path(tempfile.mkdtemp(prefix="jitckpt-ec-stage-", dir=ec_files.shm_base()))
    for index, t, w in recvs:
        w.wait()
        fd, tmp = tempfile.mkstemp(prefix=f".r{me}.c{index}.", suffix=".chunk", dir=stage)  # 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(t.numpy().tobytes())
            _tag, payload = ec_pack.read_chunk(tmp, job, index=index, **expect)
            got[index] = payload
        except (OSError, ec_pack.ChunkError) as e:
            bad.append(str(e))
        finally:
            Path(tmp).unlink(missing_ok=True)
    for b in bad:
        log(f"rank {me}: EC chunk rejected, counted as lost: {b}")
    return got


def _publish(rt: Runtime, step: int, buf) -> None:
    """The decoded stripe as this rank's replica checkpoint of ``step`` (every sha256 checked first)."""
    cfg = rt.cfg
    old = os.umask(0o077)
    try:
        tmpdir = layout.staging_dir(cfg.root, step, rt.shard, cfg.rank)
        try:
            ec_pack.unpack(buf, tmpdir)
            layout.publish(tmpdir, root=cfg.root, step=step, shard=rt.shard, rank=cfg.rank,
                           world_size=cfg.world_size, job_id=cfg.job_id, identity=cfg.identity or None,
                           extra={"progress_step": step, "point": "minibatch-start", "source": "ec"})
        except BaseException:
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
    finally:
        os.umask(old)
