"""Unit tests for jitckpt.wire.layout: atomic publish, validation, selection, job ownership."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from jitckpt.wire import layout
from jitckpt.wire.layout import CheckpointDirError, Replica

JOB = "job-a"


def _save(root: Path, step: int, shard: str = "0", rank: int = 0, *, world_size: int = 2,
          job_id: str = JOB, files: dict[str, bytes] | None = None) -> Path:
    """Stage and publish one replica the way the runtime does."""
    tmp = layout.staging_dir(root, step, shard, rank)
    for rel, data in (files or {"state.pt": b"model-%d-%d" % (step, rank), "rng.bin": b"\x01\x02"}).items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return layout.publish(tmp, root=root, step=step, shard=shard, rank=rank, world_size=world_size,
                          job_id=job_id)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _manifest(p: Path) -> dict:
    return json.loads((p / layout.MANIFEST).read_text())


def _rewrite_manifest(p: Path, **changes) -> None:
    m = _manifest(p)
    m.update(changes)
    (p / layout.MANIFEST).write_text(json.dumps(m))


# --- publish / verify ----------------------------------------------------------


def test_publish_then_verify_returns_replica(tmp_path):
    root = tmp_path / "jit"
    final = _save(root, 7, shard="s1", rank=3)
    assert final == root / "ckpt" / "step-7" / "shard-s1" / "rank-3"
    r = layout.verify(final, JOB)
    assert isinstance(r, Replica), r
    assert (r.step, r.shard, r.rank, r.job_id, r.path) == (7, "s1", 3, JOB, final)
    # the staging dir was renamed away, nothing else left next to the replica
    assert sorted(p.name for p in final.parent.iterdir()) == ["rank-3"]


def test_publish_permissions_private(tmp_path):
    root = tmp_path / "jit"
    final = _save(root, 1, files={"a.bin": b"a", "sub/b.bin": b"b"})
    for d in (root, root / "ckpt", root / "ckpt" / "step-1", final.parent, final, final / "sub"):
        assert _mode(d) == 0o700, (d, oct(_mode(d)))
    for f in (final / "a.bin", final / "sub" / "b.bin", final / layout.MANIFEST):
        assert _mode(f) == 0o600, (f, oct(_mode(f)))


def test_publish_fixes_permissions_of_files_save_fn_made_public(tmp_path):
    root = tmp_path / "jit"
    tmp = layout.staging_dir(root, 2, "0", 0)
    (tmp / "x").write_bytes(b"x")
    os.chmod(tmp / "x", 0o666)
    (tmp / "d").mkdir()
    os.chmod(tmp / "d", 0o777)
    (tmp / "d" / "y").write_bytes(b"y")
    final = layout.publish(tmp, root=root, step=2, shard="0", rank=0, world_size=1, job_id=JOB)
    assert _mode(final / "x") == 0o600
    assert _mode(final / "d") == 0o700
    assert _mode(final / "d" / "y") == 0o600


def test_manifest_lists_sha256_of_every_file(tmp_path):
    import hashlib

    files = {"state.pt": b"weights" * 100, "nested/opt.pt": b"optimizer", "empty": b""}
    final = _save(tmp_path, 3, rank=1, world_size=4, files=files)
    m = _manifest(final)
    assert set(m["files"]) == set(files)
    for rel, data in files.items():
        assert m["files"][rel]["sha256"] == hashlib.sha256(data).hexdigest()
        assert m["files"][rel]["size"] == len(data)
    assert layout.MANIFEST not in m["files"]
    assert (m["step"], m["rank"], m["shard"], m["world_size"], m["job_id"], m["complete"]) == \
        (3, 1, "0", 4, JOB, True)


def test_publish_refuses_empty_save(tmp_path):
    tmp = layout.staging_dir(tmp_path, 0, "0", 0)
    with pytest.raises(RuntimeError, match="no files"):
        layout.publish(tmp, root=tmp_path, step=0, shard="0", rank=0, world_size=1, job_id=JOB)
    assert not layout.replica_dir(tmp_path, 0, "0", 0).exists()


def test_publish_replaces_existing_replica_of_same_rank_and_step(tmp_path):
    _save(tmp_path, 4, files={"v": b"old"})
    final = _save(tmp_path, 4, files={"v": b"new"})
    assert (final / "v").read_bytes() == b"new"
    assert isinstance(layout.verify(final, JOB), Replica)
    assert sorted(p.name for p in final.parent.iterdir()) == ["rank-0"]


def test_verify_rejects_staging_dir_without_manifest(tmp_path):
    tmp = layout.staging_dir(tmp_path, 5, "0", 0)
    (tmp / "state.pt").write_bytes(b"half written")
    why = layout.verify(tmp, JOB)
    assert isinstance(why, str) and "no manifest" in why


def test_verify_rejects_flipped_byte(tmp_path):
    final = _save(tmp_path, 5, files={"state.pt": b"0123456789" * 10})
    data = bytearray((final / "state.pt").read_bytes())
    data[42] ^= 0x01  # same size, different content
    (final / "state.pt").write_bytes(bytes(data))
    why = layout.verify(final, JOB)
    assert isinstance(why, str) and "checksum mismatch" in why and "state.pt" in why


def test_verify_rejects_extra_file(tmp_path):
    final = _save(tmp_path, 5)
    (final / "stray.bin").write_bytes(b"?")
    why = layout.verify(final, JOB)
    assert isinstance(why, str) and "extra" in why and "stray.bin" in why


def test_verify_rejects_missing_file(tmp_path):
    final = _save(tmp_path, 5)
    (final / "rng.bin").unlink()
    why = layout.verify(final, JOB)
    assert isinstance(why, str) and "missing ['rng.bin']" in why


def test_verify_rejects_incomplete_manifest(tmp_path):
    final = _save(tmp_path, 5)
    _rewrite_manifest(final, complete=False)
    why = layout.verify(final, JOB)
    assert isinstance(why, str) and "not marked complete" in why


def test_verify_rejects_unreadable_manifest(tmp_path):
    final = _save(tmp_path, 5)
    (final / layout.MANIFEST).write_text('{"format": 1, "comp')
    why = layout.verify(final, JOB)
    assert isinstance(why, str) and "unreadable manifest" in why


def test_verify_rejects_other_job(tmp_path):
    final = _save(tmp_path, 5, job_id="job-b")
    why = layout.verify(final, JOB)
    assert isinstance(why, str) and "job-b" in why
    assert isinstance(layout.verify(final, "job-b"), Replica)
    assert isinstance(layout.verify(final, None), Replica)  # no job filter


@pytest.mark.parametrize("key", ["step", "saved_at"])
def test_verify_rejects_manifest_missing_field(tmp_path, key):
    final = _save(tmp_path, 5)
    m = _manifest(final)
    m["x" + key[1:]] = m.pop(key)  # one corrupted byte in the key name
    (final / layout.MANIFEST).write_text(json.dumps(m))
    assert isinstance(layout.verify(final, JOB), str)


# --- scan ------------------------------------------------------------------------


def test_scan_good_and_rejected_with_reasons(tmp_path):
    good1 = _save(tmp_path, 1, rank=0)
    good2 = _save(tmp_path, 2, rank=1)
    corrupt = _save(tmp_path, 2, rank=0)
    (corrupt / "state.pt").write_bytes(b"X" * len((corrupt / "state.pt").read_bytes()))
    other = _save(tmp_path, 3, rank=0, job_id="job-b")
    staging = layout.staging_dir(tmp_path, 3, "0", 1)
    (staging / "state.pt").write_bytes(b"partial")
    # noise scan must ignore
    (tmp_path / "ckpt" / "step-x").mkdir()
    (tmp_path / "ckpt" / "step-1" / "not-a-shard").mkdir()

    good, bad = layout.scan(tmp_path, JOB)
    assert {r.path for r in good} == {good1, good2}
    assert all(isinstance(r, Replica) for r in good)
    reasons = {p: why for p, why in bad}
    assert set(reasons) == {corrupt, other, staging}
    assert "checksum mismatch" in reasons[corrupt]
    assert "job-b" in reasons[other]
    assert "staging" in reasons[staging]


def test_scan_missing_root_is_empty(tmp_path):
    assert layout.scan(tmp_path / "nothing", JOB) == ([], [])


# --- select_step / pick_replica ---------------------------------------------------


def _rep(step: int, shard: str = "0", rank: int = 0, saved_at: float = 0.0) -> Replica:
    return Replica(path=Path(f"/x/{step}/{shard}/{rank}"), step=step, shard=shard, rank=rank, job_id=JOB,
                   saved_at=saved_at)


def test_select_step_newest_complete():
    reps = [_rep(3, "a"), _rep(3, "b"), _rep(5, "a"), _rep(5, "b", rank=1), _rep(4, "a")]
    assert layout.select_step(reps, {"a", "b"}) == 5


def test_select_step_falls_back_when_newest_lacks_a_shard():
    reps = [_rep(3, "a"), _rep(3, "b"), _rep(5, "a"), _rep(5, "a", rank=1)]
    assert layout.select_step(reps, {"a", "b"}) == 3


def test_select_step_none_and_max_step():
    assert layout.select_step([], {"0"}) is None
    assert layout.select_step([_rep(2, "a")], {"a", "b"}) is None
    reps = [_rep(2), _rep(6), _rep(9)]
    assert layout.select_step(reps, {"0"}, max_step=8) == 6
    assert layout.select_step(reps, {"0"}, max_step=6) == 6
    assert layout.select_step(reps, {"0"}, max_step=1) is None


def test_select_step_on_scanned_replicas(tmp_path):
    _save(tmp_path, 4, shard="a")
    _save(tmp_path, 4, shard="b", rank=1)
    _save(tmp_path, 6, shard="a")
    broken = _save(tmp_path, 6, shard="b", rank=1)
    (broken / "rng.bin").unlink()
    good, _ = layout.scan(tmp_path, JOB)
    assert layout.select_step(good, {"a", "b"}) == 4


def test_pick_replica_prefers_rank_else_newest():
    reps = [_rep(5, rank=0, saved_at=10.0), _rep(5, rank=1, saved_at=30.0), _rep(5, rank=2, saved_at=20.0),
            _rep(5, "other", rank=3, saved_at=99.0), _rep(4, rank=4, saved_at=99.0)]
    assert layout.pick_replica(reps, 5, "0", prefer_rank=2).rank == 2
    assert layout.pick_replica(reps, 5, "0", prefer_rank=None).rank == 1
    assert layout.pick_replica(reps, 5, "0", prefer_rank=7).rank == 1  # preferred rank has none
    assert layout.pick_replica(reps, 5, "other").rank == 3
    assert layout.pick_replica(reps, 6, "0") is None
    assert layout.pick_replica(reps, 4, "other") is None


# --- claim_root ---------------------------------------------------------------------


def test_claim_root_creates_job_file_and_accepts_same_job(tmp_path):
    root = tmp_path / "a" / "b"
    layout.claim_root(root, JOB)
    assert _mode(root) == 0o700 and _mode(tmp_path / "a") == 0o700
    assert _mode(root / layout.JOB_FILE) == 0o600
    assert layout.read_job_id(root) == JOB
    assert [p.name for p in root.iterdir()] == [layout.JOB_FILE]  # no probe left behind
    layout.claim_root(root, JOB)  # idempotent
    assert layout.read_job_id(root) == JOB


def test_claim_root_refuses_other_job(tmp_path):
    layout.claim_root(tmp_path, "job-old")
    with pytest.raises(CheckpointDirError) as ei:
        layout.claim_root(tmp_path, "job-new")
    msg = str(ei.value)
    assert "job-old" in msg and "job-new" in msg and "fresh --jit-dir" in msg
    assert layout.read_job_id(tmp_path) == "job-old"


def test_claim_root_refuses_unwritable_path(tmp_path):
    f = tmp_path / "regular-file"
    f.write_bytes(b"")
    with pytest.raises(CheckpointDirError) as ei:
        layout.claim_root(f / "jit", JOB)
    assert "--jit-dir" in str(ei.value) and "not writable" in str(ei.value)


def test_claim_root_malformed_job_file(tmp_path):
    (tmp_path / layout.JOB_FILE).write_text("{not json")
    with pytest.raises(CheckpointDirError, match="--jit-dir"):
        layout.claim_root(tmp_path, JOB)


def test_claim_root_job_file_not_an_object(tmp_path):
    (tmp_path / layout.JOB_FILE).write_text('["job-a"]')
    with pytest.raises(CheckpointDirError, match="--jit-dir"):
        layout.claim_root(tmp_path, JOB)


# --- small helpers -------------------------------------------------------------------


def test_shard_dirname():
    assert layout.shard_dirname("tp-0.a_b") == "shard-tp-0.a_b"
    for bad in ("../x", "a/b", "", "a b"):
        with pytest.raises(ValueError, match="may only contain letters, digits"):
            layout.shard_dirname(bad)
    with pytest.raises(ValueError, match=r"'\.\./x'"):
        layout.replica_dir(Path("/r"), 1, "../x", 0)


def test_atomic_write_bytes_leaves_no_temp(tmp_path):
    p = tmp_path / "f.json"
    layout.atomic_write_bytes(p, b"one")
    layout.atomic_write_bytes(p, b"two")
    assert p.read_bytes() == b"two"
    assert _mode(p) == 0o600
    assert [x.name for x in tmp_path.iterdir()] == ["f.json"]


def test_atomic_write_bytes_failure_cleans_temp_and_keeps_old(tmp_path, monkeypatch):
    p = tmp_path / "f.json"
    layout.atomic_write_bytes(p, b"old")

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(layout.os, "replace", boom)
    with pytest.raises(OSError):
        layout.atomic_write_bytes(p, b"new")
    monkeypatch.undo()
    assert p.read_bytes() == b"old"
    assert [x.name for x in tmp_path.iterdir()] == ["f.json"]


def test_claim_root_other_job_message_mentions_checkpoints_only_when_present(tmp_path):
    layout.claim_root(tmp_path, "job-old")
    with pytest.raises(CheckpointDirError) as ei:
        layout.claim_root(tmp_path, "job-new")
    msg = str(ei.value)
    assert "belongs to job 'job-old' (its job.json)" in msg and "checkpoint" not in msg
    for s in (10, 20):
        (tmp_path / "ckpt" / f"step-{s}").mkdir(parents=True)
    with pytest.raises(CheckpointDirError) as ei:
        layout.claim_root(tmp_path, "job-new")
    assert "holds its checkpoints (steps 10, 20)" in str(ei.value)
