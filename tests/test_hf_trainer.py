"""Hugging Face Trainer with ``callbacks=[JitCallback()]`` under the bare ``jitrun
--nproc-per-node 2``: a 2-layer GPT-2 from a config, random tokens, gloo on the CPU, 80 steps
over 2 epochs (40 per epoch), Trainer's own checkpoints every 20 steps, a log every 5
(tests/hf_train.py). Each job is failed three times, a different way each attempt (the
fault spec's ``attempt=``), and every rank's final model, optimizer, scheduler, TrainerState
(``log_history`` included, timings left out) and RNG states must be bit-identical to a
failure-free plain-torchrun run's, with at most one minibatch redone per recovery."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Job, _run_wide_dir, assert_same_state, run_reference, run_tree

pytest.importorskip("transformers")

SCRIPT = ROOT / "tests" / "hf_train.py"

# (name, JITCKPT_FAULT, --die-in-save, [(attempt, failed rank, its exit code, restore step)], extra args)
# step 10 / 55: mid-epoch 0 / 1; step 40: the first step of epoch 1; save 20 / 60: inside Trainer's
# own periodic save (rank 0 dies with checkpoint-20 half written); exit -9: killed (SIGSTOP: killed by
# jitrun once found stopped), 1: the exception's traceback.
CASES = [
    ("sigkill", "rank=1,step=10,phase=forward,kind=sigkill;rank=0,step=40,phase=forward,kind=sigkill,attempt=1;"
     "rank=1,step=55,phase=forward,kind=sigkill,attempt=2", "",
     [(0, 1, -9, 10), (1, 0, -9, 40), (2, 1, -9, 55)], []),
    ("sigstop", "rank=0,step=10,phase=forward,kind=sigstop;rank=1,step=40,phase=forward,kind=sigstop,attempt=1;"
     "rank=0,step=55,phase=forward,kind=sigstop,attempt=2", "",
     [(0, 0, -9, 10), (1, 1, -9, 40), (2, 0, -9, 55)], []),
    # --resume: the script also passes resume_from_checkpoint=True (Trainer's newest checkpoint): the
    # JIT checkpoint, as new or newer, is the one loaded
    ("in-save+exception", "rank=1,step=70,phase=forward,kind=exception,attempt=2", "0:20:sigkill:0,1:60:sigstop:1",
     [(0, 0, -9, 20), (1, 1, -9, 60), (2, 1, 1, 70)], ["--resume"]),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The failure-free run, once per test run: the first xdist worker to need it runs it under
    a lock, the other reads the same files."""
    import fcntl

    base = _run_wide_dir(tmp_path_factory, "hf-reference")
    out = base / "run"
    with open(base / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "final-1.pt").exists():
            out.mkdir(exist_ok=True)
            cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                "2", str(SCRIPT), "--out", str(out), "--mode", "none"], cwd=out, timeout=300)
            assert cp.returncode == 0, cp.stdout[-3000:]
    return out


def _exits_by_attempt(job: Job) -> list[dict[int, int]]:
    """Each failed attempt's worker exit codes, rank -> code, in order (one recovery ends each)."""
    out, cur = [], {}
    for e in job.events():
        if e["event"] == "worker_exit":
            cur[e["rank"]] = e["exitcode"]
        elif e["event"] == "recovery":
            out.append(cur)
            cur = {}
    return out


@pytest.mark.parametrize("name,fault,in_save,expect,extra", CASES, ids=[c[0] for c in CASES])
def test_trainer_failures_resume_exactly(tmp_path, reference, name, fault, in_save, expect, extra):
    jit = tmp_path / "jit"
    cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--max-restarts", "4",
           "--jit-timeout", "3", "--jit-dir", str(jit), str(SCRIPT), "--out", str(tmp_path), "--mode", "jit",
           *(["--die-in-save", in_save] if in_save else []), *extra]
    cp = run_tree(cmd, env={"JITCKPT_FAULT": fault}, timeout=420, cwd=tmp_path)
    job = Job(cp.returncode, cp.stdout, jit, tmp_path)
    assert job.returncode == 0, job.output[-6000:]
    rec = job.of("recovery")
    assert [r["restore_step"] for r in rec] == [s for _, _, _, s in expect], (rec, job.output[-4000:])
    assert all(r["redone_minibatches"] <= 1 for r in rec), rec
    exits = _exits_by_attempt(job)
    for (attempt, rank, code, _), got in zip(expect, exits, strict=True):
        # the failed rank as expected; its peer saved the JIT checkpoint and stopped on purpose (75)
        assert got == {rank: code, 1 - rank: 75}, (attempt, got)
    assert "WARNING: this rank's RNG" not in job.output  # a dead rank's own values were kept
    for r in (0, 1):
        assert f"[jitckpt] rank {r}: resumed from {jit}" in job.output
        assert_same_state(reference / f"final-{r}.pt", tmp_path / f"final-{r}.pt")
    if extra:
        assert "resuming from the JIT checkpoint" in job.output  # both offered: one loaded, the JIT one


