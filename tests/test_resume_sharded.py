"""``jitckpt.resumable`` with a sharded model (FSDP2 ``fully_shard`` on CPU/gloo).

* HSDP (2 replicas x 2 shards, 4 ranks) under jitrun, a rank failing
  mid-run: the job restores the failed rank's shard from its healthy replica
  (another rank with the same shard coordinate), redoes at most one
  minibatch, and every rank's gathered full model + optimizer state ends bit
  for bit equal to a failure-free plain-torchrun run.
* Pure FSDP (no replicated mesh dim): resumable says at registration that a
  lost rank's shard cannot be recovered from a JIT checkpoint; what the JIT
  save takes equals ``get_state_dict``'s sharded state dict and a load puts it
  back exactly (``--selfcheck``); after a killed rank the job never restores
  one shard's state onto another (slow: it starts over and says why).
* The shard/replica naming rules and the DCP metadata allow-list, without
  processes.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, Job, assert_same_state, run_reference, run_tree

from jitckpt.resume import sharded as resume_sharded
from jitckpt.wire import layout

TRAIN = ROOT / "tests" / "sharded_train.py"
STEPS = 12
FAULT_STEP = 5


def _train_args(out: Path, mesh: str, steps: int, optim: str, extra: list[str] | None = None) -> list[str]:
    return [str(TRAIN), "--mesh", mesh, "--steps", str(steps), "--optim", optim, "--out", str(out), *(extra or [])]


def _nproc(mesh: str) -> int:
    r, s = (int(v) for v in mesh.split("x"))
    return r * s


@pytest.fixture(scope="session")
def reference_of(tmp_path_factory):
    """Failure-free plain-torchrun final states (a prefix; files <prefix>.rank<R>.pt), once per config."""
    cache: dict[tuple, Path] = {}

    def get(mesh: str = "2x2", steps: int = STEPS, optim: str = "adamw") -> Path:
        key = (mesh, steps, optim)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ref-{mesh}-{optim}")
            cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                str(_nproc(mesh)), *_train_args(d / "final", mesh, steps, optim)], cwd=d, timeout=300)
            assert cp.returncode == 0, cp.stdout[-4000:]
            cache[key] = d / "final"
        return cache[key]

    return get


def _jitrun(tmp: Path, fault: str, mesh: str = "2x2", steps: int = STEPS, optim: str = "adamw",
            timeout_s: float = 5) -> Job:
    jit = tmp / "jit"
    cmd = [sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", str(_nproc(mesh)),
           "--max-restarts", "3", "--jit-timeout", str(timeout_s), "--jit-dir", str(jit),
           *_train_args(tmp / "final", mesh, steps, optim)]
    cp = run_tree(cmd, env={"JITCKPT_FAULT": fault}, timeout=400, cwd=tmp)
    return Job(cp.returncode, cp.stdout, jit, tmp / "final")


def _same_final(job: Job, reference: Path, nproc: int) -> None:
    for r in range(nproc):
        try:
            assert_same_state(Path(f"{reference}.rank{r}.pt"), Path(f"{job.out}.rank{r}.pt"))
        except AssertionError as e:
            raise AssertionError(f"rank {r}: {e}\n--- jitrun output ---\n{job.output[-6000:]}") from None


def _check_hsdp_recovery(job: Job, reference: Path, failed_rank: int, restore_step: int = FAULT_STEP) -> None:
    assert job.returncode == 0, job.output[-6000:]
    assert job.of("fault_injected"), job.events()
    # mesh (replicate, shard) = [[0, 1], [2, 3]]: ranks of one column are replicas of one shard
    shards = {0: "fsdp-0of2", 1: "fsdp-1of2", 2: "fsdp-0of2", 3: "fsdp-1of2"}
    saved = {e["rank"]: e["shard"] for e in job.of("checkpoint_saved")}
    assert saved and failed_rank not in saved and all(shards[r] == sh for r, sh in saved.items()), saved
    assert set(job.of("restore_decision")[0]["sources"]) == {"fsdp-0of2", "fsdp-1of2"}, job.of("restore_decision")
    rec = job.of("recovery")
    assert len(rec) == 1, job.events()
    assert rec[0]["restore_step"] == restore_step and rec[0]["redone_minibatches"] <= 1, rec
    # the failed rank restored its shard from the other rank of its column, through resumable()
    peer = failed_rank ^ 2
    shard = shards[failed_rank]
    expect = f"rank {failed_rank}: resumed from {job.jit_dir}/ckpt/step-{restore_step}/shard-{shard}/rank-{peer} "
    assert expect in job.output, job.output[-6000:]
    # every rank's sharded state went through DCP files that the manifest checksums
    rep = layout.verify(job.jit_dir / "ckpt" / f"step-{restore_step}" / f"shard-{shard}" / f"rank-{peer}")
    assert isinstance(rep, layout.Replica), rep
    files = json.loads((rep.path / layout.MANIFEST).read_text())["files"]
    assert {"dcp/.metadata", "jitckpt_state.pt"} <= set(files) and any(f.endswith(".distcp") for f in files), files
    _same_final(job, reference, 4)


@pytest.mark.slow  # ~55 s on the shared 2 cores: a 4-rank torchrun reference plus the 4-rank jitrun job
def test_hsdp_killed_rank_recovers_from_replica(tmp_path, reference_of):
    """The first cell: rank 1 (shard 1; its replica is rank 3) SIGKILLed in a forward."""
    job = _jitrun(tmp_path, f"rank=1,step={FAULT_STEP},phase=forward,kind=sigkill")
    _check_hsdp_recovery(job, reference_of(), failed_rank=1)


@pytest.mark.slow
@pytest.mark.parametrize("rank,phase,kind,optim,restore_step", [
    (2, "backward", "sigkill", "adamw", FAULT_STEP),  # shard 0, replica rank 0; in FSDP's reduce-scatter/all-reduce
    (0, "forward", "exception", "adamw", FAULT_STEP),  # the store-hosting rank
    (3, "forward", "sigstop", "sgd", FAULT_STEP),  # detected by the JIT timeout; SGD momentum buffers
    # killed in its optimizer step: the peers notice at the next minibatch's all-gather / all-reduce
    # and save the state after that step
    (1, "optimizer", "sigkill", "adamw", FAULT_STEP + 1),
])
def test_hsdp_faults_resume_exactly(tmp_path, reference_of, rank, phase, kind, optim, restore_step):
    job = _jitrun(tmp_path, f"rank={rank},step={FAULT_STEP},phase={phase},kind={kind}", optim=optim, timeout_s=3)
    _check_hsdp_recovery(job, reference_of(optim=optim), failed_rank=rank, restore_step=restore_step)


def test_pure_fsdp_explains_and_state_round_trips(tmp_path):
    """Pure FSDP (1-D mesh over 2 ranks, no replica): registration says why a lost rank's shard cannot be
    recovered; the JIT save's tensors equal get_state_dict's sharded state dict, and loading them back
    after two more steps restores that state exactly without running an optimizer step."""
    cp = run_tree([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   *_train_args(tmp_path / "final", "1x2", 3, "adamw", ["--selfcheck", str(tmp_path)])],
                  cwd=tmp_path, timeout=300)
    assert cp.returncode == 0, cp.stdout[-4000:]
    for r in range(2):
        assert f"rank {r}: jitckpt.resumable: the model is sharded with no replication (pure FSDP" in cp.stdout
        assert f"[rank {r}] selfcheck ok: 6 model tensors, shard fsdp-{r}of2, replicas 1" in cp.stdout, cp.stdout


@pytest.mark.slow
def test_pure_fsdp_killed_rank_starts_over_and_says_why(tmp_path, reference_of):
    """No replica of the killed rank's shard: the survivor's JIT save is never used in its place (no step
    has every shard); the job starts over, says why, and still ends like a failure-free run."""
    job = _jitrun(tmp_path, "rank=1,step=3,phase=backward,kind=sigkill", mesh="1x2", steps=6)
    assert job.returncode == 0, job.output[-6000:]
    assert {e["rank"]: e["shard"] for e in job.of("checkpoint_saved")} == {0: "fsdp-0of2"}, job.events()
    assert job.of("sharded_no_replica"), job.events()
    dec = job.of("restore_decision")
    assert dec and dec[0]["step"] is None, dec
    assert "restarted with no checkpoint of every shard to restore" in job.output, job.output[-6000:]
    assert "resumed from" not in job.output
    _same_final(job, reference_of(mesh="1x2", steps=6), 2)


# -- no processes -------------------------------------------------------------------


def test_shard_identity_rules():
    hsdp = [("R", "S"), ("R", "S")]  # fully_shard on a (replicate, shard) mesh: Replicate(), Shard(0)
    assert resume_sharded.shard_identity((2, 2), (0, 1), hsdp) == ("fsdp-1of2", 2, [1])
    assert resume_sharded.shard_identity((2, 2), (1, 1), hsdp)[0] == "fsdp-1of2"  # its replica
    assert resume_sharded.shard_identity((2, 2), (1, 0), hsdp)[0] == "fsdp-0of2"
    # pure FSDP: every rank its own shard, no replica
    assert resume_sharded.shard_identity((4,), (3,), [("S",)]) == ("fsdp-3of4", 1, [0])
    # a mesh dim is a replica dim only if every parameter is replicated along it
    assert resume_sharded.shard_identity((2, 2), (1, 0), [("R", "S"), ("S", "R")]) == ("fsdp-1of2_0of2", 1, [0, 1])
    assert resume_sharded.shard_identity((3,), (2,), [("R",)]) == ("fsdp-all", 3, [])
    for name in ("fsdp-1of2", "fsdp-1of2_0of2", "fsdp-all"):
        layout.shard_dirname(name)  # valid jitckpt shard names
    with pytest.raises(ValueError):
        resume_sharded.shard_identity((2, 2), (0,), hsdp)
    assert "HSDP" in resume_sharded.no_replica_message("fsdp-0of4", 4)


def test_metadata_reader_allow_list(tmp_path):
    """DCP's .metadata is read with an allow-list unpickler: a real one loads, anything else is refused
    before it runs."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.arange(6.0).reshape(2, 3), "b": {"c": torch.tensor(3)}},
                 storage_writer=dcp.FileSystemWriter(str(tmp_path / "ok")), no_dist=True)
    md = resume_sharded.read_metadata_safely(str(tmp_path / "ok" / ".metadata"))
    assert tuple(md.state_dict_metadata["a"].size) == (2, 3)

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    class EvilGetattr:
        def __reduce__(self):  # builtins.getattr on something else than the memory-format enum
            return (getattr, (Path, "touch"))

    for i, obj in enumerate((Evil(), EvilGetattr(), {"x": eval})):
        p = tmp_path / f"evil{i}"
        p.write_bytes(pickle.dumps(obj))
        with pytest.raises(pickle.UnpicklingError):
            resume_sharded.read_metadata_safely(str(p))
    assert not marker.exists()
