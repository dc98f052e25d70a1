"""A framework or script that catches the exception of a failed collective
still gets its JIT checkpoint: the runtime saves where torch raises the error,
before any ``except`` runs (jitckpt/hooks.py). One script per catcher
(tests/catchers/): ``@hydra.main`` (prints "Error executing job with
overrides" and exits 1), ``try: main() except Exception: sys.exit(1)``,
Lightning's ``trainer.fit`` (catches, tears down, re-raises) and Accelerate's
own process-group set-up and DDP wrapping. Every model has a buffer (a
causal mask, as minGPT's attention), so DDP broadcasts its buffers at the
start of each forward, in C++: the collective pytorch/examples' minGPT-ddp
timed out in under Hydra.

Rank 1 is killed (SIGKILL) or stopped (SIGSTOP, rank 0 then waits the JIT
timeout) between minibatches (in its forward pre-hook, before the
minibatch's first DDP collective: rank 0 fails in the buffer broadcast) and
inside one (at the start of its backward: rank 0 fails in the gradient
all-reduce). Each run must end bit-identical to a failure-free plain-torchrun
run of the same script, with rank 0's JIT checkpoint of the failing minibatch
restored (at most one minibatch redone), the fault fired once, and every
process's exit code as expected: rank 0 75 (saved), rank 1 killed, jitrun 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import Job, assert_same_state, run_reference, run_tree

from jitckpt.wire.config import EXIT_SAVED

HERE = Path(__file__).with_name("catchers")
JITRUN = Path(sys.executable).with_name("jitrun")  # the console script a user types
STEP = 10  # 8 minibatches per rank and epoch: epoch 1, its third minibatch


def _hydra_args(tmp: Path, out: Path) -> list[str]:
    return [f"+out={out}", "+epochs=3", "hydra.run.dir=" + str(tmp / "hydra" / "${oc.env:RANK}")]


# catcher: (script, its arguments, a line only the catcher prints once it caught the exception)
CATCHERS = {
    "hydra": ("hydra_app.py", _hydra_args, "Error executing job with overrides"),
    "try_exit": ("try_exit.py", lambda tmp, out: ["--out", str(out), "--epochs", "3"], "training failed"),
    "lightning": ("lightning_fit.py", lambda tmp, out: ["--out", str(out)], None),
    "accelerate": ("accelerate_main.py", lambda tmp, out: ["--out", str(out)], None),
}
# where rank 1 fails: between minibatches, or inside one
WHERE = {"between": "forward", "inside": "backward"}


def _skip_missing(catcher: str) -> None:
    pytest.importorskip({"hydra": "hydra", "lightning": "lightning", "accelerate": "accelerate"}.get(catcher, "torch"))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Failure-free plain-torchrun runs, one per catcher script."""
    cache: dict[str, Path] = {}

    def get(catcher: str) -> Path:
        if catcher not in cache:
            tmp = tmp_path_factory.mktemp(f"ref-{catcher}")
            script, args, _ = CATCHERS[catcher]
            out = tmp / "reference.pt"
            cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                "2", str(HERE / script), *args(tmp, out)], cwd=tmp, timeout=300)
            assert cp.returncode == 0, cp.stdout[-3000:]
            cache[catcher] = out
        return cache[catcher]

    return get


def run_caught(tmp: Path, catcher: str, kind: str, where: str, env: dict | None = None) -> Job:
    script, args, _ = CATCHERS[catcher]
    jit, out = tmp / "jit", tmp / "final.pt"
    assert JITRUN.exists(), f"{JITRUN} not installed: pip install -e . in this environment"
    cmd = [str(JITRUN),  # the bare form users type
           "--nproc-per-node", "2", "--max-restarts", "3", "--jit-timeout", "3", "--jit-dir", str(jit),
           str(HERE / script), *args(tmp, out)]
    fault = f"rank=1,step={STEP},phase={WHERE[where]},kind={kind}"
    cp = run_tree(cmd, env={"JITCKPT_FAULT": fault, **(env or {})}, timeout=300, cwd=tmp)
    return Job(cp.returncode, cp.stdout, jit, out)


def check_caught(job: Job, catcher: str, kind: str, ref: Path) -> None:
    text = job.output[-6000:]
    assert job.returncode == 0, text
    fired = job.of("fault_injected")
    assert [(f["rank"], f["step"], f["kind"]) for f in fired] == [(1, STEP, kind)], (fired, text)
    saved = job.of("checkpoint_saved")
    assert [(s["rank"], s["step"]) for s in saved] == [(0, STEP)], (saved, text)
    # every process of the failed attempt: rank 0 saved (75), before any catcher ran; rank 1 died of its
    # own SIGKILL or, stopped, was killed by the agent; the restarted attempt ended 0 (jitrun's 0 above)
    evs = job.events()
    first = next(e for e in evs if e["event"] == "restart")
    exits = {e["rank"]: (e["exitcode"], bool(e.get("killed"))) for e in evs[:evs.index(first)]
             if e["event"] == "worker_exit"}
    assert exits == {0: (EXIT_SAVED, False), 1: (-9, kind == "sigstop")}, (exits, text)
    assert [e["exitcode"] for e in job.of("job_end")] == [0], text
    caught_line = CATCHERS[catcher][2]
    if caught_line is not None:
        assert caught_line not in job.output, text
    assert "Traceback" not in job.output, text  # the exception never reached anyone's except
    rec = job.of("recovery")
    assert len(rec) == 1 and rec[0]["restore_step"] == STEP, (rec, text)
    assert rec[0]["redone_minibatches"] is not None and rec[0]["redone_minibatches"] <= 1, rec
    assert_same_state(ref, job.out)


@pytest.mark.parametrize("catcher", list(CATCHERS))
def test_stopped_peer_between_minibatches(tmp_path, references, catcher):
    """The minGPT case: rank 0 times out in DDP's buffer broadcast."""
    _skip_missing(catcher)
    check_caught(run_caught(tmp_path, catcher, "sigstop", "between"), catcher, "sigstop", references(catcher))


@pytest.mark.slow
@pytest.mark.parametrize("catcher", list(CATCHERS))
@pytest.mark.parametrize("kind,where", [("sigkill", "between"), ("sigkill", "inside"), ("sigstop", "inside")])
def test_failed_peer(tmp_path, references, catcher, kind, where):
    _skip_missing(catcher)
    check_caught(run_caught(tmp_path, catcher, kind, where), catcher, kind, references(catcher))


@pytest.mark.slow
def test_store_sharing_opt_out_under_a_catching_script(tmp_path, references):
    """torch's store-sharing opt-out set in the environment (jitrun drops it and says so)
    with a script that catches the failure itself and exits 1."""
    job = run_caught(tmp_path, "try_exit", "sigkill", "between", env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert "jitrun: ignoring TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in job.output, job.output[-3000:]
    check_caught(job, "try_exit", "sigkill", references("try_exit"))
