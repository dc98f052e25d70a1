"""Unit tests for jitckpt.api: register() and get_checkpoint_path().

JITCKPT_TOKEN is never set here: with it the runtime would attach its torch hooks
to the pytest process. Without it (cfg.managed is False) get_checkpoint_path()
still reads JITCKPT_DIR, which is what the restore tests use.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jitckpt import api, hooks
from jitckpt.wire import layout

JOB = "job-api"
ENV = ("JITCKPT_DIR", "JITCKPT_JOB_ID", "JITCKPT_TOKEN", "JITCKPT_RESTORE_STEP", "JITCKPT_FAULT",
       "JITCKPT_TIMEOUT", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
       "LD_PRELOAD")


@pytest.fixture(autouse=True)
def fresh_api(monkeypatch):
    """A pristine api module and environment; records (and blocks) any hook installation."""
    monkeypatch.setattr(api, "_runtime", None)
    monkeypatch.setattr(api, "_registered_at", None)
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    calls: list[tuple] = []
    monkeypatch.setattr(hooks, "install", lambda rt, detect=True: calls.append((rt, detect)))
    return calls


def _noop(ckpt_dir: str) -> None:
    pass


def _save(root: Path, step: int, rank: int, shard: str = "0", job_id: str = JOB) -> Path:
    tmp = layout.staging_dir(root, step, shard, rank)
    (tmp / "state.pt").write_bytes(b"state %d %d" % (step, rank))
    return layout.publish(tmp, root=root, step=step, shard=shard, rank=rank, world_size=2, job_id=job_id)


def _corrupt(replica: Path) -> None:
    p = replica / "state.pt"
    data = bytearray(p.read_bytes())
    data[0] ^= 0xFF
    p.write_bytes(bytes(data))


# --- register --------------------------------------------------------------------


@pytest.mark.parametrize("bad", [None, "save.pt", 3])
def test_register_not_callable(bad):
    with pytest.raises(TypeError, match="callable"):
        api.register(bad)
    assert api._registered_at is None  # a failed call does not count as the registration


def test_register_twice_names_first_call_site():
    api.register(_noop)
    first_line = sys._getframe().f_lineno - 1
    with pytest.raises(RuntimeError) as ei:
        api.register(_noop)
    msg = str(ei.value)
    assert "already called" in msg
    assert f"test_api.py:{first_line}" in msg


def test_register_bad_shard_name():
    with pytest.raises(ValueError, match="letters, digits"):
        api.register(_noop, shard="../x")
    api.register(_noop, shard=7)  # the failed call left nothing registered
    assert api._runtime.shard == "7"


def test_register_outside_jitrun_only_records(fresh_api):
    excepthook = sys.excepthook
    api.register(_noop, shard="tp1")
    rt = api._runtime
    assert rt is not None and rt.save_fn is _noop and rt.shard == "tp1"
    assert not rt.cfg.managed
    assert fresh_api == []  # hooks.install was not called
    assert rt.reporter is None
    assert sys.excepthook is excepthook
    assert api.get_checkpoint_path() is None


def test_register_with_fault_spec_installs_injection_only(fresh_api, monkeypatch):
    # plain-torchrun baseline with fault injection: hooks without detection
    monkeypatch.setenv("JITCKPT_FAULT", "rank=0,step=1,phase=forward,kind=exception")
    api.register(_noop)
    assert [d for _, d in fresh_api] == [False]


def test_get_checkpoint_path_without_env_is_none():
    assert api.get_checkpoint_path() is None


def test_get_checkpoint_path_missing_dir_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("JITCKPT_DIR", str(tmp_path / "does-not-exist"))
    monkeypatch.setenv("JITCKPT_JOB_ID", JOB)
    assert api.get_checkpoint_path() is None


# --- get_checkpoint_path over a populated jit dir ---------------------------------------


@pytest.fixture
def jit_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JITCKPT_DIR", str(tmp_path))
    monkeypatch.setenv("JITCKPT_JOB_ID", JOB)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    return tmp_path


def test_restore_step_returns_verified_replica(jit_dir, monkeypatch):
    _save(jit_dir, 3, 0)
    _save(jit_dir, 3, 1)
    _save(jit_dir, 5, 0)
    _save(jit_dir, 5, 1)
    monkeypatch.setenv("JITCKPT_RESTORE_STEP", "3")
    path = api.get_checkpoint_path()
    assert path == str(layout.replica_dir(jit_dir, 3, "0", 0))
    assert isinstance(layout.verify(Path(path), JOB), layout.Replica)
    rt = api._runtime
    assert rt.steps_done == 3 and rt.restored


def test_restore_prefers_own_rank(jit_dir, monkeypatch):
    _save(jit_dir, 3, 0)
    _save(jit_dir, 3, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("JITCKPT_RESTORE_STEP", "3")
    assert api.get_checkpoint_path() == str(layout.replica_dir(jit_dir, 3, "0", 1))


def test_restore_from_a_peers_replica_warns_of_its_per_rank_files(jit_dir, monkeypatch, capsys):
    """Rank 1's own replica did not survive: it gets rank 0's, whose rank-named files are
    said to be rank 0's, once, by name."""
    tmp = layout.staging_dir(jit_dir, 3, "0", 0)
    for name in ("state.pt", "rng_state_0.pth", "model_10.bin"):  # 10, not 0: not rank 0's
        (tmp / name).write_bytes(name.encode())
    rep = layout.publish(tmp, root=jit_dir, step=3, shard="0", rank=0, world_size=2, job_id=JOB)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("JITCKPT_RESTORE_STEP", "3")
    assert api.get_checkpoint_path() == str(rep)
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1 and "restoring from rank 0's replica" in err, err
    assert "rng_state_0.pth there look like rank 0's own" in err and "model_10" not in err, err


