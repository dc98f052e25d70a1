"""The per-rank record JitCallback keeps at every minibatch start (jitckpt/integrations/_rank_state.py):
read back after a restart for the step asked, never a torn or foreign one, 0600, grown when needed."""

from __future__ import annotations

import random
import stat

import numpy as np
import torch

from jitckpt.integrations import _rank_state as rs
from jitckpt.resume.data import _portable, _rng_snapshot

SCALARS = {"total_loss_scalar": 1.5, "globalstep_last_logged": 5, "current_flos": 12.0, "tr_loss": 0.25,
           "best": None, "flag": True, "huge": 2**70,
           "stateful": {"TrainerControl": {"args": {"should_log": False}, "attributes": {}}}}


def _snap(seed: int) -> dict:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return _portable(_rng_snapshot())


def _same(a: dict, b: dict) -> None:
    assert torch.equal(a["torch"], b["torch"]) and tuple(a["random"][1]) == tuple(b["random"][1])
    assert a["random"][0] == b["random"][0] and a["random"][2] == b["random"][2]
    assert torch.equal(a["numpy"][1], b["numpy"][1]) and a["numpy"][2:] == b["numpy"][2:]


def test_round_trip_both_slots_and_foreign(tmp_path):
    path = rs.path_for(tmp_path, 1)
    w = rs.Writer(path)
    snaps = {step: _snap(step % 2) for step in (2, 3, 4)}  # random's state back to an earlier one
    for step, snap in snaps.items():
        w.write(job="j", step=step, rng=snap, scalars={**SCALARS, "tr_loss": float(step)})
    for step in (3, 4):  # the newest and the one before (the other slot)
        got = rs.read(path, job="j", step=step)
        assert got is not None and got["scalars"] == {**SCALARS, "tr_loss": float(step)}
        _same(got["rng"], snaps[step])
    assert rs.read(path, job="j", step=2) is None  # overwritten
    assert rs.read(path, job="j", step=5) is None and rs.read(path, job="other", step=4) is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    w.close()
    rs.Writer(path).close()  # a restarted rank opens the file before it reads: nothing lost
    assert rs.read(path, job="j", step=4) is not None


def test_torn_record_is_never_used(tmp_path):
    """A process killed while writing a slot: that slot fails its CRC, the previous record stays."""
    path = rs.path_for(tmp_path, 0)
    w = rs.Writer(path)
    for step in (7, 8):
        w.write(job="j", step=step, rng=_snap(step), scalars=SCALARS)
    w.close()
    data = bytearray(path.read_bytes())
    newest = rs._FILE.size  # the second record (seq 2) went to slot 0 (seq % 2)
    data[newest + rs._SLOT.size + 40] ^= 0xFF  # half of the body written over
    path.write_bytes(bytes(data))
    assert rs.read(path, job="j", step=8) is None
    assert rs.read(path, job="j", step=7) is not None
    data[newest + 8] ^= 0x01  # and a header torn too: still only the older slot
    path.write_bytes(bytes(data))
    assert rs.read(path, job="j", step=7) is not None and rs.read(path, job="j", step=8) is None


def test_garbage_and_old_format_are_ignored(tmp_path):
    path = rs.path_for(tmp_path, 0)
    path.parent.mkdir(mode=0o700)
    for data in (b"", b"JITRANK1" + bytes(200), b"JITRANK2" + (1 << 62).to_bytes(8, "little")):
        path.write_bytes(data)
        assert rs.read(path, job="j", step=0) is None


def test_a_larger_record_grows_the_file(tmp_path):
    path = rs.path_for(tmp_path, 0)
    w = rs.Writer(path)
    w.write(job="j", step=1, rng=_snap(1), scalars=SCALARS)
    big = {**_snap(2), "cuda": [torch.arange(50_000, dtype=torch.uint8) for _ in range(3)]}
    w.write(job="j", step=2, rng=big, scalars=SCALARS)
    got = rs.read(path, job="j", step=2)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got["rng"]["cuda"], big["cuda"], strict=True))
    w.write(job="j", step=3, rng=_snap(3), scalars=SCALARS)
    assert rs.read(path, job="j", step=3) is not None
