"""What jitrun says about a job is what happened ("drop-in truth"):

* a script without jitckpt (no save_fn) restarts on its own checkpoints:
  jitrun never says "from scratch", and reports no redone-minibatch count
  it cannot know, nor a checkpoint time next to a skipped checkpoint;
* a job that finished (exit 0) marks its jit dir; the same command again
  starts fresh and says so (its checkpoints are moved aside, not deleted),
  unless --jit-resume;
* the summary says where events.jsonl is;
* when restarts run out, the failure report names the user's script and the
  rank that failed, not a healthy rank that saved.
"""

from __future__ import annotations

import json
import sys
import textwrap

from conftest import TRAIN, assert_verified_fingerprint, jitrun, run_tree

DROPIN = textwrap.dedent("""
    # a plain DDP script with its own periodic checkpoint and no jitckpt code
    import os, sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = sys.argv[1]
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    if os.path.exists(ckpt):
        s = torch.load(ckpt, weights_only=True)
        model.load_state_dict(s["model"]); opt.load_state_dict(s["opt"]); start = s["step"]
        print(f"[rank {rank}] own checkpoint at step {start}", flush=True)
    for step in range(start, 12):
        x = torch.full((4, 8), float(step))
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if rank == 0 and step % 4 == 3:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    dist.destroy_process_group()
""")


def _events(jit):
    return [json.loads(line) for line in (jit / "events.jsonl").read_text().splitlines()]


def test_dropin_script_restarts_on_its_own_checkpoints(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(DROPIN)
    jit = tmp_path / "jit"
    cp = run_tree([sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2",
                   "--max-restarts", "2", "--jit-timeout", "3", "--jit-dir", str(jit), str(script),
                   str(tmp_path / "own.pt")],
                  env={"JITCKPT_FAULT": "rank=1,step=9,phase=backward,kind=sigkill"})
    assert cp.returncode == 0, cp.stdout[-4000:]
    assert "from scratch" not in cp.stdout.lower(), cp.stdout[-4000:]
    assert "no rank registered a save_fn" in cp.stdout
    assert "own checkpoint at step 8" in cp.stdout
    evs = _events(jit)
    (rec,) = [e for e in evs if e["event"] == "recovery"]
    assert_verified_fingerprint(rec)
    assert rec["redone_minibatches"] is None and rec["restore_step"] is None, rec
    assert rec["checkpoint_s"] is None, rec  # nothing was saved
    assert "checkpoint" not in rec["stages"]
    assert f"timeline in {jit / 'events.jsonl'}" in cp.stdout


def test_finished_job_rerun_starts_fresh_unless_resume(tmp_path):
    job = jitrun(tmp_path, steps=8, fault="rank=1,step=5,phase=backward,kind=sigkill")
    assert job.returncode == 0, job.output[-3000:]
    assert (job.jit_dir / "FINISHED.json").exists()
    assert (job.jit_dir / "ckpt" / "step-5").is_dir()
    # --jit-resume: continue from the finished run's checkpoints
    resumed = jitrun(tmp_path, steps=8, extra=["--jit-resume"])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "resuming from its checkpoints" in resumed.output
    assert "at step 5" in resumed.output
    # the same command again: a new run from step 0, said so, old checkpoints kept aside
    again = jitrun(tmp_path, steps=8)
    assert again.returncode == 0, again.output[-3000:]
    assert "finished at" in again.output and "starting fresh" in again.output
    assert "resumed from" not in again.output
    assert list((job.jit_dir / "previous").glob("finished-*/ckpt/step-5")), "moved aside, not deleted"
    assert not (job.jit_dir / "ckpt").exists()


def test_restarts_exhausted_names_the_script_and_the_failed_rank(tmp_path):
    job = jitrun(tmp_path, steps=8, max_restarts=0, fault="rank=1,step=3,phase=backward,kind=exit")
    assert job.returncode == 1
    out = job.output
    assert f"{TRAIN.name} FAILED" in out, out[-3000:]
    root = out[out.index("Root Cause"):]
    assert "rank      : 1" in root.split("Other Failures")[0], root[:1500]
    assert "exitcode  : 13" in root.split("Other Failures")[0]
    assert "exitcode  : 75" not in out  # the healthy rank that saved is not a failure
