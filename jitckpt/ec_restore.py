"""Restore from an erasure-coded snapshot, inside ``get_checkpoint_path``.

When the job's decision chose an EC version (``JITCKPT_RESTORE_SOURCE=ec``, ``JITCKPT_RESTORE_STEP=<step>``),
every restarted rank, before ``get_checkpoint_path`` returns:

1. lists the chunks of that step in its node's ``/dev/shm`` and all-gathers the lists (and commit records)
   over the EC gloo group (node numbering may have changed since the snapshot: chunks are found by content);
2. receives every surviving chunk of its own stripe from a rank of a node that holds it (sent as the whole
   chunk file, header included) and reads its node's own directly; ``read_chunk`` checks the job, the tag
   and the payload checksum, a bad chunk counts as lost (all survivors are fetched, so up to m bad or lost
   chunks are tolerated without a second round);
3. decodes (``Codec``), then ``ec_pack.unpack`` checks every file's sha256 before writing, and the files are
   published as an ordinary replica directory with MANIFEST.json (``layout.publish``, marked ``source: ec``),
   so the normal path of ``get_checkpoint_path`` verifies and returns it;
4. all-gathers success: if any rank failed, every rank falls back to ``JITCKPT_EC_FALLBACK_STEP`` (the
   persistent step the decision prepared, or a fresh start), loudly, so no rank trains on other state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from . import contract, ec_files, ec_pack, ec_snapshot, layout
from .ec_snapshot import log

if TYPE_CHECKING:
    from .runtime import Runtime


def restore(rt: Runtime) -> bool:
    """Decode the chosen EC step into this rank's jit dir; set JITCKPT_RESTORE_STEP for the normal path
    to the EC step on success, else to the fallback. Runs once per process. True when decoded."""
    source = contract.RESTORE_SOURCE.unset() or ""
    if source != "ec":
        return False
    cfg = rt.cfg
    step = int(contract.RESTORE_STEP.get())
    fallback = contract.EC_FALLBACK_STEP.get()
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
        return True
    contract.RESTORE_STEP.set(fallback)
    log(f"rank {cfg.rank}: WARNING: EC snapshot of step {step} could not be restored job-wide "
        f"({why or 'another rank failed'}); falling back to "
        f"{'a FRESH START' if fallback == 'none' else 'step ' + fallback}")
    rt.report("ec_restore_failed", step=step, error=why[:300], fallback=fallback)
    return False


def _fetch_decode(rt: Runtime, g: ec_snapshot.Group, step: int) -> tuple[bool, str]:
    import torch

    from . import ec as _ec

    cfg = rt.cfg
    job = cfg.job_id or "job"
    d = ec_files.ec_dir(job)
    inv = ec_files.scan_node(job)
    mine = [c for c in inv["chunks"] if c[0] == step]
    commit = next((c for c in inv["commits"] if int(c["step"]) == step), None)
    invs = g.allgather_json({"node": g.node, "chunks": mine, "commit": commit})
    rec = commit or next((i["commit"] for i in invs if i["commit"]), None)
    if rec is None:
        # still take part in the exchange below (with nothing), so peers do not wait on us
        k = m = 0
    else:
        k, m = int(rec["k"]), int(rec["m"])
    # who serves (stripe rank, index): the lowest rank of a node that lists it; every rank computes the same
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
    if rec is None:
        for _i, _t, w in recvs:
            w.wait()
        return False, f"no commit record of EC step {step} on any node"
    stripe = rec["stripes"].get(str(me))
    if stripe is None or int(rec["world_size"]) != g.world:
        for _i, _t, w in recvs:
            w.wait()
        return False, f"EC step {step} was taken with {rec['world_size']} ranks, not {g.world}"
    size = int(stripe["size"])
    if str(stripe.get("shard")) != rt.shard:
        for _i, _t, w in recvs:
            w.wait()
        return False, f"EC stripe of rank {me} holds shard {stripe.get('shard')!r}, this rank has {rt.shard!r}"
    expect = dict(step=step, rank=me, stripe=0, k=k, m=m, size=size)
    got: dict[int, bytearray] = {}
    bad: list[str] = []
    for index in local:
        name = ec_pack.chunk_name(ec_pack.ChunkTag(job, step, me, 0, index, k, m, size))
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
    if len(got) < k:
        return False, f"{len(got)} valid chunk(s) of rank {me}'s stripe survive, {k} needed"
    buf = _ec.Codec(k, m).decode(dict(sorted(got.items())[:k]), size)
    old = os.umask(0o077)
    try:
        tmpdir = layout.staging_dir(cfg.root, step, rt.shard, cfg.rank)
        try:
            ec_pack.unpack(buf, tmpdir)  # every sha256 checked before anything is written
            layout.publish(tmpdir, root=cfg.root, step=step, shard=rt.shard, rank=cfg.rank,
                           world_size=cfg.world_size, job_id=cfg.job_id,
                           extra={"progress_step": step, "point": "minibatch-start", "source": "ec"})
        except BaseException:
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
    finally:
        os.umask(old)
    return True, ""