def test_restore_from_a_peers_replica_without_per_rank_files_says_nothing(jit_dir, monkeypatch, capsys):
    rep = _save(jit_dir, 3, 0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("JITCKPT_RESTORE_STEP", "3")
    assert api.get_checkpoint_path() == str(rep)
    assert "WARNING" not in capsys.readouterr().err


@pytest.mark.parametrize("name,rank,theirs", [
    ("rng_state_0.pth", 0, True), ("rank0/opt.pt", 0, True), ("opt-rank-3.pt", 3, True),
    ("shard_2.safetensors", 2, True), ("rank12.pt", 1, False), ("model_10.bin", 0, False),
    ("optimizer.pt", 0, False), ("rng_state_1.pth", 0, False)])
def test_files_named_for_a_rank(tmp_path, name, rank, theirs):
    (tmp_path / layout.MANIFEST).write_text(json.dumps({"files": {name: {}}}))
    rep = layout.Replica(tmp_path, 0, "0", rank, JOB, 0.0)
    assert layout.named_for_rank(rep, rank) == ([name] if theirs else [])


def test_restore_skips_corrupt_replica(jit_dir, monkeypatch, capsys):
    bad = _save(jit_dir, 5, 0)
    _save(jit_dir, 5, 1)
    _corrupt(bad)
    monkeypatch.setenv("JITCKPT_RESTORE_STEP", "5")
    assert api.get_checkpoint_path() == str(layout.replica_dir(jit_dir, 5, "0", 1))
    err = capsys.readouterr().err
    assert "ignoring" in err and str(bad) in err and "checksum mismatch" in err


def test_chosen_step_corrupt_falls_back_to_newest_valid_loudly(jit_dir, monkeypatch, capsys):
    _corrupt(_save(jit_dir, 5, 0))
    _save(jit_dir, 4, 0)
    _save(jit_dir, 2, 0)
    monkeypatch.setenv("JITCKPT_RESTORE_STEP", "5")
    assert api.get_checkpoint_path() == str(layout.replica_dir(jit_dir, 4, "0", 0))
    err = capsys.readouterr().err
    assert "chosen step 5" in err and "checksum mismatch" in err and "falling back to step 4" in err


def test_restore_none_when_no_valid_replica_at_or_below_the_chosen_step(jit_dir, monkeypatch, capsys):
    _corrupt(_save(jit_dir, 5, 0))
    _save(jit_dir, 7, 0)  # newer than the job's choice: never used
    monkeypatch.setenv("JITCKPT_RESTORE_STEP", "5")
    assert api.get_checkpoint_path() is None
    assert "a fresh start" in capsys.readouterr().err


def test_checkpoint_step_marks_the_label_as_read():
    rt = api._get_runtime()
    rt.steps_done, rt.step_read = 11, False
    assert api.checkpoint_step() == 11 and rt.step_read


def test_restore_step_none(jit_dir, monkeypatch):
    _save(jit_dir, 5, 0)
    monkeypatch.setenv("JITCKPT_RESTORE_STEP", "none")
    assert api.get_checkpoint_path() is None
    assert not api._runtime.restored


def test_without_restore_step_picks_newest_complete(jit_dir):
    # shard a at 3, 5, 6; shard b at 3, 5 (its step-6 replica is corrupt): newest complete is 5
    api.register(_noop, shard="a")
    for step in (3, 5, 6):
        _save(jit_dir, step, 0, shard="a")
    for step in (3, 5):
        _save(jit_dir, step, 1, shard="b")
    _corrupt(_save(jit_dir, 6, 1, shard="b"))
    assert api.get_checkpoint_path() == str(layout.replica_dir(jit_dir, 5, "a", 0))
    assert api._runtime.steps_done == 5


def test_ignores_other_jobs_checkpoints(jit_dir):
    _save(jit_dir, 2, 0)
    _save(jit_dir, 9, 0, job_id="someone-else")
    assert api.get_checkpoint_path() == str(layout.replica_dir(jit_dir, 2, "0", 0))
