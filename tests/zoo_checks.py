"""What the model-zoo and imagenet recovery tests share: failure-free
plain-torchrun references computed once per test run (across xdist workers),
a run under the bare jitrun form, and the checks every recovered run must
pass: bit-identical final state of every rank, every process's exit code, the
fault fired once where it was asked for, the restore step, and at most one
minibatch whose optimizer step ran twice (counted from the ranks' own step
logs, ``<attempt> <step>`` per optimizer step)."""

from __future__ import annotations

import fcntl
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from compare_state import diff_states
from conftest import Job, _run_wide_dir, assert_same_state, run_reference, run_tree

from jitckpt.wire.config import EXIT_SAVED

JITRUN = Path(sys.executable).with_name("jitrun")  # the console script a user types
# one thread per rank: two ranks on a 2-core machine, and the same kernels in reference and recovered runs
ENV = {"OMP_NUM_THREADS": "1"}
NPROC = 2


@dataclass(frozen=True)
class Fault:
    """One failure: ``kind`` on ``rank``; ``spec`` is JITCKPT_FAULT's (the
    runtime's phases) or the script's own variable's (``env``); the run must
    resume at ``restore_step``."""

    rank: int
    kind: str
    env: str
    spec: str
    restore_step: int
    fired_line: str | None = None  # what the script prints when its own fault fires

    @classmethod
    def runtime(cls, rank: int, kind: str, phase: str, step: int) -> Fault:
        return cls(rank, kind, "JITCKPT_FAULT", f"rank={rank},step={step},phase={phase},kind={kind}", step)


def shared_references(tmp_path_factory, name: str) -> Callable[[str, Callable[[Path], list[str]]], Path]:
    """``get(key, cmd_of)``: the output prefix of a failure-free plain-torchrun
    run of ``cmd_of(prefix)`` (the script and its arguments), computed by the
    first xdist worker that needs it, under a lock; the others read the same
    files (conftest's ``reference``, for scripts of their own)."""
    cache: dict[str, Path] = {}
    base = _run_wide_dir(tmp_path_factory, name)

    def get(key: str, cmd_of: Callable[[Path], list[str]]) -> Path:
        if key not in cache:
            out = base / key
            with open(base / f"{key}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (base / f"{key}.done").exists():
                    work = Path(tempfile.mkdtemp(dir=base))
                    cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        "--nproc-per-node", str(NPROC), *cmd_of(out)],
                                       env=ENV, timeout=300, cwd=work)
                    assert cp.returncode == 0, cp.stdout[-3000:]
                    shutil.rmtree(work)
                    (base / f"{key}.done").touch()
            cache[key] = out
        return cache[key]

    return get


def run_jitrun(tmp: Path, script_args: list[str], fault: Fault, timeout: float = 300) -> Job:
    """The bare launch line (no rendezvous flags), the learned hang bound (no --jit-timeout)."""
    jit = tmp / "jit"
    assert JITRUN.exists(), f"{JITRUN} not installed: pip install -e . in this environment"
    cmd = [str(JITRUN), "--nproc-per-node", str(NPROC), "--max-restarts", "3", "--jit-dir", str(jit), *script_args]
    cp = run_tree(cmd, env={**ENV, fault.env: fault.spec}, timeout=timeout, cwd=tmp)
    return Job(cp.returncode, cp.stdout, jit, tmp / "final")


def step_log(prefix: Path, rank: int) -> list[tuple[int, int]]:
    p = Path(f"{prefix}.rank{rank}")
    return [(int(a), int(s)) for a, s in (line.split() for line in p.read_text().splitlines())]


def check_reference_log(ref: Path, total_steps: int) -> None:
    for r in range(NPROC):
        assert step_log(Path(f"{ref}-steps"), r) == [(0, s) for s in range(total_steps)]


def _failed_exit(kind: str) -> tuple[int, bool]:
    """(exit code, killed by the agent) of the rank that failed."""
    return {"sigkill": (-9, False), "sigstop": (-9, True), "exception": (1, False)}[kind]


