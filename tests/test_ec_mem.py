"""EC snapshots' memory cap (--jit-ec-max-mem): what jitrun checks at start, what each node checks at
the first snapshot (2 versions x its chunks + its staging under its cap, else EC off for the job, loudly,
training goes on), and the job under jitrun.

The worker-level tests reuse tests/test_ec_snapshot.py's workers (real gloo processes, one directory per
"node" in place of /dev/shm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import test_ec_snapshot as snap_t
from test_ec_snapshot import JOB, node_dir, scan

from jitckpt.ec import memory as ec_memory
from jitckpt.ec import pack as ec_pack
from jitckpt.wire import contract

ROOT = Path(__file__).resolve().parent.parent
cluster = snap_t.cluster  # the fixture: a TCPStore master and one directory per "node", shared

GIB = 1 << 30


# -- sizes and the start-time check (pure) --------------------------------------------------------------------


def test_parse_size_units():
    assert ec_memory.parse_size("100") == 100
    assert ec_memory.parse_size("4K") == 4096 and ec_memory.parse_size("4KiB") == 4096
    assert ec_memory.parse_size("512M") == 512 << 20 and ec_memory.parse_size("512mb") == 512 << 20
    assert ec_memory.parse_size("1.5G") == 3 << 29 and ec_memory.parse_size(" 2 T ") == 2 << 40
    for bad in ("", "x", "-1", "0", "1Q", "1e9", "G"):
        with pytest.raises(ValueError):
            ec_memory.parse_size(bad)


def test_resolve_cap_default_fraction_and_limits():
    cap, how = ec_memory.resolve_max_mem(None, avail=16 * GIB, shm=64 * GIB)
    assert cap == 4 * GIB and "25% of MemAvailable 16.0 GiB" in how
    # a small /dev/shm (docker's 64 MiB) bounds the default instead of refusing the job
    cap, how = ec_memory.resolve_max_mem(None, avail=16 * GIB, shm=64 << 20)
    assert cap == 64 << 20 and "size of /dev/shm" in how
    assert ec_memory.resolve_max_mem("2G", avail=16 * GIB, shm=8 * GIB) == (2 * GIB, "--jit-ec-max-mem 2G")
    assert ec_memory.resolve_max_mem("50%", avail=16 * GIB, shm=64 * GIB)[0] == 8 * GIB
    with pytest.raises(ValueError, match=r"more than this node's MemAvailable \(16.0 GiB\).*at most 16.0 GiB"):
        ec_memory.resolve_max_mem("20G", avail=16 * GIB, shm=64 * GIB)
    with pytest.raises(ValueError, match=r"more than /dev/shm can hold \(1.0 GiB\).*--shm-size"):
        ec_memory.resolve_max_mem("2G", avail=16 * GIB, shm=GIB)
    with pytest.raises(ValueError, match=r"\(0, 100\]"):
        ec_memory.resolve_max_mem("150%", avail=16 * GIB, shm=64 * GIB)
    with mock.patch.object(ec_memory, "mem_available", return_value=None):
        with pytest.raises(ValueError, match="no MemAvailable"):
            ec_memory.resolve_max_mem(None, shm=GIB)
        assert ec_memory.resolve_max_mem("1G", shm=2 * GIB)[0] == GIB  # a size needs no meminfo


def test_mem_available_reads_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24684092 kB\nMemFree: 1 kB\nMemAvailable:   22409576 kB\n")
    assert ec_memory.mem_available(str(f)) == 22409576 * 1024
    f.write_text("MemTotal: 1 kB\n")
    assert ec_memory.mem_available(str(f)) is None
    assert ec_memory.mem_available() is None or ec_memory.mem_available() > 0


def test_node_needs_two_versions_of_its_chunks_plus_staging():
    # 3 nodes x 1 rank, 2+1: every node holds one chunk of every rank's stripe
    node_of = [0, 1, 2]
    sizes = [1000, 2000, 3000]
    plan = [(r, i, (r + i) % 3) for r in range(3) for i in range(3)]  # chunk i of rank r on node r+i
    needs = ec_memory.node_needs(node_of, sizes, plan, lambda s: -(-s // 2))
    h = ec_pack.CHUNK_HEADER_SIZE
    for n in range(3):
        assert needs[n]["chunks"] == 3
        assert needs[n]["chunk_bytes"] == 3 * h + 500 + 1000 + 1500
        assert needs[n]["need_bytes"] == 2 * needs[n]["chunk_bytes"] + sizes[n]
    msg = ec_memory.over_cap_message(8, 1, needs[1], 4000, "--jit-ec-max-mem 4000")
    for part in ("DISABLED", "step 8", "node 1", "2 versions x 3 chunk(s)", "over its cap of 3.9 KiB",
                 "--jit-ec-max-mem 4000", "Raise --jit-ec-max-mem to at least", "Training goes on"):
        assert part in msg, (part, msg)


def _check(argv):
    from jitrun import cli

    args = cli._parser().parse_args([*argv, str(ROOT / "scripts" / "demo_train.py")])
    return cli.check_args(args)


def test_cli_start_check():
    assert _check(["--jit-ec-every", "4", "--jit-ec-max-mem", "64M"]) is None
    assert _check(["--jit-ec-every", "4", "--jit-ec-max-mem", "10%"]) is None
    assert _check(["--jit-ec-every", "4"]) is None  # the default cap
    assert _check(["--jit-ec-max-mem", "64M"]) is None  # EC off: only parsed
    assert "--jit-ec-max-mem 'lots' is not a size" in _check(["--jit-ec-max-mem", "lots"])
    err = _check(["--jit-ec-every", "4", "--jit-ec-max-mem", "4096T"])
    assert err.startswith("--jit-ec-max-mem '4096T' = ") and "MemAvailable" in err and "at most" in err, err


def test_default_interval_is_on_and_never_refuses(monkeypatch, capsys):
    from jitrun import cli

    def args_of(*argv):
        return cli._parser().parse_args([*argv, str(ROOT / "scripts" / "demo_train.py")])

    a = args_of()
    assert cli.check_args(a) is None
    assert a.jit_ec_every == cli.DEFAULT_EC_EVERY > 0 and a.ec_cap[0] > 0
    off = args_of("--jit-ec-every", "0")
    assert cli.check_args(off) is None and off.jit_ec_every == 0
    # a node where no cap can be derived: the default turns EC off with a note, an explicit N is refused
    monkeypatch.setattr(ec_memory, "mem_available", lambda meminfo="": None)
    a = args_of()
    assert cli.check_args(a) is None and a.jit_ec_every == 0
    assert "EC snapshots off (the default --jit-ec-every" in capsys.readouterr().err
    err = cli.check_args(args_of("--jit-ec-every", "50"))
    assert err.startswith("--jit-ec-every 50: no MemAvailable"), err


def test_cli_refuses_cap_over_memavailable_and_creates_nothing(tmp_path):
    cmd = [sys.executable, "-m", "jitrun.cli", "--jit-dir", str(tmp_path / "jit"), "--jit-ec-every", "2",
           "--jit-ec-max-mem", "4096T", str(ROOT / "scripts" / "demo_train.py")]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert cp.returncode == 2, cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and "--jit-ec-max-mem '4096T'" in lines[0] and "MemAvailable" in lines[0], cp.stderr
    assert not (tmp_path / "jit").exists()


# -- the first snapshot: real worker processes -------------------------------------------------------------


def _run(c, node_of, caps, steps=6, every=2):
    """run_ranks with a per-node JITCKPT_EC_MAX_MEM (caps[node])."""
    world = len(node_of)
    procs = []
    for r, n in enumerate(node_of):
        e = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "GROUP_RANK": str(n),
             "LOCAL_RANK": str(node_of[:r].count(n)), "LOCAL_WORLD_SIZE": str(node_of.count(n)),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(c["port"]), "JITCKPT_DIR": str(c["tmp"] / f"jit{n}"),
             "JITCKPT_JOB_ID": JOB, "JITCKPT_TOKEN": "t" * 32, "JITCKPT_ATTEMPT": "0",
             "JITCKPT_EC_SHM": str(node_dir(c, n)), "OMP_NUM_THREADS": "1", "JITCKPT_TIMEOUT": "20",
             "PYTHONPATH": str(ROOT), contract.EC_MAX_MEM.name: str(caps[n]),
             contract.EC_MAX_MEM_HOW.name: f"--jit-ec-max-mem {caps[n]}"}
        os.makedirs(e["JITCKPT_DIR"], exist_ok=True, mode=0o700)
        os.makedirs(node_dir(c, n), exist_ok=True, mode=0o700)
        procs.append(subprocess.Popen([sys.executable, snap_t.__file__, "snap", str(steps), str(every)], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    res, errs = [], []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            lines = [x for x in out.splitlines() if x.startswith("{")]
            assert p.returncode == 0 and lines, f"rc {p.returncode}\n{out}\n{err[-3000:]}"
            res.append(json.loads(lines[-1]))
            errs.append(err)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return res, errs


def test_first_snapshot_over_one_nodes_cap_disables_ec_for_the_job(cluster):
    # each rank's stripe is ~3.5 KiB; with 2+1 on 3 nodes a node holds 3 chunks of ~1.8 KiB: it needs ~14 KiB
    big = 1 << 20
    res, errs = _run(cluster, [0, 1, 2], caps=[big, 8000, big])
    assert [r["committed"] for r in res] == [None] * 3 and all(r["disabled"] for r in res), res
    # nothing placed anywhere, staging gone; the training steps all ran (the workers exited 0 after step 6)
    assert scan(cluster, [0, 1, 2]) == [{"chunks": [], "commits": []}] * 3
    assert not [p for n in range(3) for p in node_dir(cluster, n).glob("*/stage/*")]
    # one loud line on rank 0 (the job's) and one on the node over its cap; nobody else
    loud = [i for i, e in enumerate(errs) if "EC snapshots DISABLED" in e]
    assert loud == [0, 1], [e[-1500:] for e in errs]
    line = next(x for x in errs[1].splitlines() if "DISABLED" in x)
    assert "at step 2" in line and "node 1" in line and "2 versions x 3 chunk(s)" in line, line
    assert "over its cap of 7.8 KiB (--jit-ec-max-mem 8000)" in line and "Raise --jit-ec-max-mem" in line, line
    # the save_fn ran once (step 2) and never again: no further snapshot was staged
    assert all(e.count("EC snapshot") <= 2 for e in errs)


def test_caps_that_fit_commit_as_before(cluster):
    res, errs = _run(cluster, [0, 1, 2], caps=[64 << 10] * 3)
    assert [r["committed"] for r in res] == [6, 6, 6] and not any(r["disabled"] for r in res), res
    assert not any("DISABLED" in e for e in errs)


# -- under jitrun -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_jitrun_job_trains_on_with_ec_disabled(tmp_path, reference):
    from conftest import assert_same_state, jitrun

    shm = tmp_path / "shm"  # stands for /dev/shm (agent and workers read JITCKPT_EC_SHM)
    shm.mkdir(mode=0o700)
    job = jitrun(tmp_path, nproc=2, steps=8, extra=["--jit-ec-every", "2", "--jit-ec-max-mem", "64K"],
                 env={"JITCKPT_EC_SHM": str(shm)})
    assert job.returncode == 0, job.output[-4000:]
    dis = job.of("ec_disabled")
    assert len(dis) == 1, job.output[-4000:]
    d = dis[0]
    assert d["reason"] == "memory_cap" and d["step"] == 2 and d["cap_bytes"] == 64 << 10, d
    assert d["need_bytes"] > d["cap_bytes"] and d["flag"] == "--jit-ec-max-mem" and d["versions"] == 2, d
    assert "--jit-ec-max-mem 64K" in d["message"] and "EC snapshots DISABLED" in job.output
    assert_same_state(reference(2, 8), job.out)  # training was not disturbed
    assert not any(shm.iterdir()), list(shm.rglob("*"))  # nothing left in "/dev/shm" after the job
