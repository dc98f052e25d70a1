"""CRIU migration of a 2-rank torch gloo job on this host, phase by phase (issue 13).

    python scripts/bench_migrate.py [--steps 30] [--pause-at 12] [--ddp]

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pause-at", type=int, default=12)
    ap.add_argument("--ddp", action="store_true")
    args = ap.parse_args()
    import torch.distributed as dist
    from test_migrate_mechanism import WORKER, _free_port

    from launcher import criu

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