def check_exits(job: Job, fault: Fault) -> None:
    """Every process: the failed attempt's two workers (the failing rank as its
    fault ends it, its peer 75 after its JIT save), one restart, both ranks of
    the restarted attempt finished, the job (and jitrun) 0."""
    evs, text = job.events(), job.output[-6000:]
    restarts = [i for i, e in enumerate(evs) if e["event"] == "restart"]
    assert len(restarts) == 1, ([e for e in evs if e["event"] == "restart"], text)
    exits = {e["rank"]: (e["exitcode"], bool(e.get("killed"))) for e in evs[:restarts[0]]
             if e["event"] == "worker_exit"}
    want = {r: (EXIT_SAVED, False) for r in range(NPROC)}
    want[fault.rank] = _failed_exit(fault.kind)
    assert exits == want, (exits, text)
    assert not [e for e in evs[restarts[0]:] if e["event"] == "worker_exit"], text
    finished = sorted(e["rank"] for e in evs if e["event"] == "finished" and e.get("attempt") == 1)
    assert finished == list(range(NPROC)), (finished, text)
    assert [e["exitcode"] for e in job.of("job_end")] == [0], text
    assert job.returncode == 0, text


def check_fired(job: Job, fault: Fault) -> None:
    fired = job.of("fault_injected")
    if fault.env == "JITCKPT_FAULT":
        kv = dict(item.split("=") for item in fault.spec.split(","))
        got = [(f["rank"], f["step"], f["phase"], f["kind"]) for f in fired]
        assert got == [(fault.rank, int(kv["step"]), kv["phase"], fault.kind)], (fired, job.output[-3000:])
    else:
        assert not fired, fired
        assert job.output.count(fault.fired_line) == 1, (fault.fired_line, job.output[-3000:])


def check_steps(job: Job, log: Path, fault: Fault, total_steps: int) -> None:
    """Every step ran, the restarted attempt from the restore step on, and at
    most one minibatch's optimizer step ran twice on any rank."""
    for r in range(NPROC):
        lines = step_log(log, r)
        first = [s for a, s in lines if a == 0]
        again = [s for a, s in lines if a == 1]
        assert {a for a, _ in lines} <= {0, 1}, lines
        assert first == list(range(len(first))), (r, lines)
        assert again == list(range(fault.restore_step, total_steps)), (r, fault.restore_step, lines)
        redone = set(first) & set(again)
        assert len(redone) <= 1, (r, sorted(redone), job.output[-3000:])


# BatchNorm running statistics: what a restore cannot always give back
RANK_LOCAL = re.compile(r"^model\..*\.running_(mean|var)$")


def assert_same_state_but_statistics(ref: Path, out: Path) -> None:
    """Everything bit-identical but the BatchNorm running statistics, which must be finite."""
    n, diffs = diff_states(str(ref), str(out))
    other = [d for d in diffs if not (d.startswith("differs: ") and RANK_LOCAL.match(d[len("differs: "):]))]
    assert n > 10 and not other, other[:10]
    st = torch.load(out, weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for k, v in st.items() if RANK_LOCAL.match(f"model.{k}")), out


@dataclass(frozen=True)
class Statistics:
    """Which ranks' BatchNorm running statistics a restore cannot give back
    (docs/recovery.md, "Buffers that are not replicas"), and the line the run
    must print about it; the default: every rank's, bit for bit."""

    lost_on: frozenset[int] = frozenset()
    said: str | None = None


EXACT = Statistics()


def check_recovered(job: Job, ref: Path, log: Path, fault: Fault, total_steps: int,
                    statistics: Statistics = EXACT) -> None:
    text = job.output[-6000:]
    check_exits(job, fault)
    check_fired(job, fault)
    rec = job.of("recovery")
    assert len(rec) == 1, (rec, text)
    assert rec[0]["restore_step"] == fault.restore_step, (rec, text)
    assert rec[0]["redone_minibatches"] is not None and rec[0]["redone_minibatches"] <= 1, rec
    check_steps(job, log, fault, total_steps)
    if statistics.said is not None:
        assert statistics.said in job.output, (statistics.said, text)
    for r in range(NPROC):
        compare = assert_same_state_but_statistics if r in statistics.lost_on else assert_same_state
        try:
            compare(Path(f"{ref}.rank{r}.pt"), Path(f"{job.out}.rank{r}.pt"))
        except AssertionError as e:  # the run's own account, to tell a wrong restore from a wrong redo
            raise AssertionError(f"rank {r}: {e}\n--- jitrun output ---\n{text}") from None
