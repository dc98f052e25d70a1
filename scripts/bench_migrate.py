"""CRIU migration of a 2-rank torch gloo job on this host, phase by phase.

    python scripts/bench_migrate.py [--steps 30] [--pause-at 12] [--ddp]
    python scripts/bench_migrate.py --jitrun [--d-model 64] [--repeat 1]

``--jitrun``: the demo under ``jitrun --jit-migratable on`` (2 ranks, this node); rank 1
is moved by ``jitrun migrate`` (to this node's own agent: the transfer still goes
through the job's store), then the same job loses rank 1 to a SIGKILL and takes
jitrun's JIT restart path. One JSON line per run: the migration's teardown, dump,
transfer, restore and total pause of the moved rank (its "migrating" report to its
"migrated" one, from the events), the peer's pause, the image size, and the restart
path of the same job (process start + import and init + checkpoint load, from the
recovery event's stages) with the ratio pause / restart path.

Runs the worker of tests/test_migrate_mechanism.py: both ranks tear down their
group at a step boundary, rank 1 is dumped (CRIU, images checksummed), verified,
restored, and both rebuild; prints one JSON line with teardown, dump, verify,
restore and rebuild seconds, the image size, and whether the final state equals
a run without migration. Needs root and `make criu`. Cleans up what it starts.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _events(jit: Path) -> list[dict]:
    return [json.loads(line) for line in (jit / "events.jsonl").read_text().splitlines()]


def _demo(tmp: Path, name: str, d_model: int, act) -> list[dict]:
    """Run the demo under jitrun --jit-migratable on; ``act(jit)`` once rank 0 printed step 10."""
    jit = tmp / name
    cmd = [sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
           "--jit-dir", str(jit), "--jit-migratable", "on", "--jit-timeout", "5",
           str(ROOT / "scripts" / "demo_train.py"), "--steps", "200", "--step-sleep", "0.05",
           "--d-model", str(d_model), "--out", str(tmp / f"{name}.pt")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(tmp / f"{name}.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        out0 = jit / "migrate" / "out" / "rank0.a0.log"
        deadline = time.monotonic() + 300
        while "step   10" not in (out0.read_text(errors="replace") if out0.exists() else ""):
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name}: the job ended or stalled before step 10: "
                                 + (tmp / f"{name}.log").read_text()[-2000:])
            time.sleep(0.05)
        act(jit)
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"{name}: jitrun exited {p.returncode}: " + (tmp / f"{name}.log").read_text()[-3000:])
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return _events(jit)


def bench_jitrun(d_model: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="jitckpt-bench-migrate-"))
    try:
        def migrate(jit: Path) -> None:
            cp = subprocess.run([sys.executable, "-m", "jitrun.cli", "migrate", "--jit-dir", str(jit), "--rank", "1",
                                 "--to", "localhost"], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
            if cp.returncode != 0:
                raise SystemExit("jitrun migrate failed: " + cp.stdout + cp.stderr)

        def kill(jit: Path) -> None:
            where = json.loads((jit / "migrate" / "where.json").read_text())["ranks"]
            os.kill(where["1"]["pid"], signal.SIGKILL)

        ev = _demo(tmp, "migrate", d_model, migrate)
        by = {(e["event"], e.get("rank")): e for e in ev}
        res = by[("migration_restored", 1)]
        moved = by[("migrated", 1)]["t"] - by[("migrating", 1)]["t"]
        # the peer paused at the same minibatch start the moved rank reported from
        peer = by[("migration_resumed", 0)]["t"] - by[("migrating", 1)]["t"]
        dumped = by[("migration_dumped", 1)]
        ev = _demo(tmp, "restart", d_model, kill)
        rec = next(e for e in ev if e["event"] == "recovery")
        st = rec["stages"]
        restart = sum(st.get(k) or 0.0 for k in ("process_start", "import_and_init", "checkpoint_load"))
        return {"mode": "jitrun", "d_model": d_model, "image_mb": round(res["image_bytes"] / 1e6, 1),
                "teardown_s": dumped.get("teardown_s"), "dump_s": res["dump_s"], "transfer_s": res["transfer_s"],
                "restore_s": res["restore_s"], "pause_moved_rank_s": round(moved, 3), "pause_peer_s": round(peer, 3),
                "restart_path_s": round(restart, 3), "restart_stages": st,
                "pause_over_restart": round(moved / restart, 3) if restart else None}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pause-at", type=int, default=12)
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--jitrun", action="store_true", help="jitrun migrate against jitrun's restart path (the demo)")
    ap.add_argument("--d-model", type=int, default=64, help="with --jitrun: the demo's width (worker size)")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if args.jitrun:
        for _ in range(args.repeat):
            print(json.dumps(bench_jitrun(args.d_model)), flush=True)
        return 0
    import torch.distributed as dist
    from test_migrate_mechanism import WORKER, _free_port

    from jitrun.migration import criu

    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # child subreaper: the restored rank becomes ours
    tmp = Path(tempfile.mkdtemp(prefix="jitckpt-bench-migrate-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MIG_DDP": str(int(args.ddp)), "OMP_NUM_THREADS": "1"}
    pids: list[int] = []
    popens: list[subprocess.Popen] = []
    try:
        (tmp / "worker.py").write_text(WORKER)

        def run(ctl: Path, pause_at: int, port: int) -> list[subprocess.Popen]:
            ctl.mkdir()
            out = []
            for r in range(2):
                p = subprocess.Popen(criu.migratable_command(
                    [sys.executable, str(tmp / "worker.py"), str(ctl), str(r), "2", "127.0.0.1", str(port),
                     str(args.steps), str(pause_at)], output=tmp / f"{ctl.name}{r}.log"),
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True, env=env)
                popens.append(p)
                pids.append(criu.ns_init_pid(p.pid))
                out.append(p)
            return out

        def final(ctl: Path, r: int) -> str:
            return json.loads((ctl / f"rank{r}" / "final.json").read_text())["sha256"]

        port = _free_port()
        server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        for p in run(tmp / "ref", -1, port):
            p.wait(timeout=300)
        # a store of its own per run: the reference's g0 keys would make gloo connect to dead peers
        del server
        port = _free_port()
        server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        ctl = tmp / "mig"
        ps = run(ctl, args.pause_at, port)
        paused = tmp / "mig" / "rank1" / "paused-1.json"
        while not paused.exists():
            if any(p.poll() is not None for p in ps):
                raise SystemExit("a worker exited before pausing: " + (tmp / "mig1.log").read_text()[-2000:])
            time.sleep(0.01)
        pause = json.loads(paused.read_text())
        res = criu.dump(pids[-1], tmp / "images")
        ps[1].wait(timeout=10)
        t0 = time.monotonic()
        criu.verify(tmp / "images")
        verify_s = time.monotonic() - t0
        t0 = time.monotonic()
        new = criu.restore(tmp / "images", verify_first=False)
        restore_s = time.monotonic() - t0
        pids.append(new)
        for r in range(2):
            (ctl / f"rank{r}" / "resume-1.json").write_text(json.dumps({"store": ["127.0.0.1", port],
                                                                      "prefix": "g1"}))
        ps[0].wait(timeout=300)
        os.waitpid(new, 0)
        del server
        rebuilt = json.loads((ctl / "rank1" / "rebuilt-1.json").read_text())
        same = all(final(ctl, r) == final(tmp / "ref", r) for r in range(2))
        print(json.dumps({"ddp": args.ddp, "teardown_s": pause["teardown_s"], "dump_s": round(res.seconds, 3),
                          "image_mb": round(res.image_bytes / 1e6, 1), "verify_s": round(verify_s, 3),
                          "restore_s": round(restore_s, 3), "rebuild_s": rebuilt["rebuild_s"],
                          "bit_identical": same}))
        return 0 if same else 1
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in popens:
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