def test_outside_jitrun_the_callback_does_nothing(tmp_path, reference):
    """Under plain torchrun JitCallback changes nothing: the same final state, no jitckpt output."""
    cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(SCRIPT), "--out", str(tmp_path), "--mode", "jit", "--max-steps", "80"],
                       cwd=tmp_path, timeout=300)
    assert cp.returncode == 0, cp.stdout[-3000:]
    assert "[jitckpt]" not in cp.stdout
    for r in (0, 1):
        assert_same_state(reference / f"final-{r}.pt", tmp_path / f"final-{r}.pt")


@pytest.mark.parametrize("mode", ["resumable", "accelerate"])
def test_resumable_inside_trainer_is_refused_at_start(tmp_path, mode):
    """``jitckpt.resumable`` / the Accelerate adapter called from a TrainerCallback cannot restore
    Trainer's step counters, epoch, logs (nor, for Accelerate, the scheduler Trainer makes after
    ``prepare``): refused before the first step, one line per rank, not restarted; the fault
    planned in epoch 1 (where the sampler's lazily made generator once crash-looped) never comes."""
    jit = tmp_path / "jit"
    cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--max-restarts", "3", "--jit-timeout", "3",
           "--jit-dir", str(jit), str(SCRIPT), "--out", str(tmp_path), "--mode", mode]
    cp = run_tree(cmd, env={"JITCKPT_FAULT": "rank=1,step=55,phase=forward,kind=sigkill"}, timeout=300,
                  cwd=tmp_path)
    job = Job(cp.returncode, cp.stdout, jit, tmp_path)
    assert job.returncode == 1, job.output[-4000:]
    exits = {e["rank"]: e["exitcode"] for e in job.events() if e["event"] == "worker_exit"}
    # each rank refused (78), or was killed by jitrun (-9) after its peer had refused first
    refusers = sorted(r for r, c in exits.items() if c == 78)
    assert set(exits) == {0, 1} and refusers and all(c in (78, -9) for c in exits.values()), exits
    assert not job.of("recovery") and not job.of("restart") and not job.of("fault_injected")
    assert sorted(e["rank"] for e in job.of("refused")) == refusers
    # jitrun's own line says why (a worker's last line may be lost as it exits); each worker line
    # that did come is one of a refuser's
    stop = [ln for ln in job.output.splitlines() if ln.startswith("jitrun: the job stops, not restarting")]
    assert len(stop) == 1 and "refused to train: " in stop[0] and "JitCallback()" in stop[0], stop
    refused = [m for m in (re.search(r"\[jitckpt\] rank (\d): REFUSED: (.*)", ln) for ln in job.output.splitlines())
               if m]
    assert refused and {int(m[1]) for m in refused} <= set(refusers), (refusers, job.output[-4000:])
    assert all("JitCallback()" in m[2] for m in refused), refused
    assert "Traceback" not in job.output and not list(tmp_path.glob("final-*.pt"))


def test_slow_periodic_save_does_not_slow_hang_detection(tmp_path):
    """Rank 0's Trainer checkpoint takes 2 s longer (a slow disk) every 5 steps; after six of
    them both ranks lose a collective (a recv nobody sends). Found in about a second of waiting,
    not after 5 x 2 s (the save no longer enters the hang bound's learning); exact."""
    common = [str(SCRIPT), "--max-steps", "40", "--save-steps", "5"]
    ref = tmp_path / "ref"
    ref.mkdir()
    cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        *common, "--out", str(ref), "--mode", "none"], cwd=ref, timeout=300)
    assert cp.returncode == 0, cp.stdout[-3000:]
    out, jit = tmp_path / "run", tmp_path / "jit"
    out.mkdir()
    lose = "rank={},step=32,phase=forward,kind=lose"
    cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--max-restarts", "1", "--jit-dir", str(jit),
           *common, "--out", str(out), "--mode", "jit", "--slow-save", "0:2"]
    cp = run_tree(cmd, env={"JITCKPT_FAULT": f"{lose.format(0)};{lose.format(1)}"}, timeout=420, cwd=out)
    job = Job(cp.returncode, cp.stdout, jit, out)
    assert job.returncode == 0, job.output[-4000:]
    det = job.of("hang_detected")
    assert len(det) == 1 and det[0]["kind"] == "lost", det
    # every rank's bound stayed near the floor: the wait was found within ~1 s, where a bound that
    # had learned the saves (5 x 2 s) would have let it run 10 s
    assert det[0]["bound_s"] < 2.0 and max(det[0]["waiting"].values()) < 3.0, det
    exits = {e["rank"]: e["exitcode"] for e in job.events() if e["event"] == "worker_exit"}
    assert exits == {0: 75, 1: 75}, exits  # both asked to save, both saved
    recs = job.of("recovery")
    assert len(recs) == 1 and recs[0]["redone_minibatches"] <= 1, recs
    for r in (0, 1):
        assert_same_state(ref / f"final-{r}.pt", out / f"final-{r}.pt")
