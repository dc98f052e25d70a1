"""One job per jit dir, one jit dir per job (launcher/joblock.py, launcher/jobdir.py).

Two jobs with the same ``--rdzv-id`` on one jit dir, the second started while
the first runs (as jitrun's own hint "pass --rdzv-id ... to resume that job"
invites): the identical command is refused in one line naming the running
jitrun's PID and host, the same id with another seed in one line saying it is
another job; the first job, which loses a rank after both were refused,
restores its own checkpoint and ends bit-identical to a run without any of it.
Below, the pieces in process: the lock's modes and records, and the job
identity in job.json and in every manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TRAIN, assert_same_state, assert_verified_fingerprint

from jitckpt.wire import layout
from jitckpt.wire.config import EXIT_SAVED
from jitrun import jobdir, joblock

STEPS = 16
FAULT_STEP = 8
# 60 s: under a load of ~15 the refusal of B took longer than 25 s
HOLD_STEP, HOLD_S = 3, 60  # both of job A's ranks wait before this minibatch while B is tried (no collective waits)
RELEASE = "release-a"  # created once B was refused: A's ranks go on then, not after the whole hold


def _cmd(tmp: Path, seed: int) -> list[str]:
    hold = [a for r in (0, 1)
            for a in ("--delay", f"rank={r},seconds={HOLD_S},kind=loader,step={HOLD_STEP},until={tmp / RELEASE}")]
    return [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--rdzv-id", "shared-id",
            "--max-restarts", "3", "--jit-dir", str(tmp / "jit"), "--jit-timeout", "3", str(TRAIN),
            "--steps", str(STEPS), "--step-sleep", "0.1", "--log-every", "1", *hold, "--seed", str(seed),
            "--out", str(tmp / "final.pt")]


def _refused(cp: subprocess.CompletedProcess, *needles: str) -> str:
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert not cp.stdout.strip() and "Traceback" not in cp.stderr, cp.stdout + cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jitrun: error: "), cp.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.slow
def test_a_second_job_with_the_same_rdzv_id_is_refused_and_the_first_stays_exact(tmp_path, reference):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "a.log"
    with open(log, "w") as out:
        a = subprocess.Popen(_cmd(tmp_path, 0), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**env, "JITCKPT_FAULT": f"rank=1,step={FAULT_STEP},phase=backward,kind=sigkill"})
    try:
        deadline = time.monotonic() + 120
        while f"[rank 0] step {HOLD_STEP - 1:4d} loss" not in log.read_text():
            assert time.monotonic() < deadline and a.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        # both at once: each is refused before it imports much, while A is minibatches from its fault
        b = [subprocess.Popen(_cmd(tmp_path, seed), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for seed in (0, 1)]
        same, other = (subprocess.CompletedProcess(p.args, p.wait(120), *p.communicate()) for p in b)
        assert f"[rank 0] step {HOLD_STEP:4d} loss" not in log.read_text(), "A went on: B did not run alongside"
        (tmp_path / RELEASE).touch()
        code = a.wait(300)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, 9)
            a.wait()
    out_a = log.read_text()
    _refused(same, "job 'shared-id' is already running on jit dir", f"jitrun PID {a.pid} on host",
             f"kill {a.pid}", "--jit-dir")
    _refused(other, "belongs to job 'shared-id' run as", "--seed 0", "--seed 1", "another job", "--jit-dir")
    assert code == 0, out_a[-5000:]
    evs = [json.loads(ln) for ln in (tmp_path / "jit" / "events.jsonl").read_text().splitlines()]
    assert [e["pid"] for e in evs if e["event"] == "job_start"] == [a.pid], "job B wrote to job A's timeline"
    # the failure's exits (the fault's SIGKILL, the peer's save); the restarted ranks ended 0 (A's exit 0)
    assert {e["rank"]: e["exitcode"] for e in evs if e["event"] == "worker_exit"} == {1: -9, 0: EXIT_SAVED}, evs
    rec = [e for e in evs if e["event"] == "recovery"]
    assert len(rec) == 1 and rec[0]["restore_step"] == FAULT_STEP and rec[0]["redone_minibatches"] <= 1, rec
    assert_verified_fingerprint(rec[0])
    ident = json.loads((tmp_path / "jit" / "job.json").read_text())["identity"]
    for r in layout.scan(tmp_path / "jit")[0]:
        assert json.loads((r.path / layout.MANIFEST).read_text())["job_identity"] == ident
    assert_same_state(reference(2, STEPS), tmp_path / "final.pt")


# -- the lock, in process ------------------------------------------------------------------------------


def _claim(root: Path, one_node: bool = True, job: str = "j", cmd: tuple[str, ...] = ("train.py",)):
    return jobdir.claim(root, job, jobdir.identity(job, list(cmd)), list(cmd), one_node=one_node)


def test_one_node_job_holds_the_dir_alone(tmp_path):
    root = tmp_path / "jit"
    lock = _claim(root)
    rec = json.loads(next((root / joblock.AGENTS_DIR).iterdir()).read_text())
    assert rec["pid"] == os.getpid() and rec["job_id"] == "j" and rec["host"] == os.uname().nodename
    with pytest.raises(jobdir.DirRefused, match=f"already running .* jitrun PID {os.getpid()} on host"):
        _claim(root)
    with pytest.raises(jobdir.DirRefused, match="already running"):
        _claim(root, one_node=False)  # a multi-node agent is refused while a one-node job holds it
    lock.release()
    assert not list((root / joblock.AGENTS_DIR).iterdir())  # a clean end leaves no record
    _claim(root).release()


def test_nodes_of_one_job_share_the_dir_and_keep_a_one_node_run_out(tmp_path):
    root = tmp_path / "jit"
    # two agents of one process would share the record's name: the second's fd is what is tested
    a = _claim(root, one_node=False)
    fd = os.open(root / joblock.LOCK_FILE, os.O_RDWR)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # another node's agent: shared, granted
        with pytest.raises(jobdir.DirRefused, match="already running"):
            _claim(root, one_node=True)
    finally:
        os.close(fd)
        a.release()


def test_a_dead_agents_record_is_cleaned_and_said(tmp_path, capsys):
    root = tmp_path / "jit"
    _claim(root).release()
    d = root / joblock.AGENTS_DIR
    (d / "host-999999.json").write_text(json.dumps({"host": "gone-host", "pid": 999999, "job_id": "j"}))
    stage = root / "ckpt" / "step-3" / "shard-0" / ".tmp-rank-0-999999"
    stage.mkdir(parents=True)
    (stage / "state.pt").write_bytes(b"half")
    capsys.readouterr()
    _claim(root).release()
    err = capsys.readouterr().err
    assert "(jitrun PID 999999 on host gone-host) did not end cleanly" in err and "1 unfinished temp file" in err
    assert not stage.exists() and not (d / "host-999999.json").exists()


# -- the job's identity ---------------------------------------------------------------------------------


def test_same_id_other_command_is_another_job(tmp_path):
    root = tmp_path / "jit"
    _claim(root, cmd=("train.py", "--seed", "0")).release()
    with pytest.raises(jobdir.DirRefused, match=r"run as `train.py --seed 0`.*`train.py --seed 1`\) is another job"):
        _claim(root, cmd=("train.py", "--seed", "1"))
    _claim(root, cmd=("train.py", "--seed", "0")).release()  # the same command resumes
    assert jobdir.identity("j", ["a.py"]) != jobdir.identity("j", ["a.py", "x"]) != jobdir.identity("k", ["a.py"])


def test_a_manifest_of_another_identity_is_never_restored(tmp_path):
    def save(step: int, identity: str | None) -> Path:
        tmp = layout.staging_dir(tmp_path, step, "0", 0)
        (tmp / "state.pt").write_bytes(b"s%d" % step)
        return layout.publish(tmp, root=tmp_path, step=step, shard="0", rank=0, world_size=1, job_id="j",
                              identity=identity)

    save(3, "id-a")
    save(5, "id-b")  # job B's, same job id
    save(4, None)  # written before identities: the job id and job.json vouch for it
    good, bad = layout.scan(tmp_path, "j", "id-a")
    assert sorted(r.step for r in good) == [3, 4]
    assert [("step-5" in str(p), "saved by another run of job 'j'" in why) for p, why in bad] == [(True, True)]
    assert sorted(r.step for r in layout.scan(tmp_path, "j", "id-b")[0]) == [4, 5]
