"""Every way torchrun's docs and tutorials launch a job, under jitrun, recovers.

One job per launch form, three failures in it, one per attempt: a rank
SIGKILLed in backward (attempt 0), a rank SIGSTOPped in forward past the JIT
timeout (attempt 1), an exception in the optimizer step (attempt 2). Each
job must end bit-identical to a failure-free plain-torchrun run with every
process's exit code 0, every injected fault fired exactly once (on its own
attempt), at most one minibatch redone per failure, and the timeline's
attempts counting up: 0, 1, 2, 3. The two-node forms (static and c10d) are in
tests/test_multinode.py on the namespace harness.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TRAIN, assert_same_state, assert_verified_fingerprint, run_tree

STEPS = 18
FAULTS = ";".join([
    "rank=1,step=4,phase=backward,kind=sigkill",
    "rank=0,step=9,phase=forward,kind=sigstop,attempt=1",
    "rank=1,step=14,phase=optimizer,kind=exception,attempt=2",
])
COMMON = ["--max-restarts", "3", "--jit-timeout", "3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _form(name: str, tmp: Path) -> tuple[list[str], list[str], dict[str, str]]:
    """(jitrun options, program and its args, environment) of one launch form."""
    script = [str(TRAIN)]
    port = str(_free_port())
    c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}"]
    if name == "bare":  # torchrun's default: static, which torch turns into a local c10d on one node
        return ["--nproc-per-node", "2"], script, {}
    if name == "static":  # a port given: torchrun keeps the static rendezvous (its store in the agent)
        return ["--nproc-per-node", "2", "--master-port", port], script, {}
    if name == "standalone":
        return ["--standalone", "--nproc-per-node", "2"], script, {}
    if name == "c10d":
        return ["--nproc-per-node", "2", *c10d], script, {}
    if name == "elastic_range":
        # a job that may span nodes needs the same secret on every node, as an operator sets it
        return (["--nnodes", "1:2", "--nproc-per-node", "2", *c10d, "--rdzv-conf", "last_call_timeout=1"], script,
                {"JITCKPT_TOKEN": "launch-forms-" + "0" * 20})
    if name == "module":
        return ["--nproc-per-node", "2", "-m"], ["demo_train"], {"PYTHONPATH": str(TRAIN.parent)}
    if name == "no_python":
        wrapper = tmp / "train.sh"
        wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -u {TRAIN} \"$@\"\n")
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        return ["--nproc-per-node", "2", "--no-python"], [str(wrapper)], {}
    if name == "run_path":
        return ["--nproc-per-node", "2", "--run-path"], script, {}
    if name == "pet_env":  # torchrun reads every option from PET_<OPTION> too
        return [], script, {"PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "3", "PET_MASTER_PORT": port}
    raise ValueError(name)


FORMS = ["bare", "static", "standalone", "c10d", "elastic_range", "module", "no_python", "run_path", "pet_env"]


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_launch_form_recovers(form: str, tmp_path: Path, reference) -> None:
    opts, prog, env = _form(form, tmp_path)
    jit, out = tmp_path / "jit", tmp_path / "final.pt"
    cmd = [sys.executable, "-m", "jitrun.cli", *opts, *COMMON, "--jit-dir", str(jit),
           *prog, "--steps", str(STEPS), "--out", str(out)]
    cp = run_tree(cmd, env={"JITCKPT_FAULT": FAULTS, "OMP_NUM_THREADS": "1", **env}, timeout=300, cwd=ROOT)
    log = cp.stdout[-6000:]
    assert cp.returncode == 0, log
    evs = [json.loads(line) for line in (jit / "events.jsonl").read_text().splitlines()]
    # every injected fault fired once, on its own attempt
    fired = sorted((e["attempt"], e["kind"]) for e in evs if e["event"] == "fault_injected")
    assert fired == [(0, "sigkill"), (1, "sigstop"), (2, "exception")], (fired, log)
    # attempts count up, the same in the rendezvous records and in what the workers were told
    assert [e["round"] for e in evs if e["event"] == "rendezvous"] == [0, 1, 2, 3], log
    started = sorted({e["attempt"] for e in evs if e["event"] == "started"})
    assert started == [0, 1, 2, 3], started
    recs = [e for e in evs if e["event"] == "recovery"]
    assert len(recs) == 3, (recs, log)
    for r in recs:
        assert r["redone_minibatches"] is not None and r["redone_minibatches"] <= 1, r
        assert_verified_fingerprint(r)
    assert not [e for e in evs if e["event"] in ("no_jit_checkpoint", "state_divergence", "job_abort")], log
    assert_same_state(reference(2, STEPS), out)


def test_worker_titles_and_ranks_file(tmp_path: Path) -> None:
    """ps shows one line per rank naming jitrun, the rank, the world size and
    the script with its arguments; <jit dir>/ranks.json maps rank -> PID."""
    import subprocess
    import time

    jit, out = tmp_path / "jit", tmp_path / "final.pt"
    cmd = [sys.executable, "-m", "jitrun.cli", "--nproc-per-node", "2", "--jit-dir", str(jit),
           str(TRAIN), "--steps", "150", "--step-sleep", "0.05", "--out", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        ranks: dict = {}
        lines: dict[str, str] = {}
        while time.monotonic() < deadline and p.poll() is None:
            try:
                ranks = json.loads((jit / "ranks.json").read_text())["ranks"]
            except (OSError, ValueError, KeyError):
                ranks = {}
            ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
            by_pid = {ln.split(None, 1)[0]: ln for ln in ps.splitlines()[1:] if ln.strip()}
            lines = {r: by_pid.get(str(v["pid"]), "") for r, v in ranks.items()}
            if len(lines) == 2 and all("jitrun[rank" in ln for ln in lines.values()):
                break
            time.sleep(0.2)
        assert sorted(lines) == ["0", "1"], (ranks, lines)
        for r, line in lines.items():
            assert f"jitrun[rank {r}/2] demo_train.py --steps 150" in line, line
            assert ranks[r]["node"] and ranks[r]["attempt"] == 0, ranks[r]
        output, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.communicate()
    assert p.returncode == 0, output[-3000:]


def test_warm_workers_get_torchruns_threads(tmp_path: Path) -> None:
    """jitrun starts its warm-start server before it imports torch itself, ahead of
    torchrun's defaulting: the server must still start with the OMP_NUM_THREADS=1
    torchrun gives several workers (OpenMP reads it when torch loads), so the
    workers' thread counts are torchrun's."""
    import subprocess

    script = tmp_path / "threads.py"
    script.write_text("import os, torch\nprint(f\"rank {os.environ['RANK']} intra-op threads "
                      "{torch.get_num_threads()} OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS')}\", flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    got = {}
    for name, launcher in (("torchrun", ["torch.distributed.run"]), ("jitrun", ["jitrun.cli", "--jit-dir",
                                                                              str(tmp_path / "jit")])):
        cp = subprocess.run([sys.executable, "-m", *launcher, "--nproc-per-node", "2", str(script)],
                            capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
        assert cp.returncode == 0, f"{name}: {cp.stdout[-2000:]}{cp.stderr[-2000:]}"
        # two workers printing at once can share a line of the launcher's output: the records, not the lines
        got[name] = sorted(re.findall(r"rank \d+ intra-op threads \d+ OMP_NUM_THREADS (?:\d+|None)", cp.stdout))
    assert len(got["torchrun"]) == 2 and got["jitrun"] == got["torchrun"], got
