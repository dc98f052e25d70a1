"""Freeing EC snapshot memory: chunks go when the job ends (normally or after giving up),
`jitrun clean --jit-dir DIR` removes a job's chunks and stale temp files (never a complete checkpoint unless
--all), and a job never reads another job's chunks.

Every test points JITCKPT_EC_SHM (read by jitrun, its workers and `jitrun clean` alike) at a directory of its
own in place of /dev/shm, removed with tmp_path.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jitckpt.ec import files as ec_files
from jitckpt.ec import pack as ec_pack
from jitckpt.wire import contract, layout

ROOT = Path(__file__).resolve().parent.parent


def _commit(shm: Path, job: str, step: int, world: int = 2, k: int = 1, m: int = 0, payload: bytes = b"x" * 64):
    """A committed version of ``job`` in ``shm`` (chunks + commit record) as the snapshot path writes it."""
    d = ec_files.ec_dir(job, shm)
    size = len(payload) * k
    for r in range(world):
        for i in range(k + m):
            ec_pack.write_chunk(d, ec_pack.ChunkTag(job, step, r, 0, i, k, m, size), payload)
    rec = {"job": ec_pack.job_key(job), "step": step, "attempt": 0, "k": k, "m": m, "world_size": world,
           "stripes": {str(r): {"size": size, "csize": len(payload), "shard": "0"} for r in range(world)}}
    for r in range(world):
        layout.atomic_write_bytes(d / ec_files.commit_name(job, step, r), json.dumps(rec).encode())
    return d


def _jit_dir(tmp: Path, job: str) -> Path:
    root = tmp / "jit"
    layout.claim_root(root, job)
    return root


def _replica(root: Path, job: str, step: int) -> Path:
    tmp = layout.staging_dir(root, step, "0", 0)
    (tmp / "state.pt").write_bytes(b"model")
    return layout.publish(tmp, root=root, step=step, shard="0", rank=0, world_size=1, job_id=job)


def _clean(*argv: str) -> tuple[int, str, str]:
    from jitrun import ec_clean

    out, err = io.StringIO(), io.StringIO()
    rc = ec_clean.main(list(argv), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def shm(tmp_path, monkeypatch):
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(contract.EC_SHM.name, str(d))
    return d


# -- jitrun clean ---------------------------------------------------------------------------------------------


def test_clean_removes_chunks_and_temp_files_keeps_checkpoints(tmp_path, shm):
    root = _jit_dir(tmp_path, "jobA")
    rep = _replica(root, "jobA", 4)
    mine = _commit(shm, "jobA", 8)
    (mine.parent / "stage" / "r0.s10").mkdir(parents=True)
    (mine.parent / "stage" / "r0.s10" / "state.pt").write_bytes(b"s" * 100)
    other = _commit(shm, "jobB", 8)  # another job on the same node: never touched
    # what an interrupted save, fetch, replace or atomic write leaves behind
    shard = rep.parent
    (shard / ".tmp-rank-1-4242").mkdir()
    (shard / ".tmp-rank-1-4242" / "state.pt").write_bytes(b"half")
    (shard / ".tmp-rank-0-fetch-77").mkdir()
    (shard / ".old-rank-0-99").mkdir()
    (root / f".{layout.FINISHED_FILE}.tmp-123").write_bytes(b"{")
    (root / ".probe-555").write_bytes(b"")
    (root / "events.jsonl").write_text(json.dumps({"event": "job_start", "pid": 1 << 30}) + "\n")
    before = sorted(p for p in root.rglob("*"))

    rc, out, err = _clean("--jit-dir", str(root), "--dry-run")
    assert rc == 0 and "would remove EC snapshot chunks of this job" in out, (out, err)
    assert sorted(root.rglob("*")) == before and mine.exists()

    rc, out, err = _clean("--jit-dir", str(root))
    assert rc == 0, err
    assert not mine.parent.exists(), "this job's /dev/shm directory is gone (chunks, commits, staging)"
    assert other.exists() and len(list(other.iterdir())) == 4, "another job's chunks are never touched"
    assert out.count("stale temp") == 5, out
    assert not list(root.rglob(".*")), list(root.rglob(".*"))
    assert layout.verify(rep, "jobA").step == 4, "a complete checkpoint stays"
    assert (root / layout.JOB_FILE).exists() and (root / "events.jsonl").exists()
    assert "removed EC snapshot chunks of this job" in out and "kept 1 complete checkpoint(s) (step(s) 4)" in out
    # again: nothing left to do, said so
    rc, out, _ = _clean("--jit-dir", str(root))
    assert rc == 0 and "no EC snapshot chunks of job 'jobA'" in out and "removed 0 file(s)" in out, out
    # --all: the complete checkpoints too
    rc, out, _ = _clean("--jit-dir", str(root), "--all")
    assert rc == 0 and not (root / "ckpt").exists() and "checkpoints (--all)" in out, out
    assert (root / layout.JOB_FILE).exists()


def test_clean_refuses_a_running_job_and_bad_dirs(tmp_path, shm):
    root = _jit_dir(tmp_path, "jobA")
    mine = _commit(shm, "jobA", 8)
    # a live process whose command line names jitrun stands for the job's launcher
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "jitrun"])
    try:
        deadline = time.monotonic() + 30
        while b"jitrun" not in Path(f"/proc/{p.pid}/cmdline").read_bytes():  # until it has exec'd
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (root / "events.jsonl").write_text(json.dumps({"event": "job_start", "pid": p.pid}) + "\n")
        rc, _out, err = _clean("--jit-dir", str(root))
        assert rc == 2 and f"still running on this node (jitrun pid {p.pid})" in err, err
        assert mine.exists()
        # a finished run (job_end after job_start) is not running, whatever the pid
        with open(root / "events.jsonl", "a") as f:
            f.write(json.dumps({"event": "job_end", "exitcode": 0}) + "\n")
        rc, _out, err = _clean("--jit-dir", str(root))
        assert rc == 0 and not mine.exists(), err
        _commit(shm, "jobA", 8)
        with open(root / "events.jsonl", "a") as f:
            f.write(json.dumps({"event": "job_start", "pid": p.pid}) + "\n")
        rc, _out, err = _clean("--jit-dir", str(root), "--force")
        assert rc == 0 and not mine.exists(), err
    finally:
        p.kill()
        p.wait()
    rc, _out, err = _clean("--jit-dir", str(tmp_path / "nope"))
    assert rc == 2 and "no such directory" in err
    (tmp_path / "plain").mkdir()
    rc, _out, err = _clean("--jit-dir", str(tmp_path / "plain"))
    assert rc == 2 and "not a jit dir" in err


def test_clean_subcommand_through_jitrun(tmp_path, shm):
    root = _jit_dir(tmp_path, "jobA")
    mine = _commit(shm, "jobA", 3)
    cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "clean", "--jit-dir", str(root)], capture_output=True,
                        text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert cp.returncode == 0 and "removed EC snapshot chunks" in cp.stdout, cp.stdout + cp.stderr
    assert not mine.parent.exists()


# -- a job never reads another job's chunks -----------------------------------------------------------------


def test_another_jobs_chunks_are_invisible_even_under_this_jobs_names(tmp_path, shm):
    from jitrun import decision

    _commit(shm, "jobA", 8)
    # job B looks in its own directory: nothing
    assert ec_files.scan_node("jobB", shm) == {"chunks": [], "commits": []}
    monkey = {contract.EC_EVERY.name: "4"}
    os.environ.update(monkey)
    try:
        inv = decision.inventory(tmp_path / "jitB", "jobB", decision.NodeInfo("n", "h", "a"))
    finally:
        os.environ.pop(contract.EC_EVERY.name)
    assert inv["ec"] == {"chunks": [], "commits": []}
    # even A's files copied into B's directory and renamed to B's names: the commit record names job A (not
    # listed), and every chunk header does too (refused when read)
    a, b = ec_files.ec_dir("jobA", shm), ec_files.ec_dir("jobB", shm)
    b.mkdir(parents=True)
    for p in a.iterdir():
        shutil.copy(p, b / p.name.replace("jobA.", "jobB.", 1))
    inv = ec_files.scan_node("jobB", shm)
    assert inv["commits"] == [] and len(inv["chunks"]) == 2
    assert ec_files.choose_version([inv], 2)[0] is None
    for p in b.glob("*.chunk"):
        with pytest.raises(ec_pack.ChunkError, match="belongs to job 'jobA', not 'jobB'"):
            ec_pack.read_chunk(p, "jobB")


def test_second_job_on_the_same_jit_dir_is_refused_and_leaves_the_chunks(tmp_path, shm):
    root = _jit_dir(tmp_path, "jobA")
    mine = _commit(shm, "jobA", 8)
    cmd = [sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "1", "--jit-dir", str(root),
           "--jit-ec-every", "2", str(ROOT / "scripts" / "demo_train.py"), "--steps", "2"]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "PYTHONPATH": str(ROOT), "JITCKPT_JOB_ID": "jobB"})
    assert cp.returncode == 2 and "belongs to job 'jobA'" in cp.stderr, cp.stderr
    assert len(list(mine.iterdir())) == 4 and not ec_files.job_root("jobB", shm).exists()


# -- under jitrun: freed at the end, never another job's ------------------------------------------------------


@pytest.mark.slow
def test_chunks_freed_at_normal_end_and_other_jobs_ignored(tmp_path, shm):
    from conftest import jitrun

    other = _commit(shm, "jobA", 100)  # a committed, world-size-2 version of another job on this node
    job = jitrun(tmp_path, nproc=2, steps=10, extra=["--jit-ec-every", "2"],
                 env={"JITCKPT_JOB_ID": "jobB", "JITCKPT_EC_SHM": str(shm)},
                 fault="rank=0,step=3,phase=forward,kind=sigkill;rank=1,step=3,phase=forward,kind=sigkill")
    assert job.returncode == 0, job.output[-4000:]
    # killed at the forward of 3: B's step-2 version may have committed, and on a busy host the rank that
    # dies second can still save a replica when the first one's death is seen (source "replica"); either
    # way the source is B's own or nothing, never A's step 100
    src = job.of("restore_source")
    assert src and all(e["source"] in ("ec", "fresh", "replica") and e.get("step") != 100 for e in src), src
    freed = job.of("ec_freed")
    assert len(freed) == 1 and freed[0]["files"] > 0, job.output[-3000:]
    assert "freed" in job.output and "of EC snapshots" in job.output
    assert not ec_files.job_root("jobB", shm).exists()
    assert len(list(other.iterdir())) == 4, "job A's chunks are left alone"


@pytest.mark.slow
def test_chunks_freed_after_giving_up(tmp_path, shm):
    from conftest import jitrun

    job = jitrun(tmp_path, nproc=2, steps=12, extra=["--jit-ec-every", "2"], max_restarts=0,
                 env={"JITCKPT_EC_SHM": str(shm)}, train_args=["--step-sleep", "0.2"],
                 fault="rank=0,step=7,phase=forward,kind=sigkill;rank=1,step=7,phase=forward,kind=sigkill")
    assert job.returncode != 0, job.output[-3000:]
    freed = job.of("ec_freed")
    assert len(freed) == 1 and freed[0]["files"] > 0, job.output[-3000:]
    assert not any(shm.iterdir()), list(shm.rglob("*"))
