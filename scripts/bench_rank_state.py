"""Microbenchmark of the per-rank record JitCallback writes at every minibatch start
(jitckpt/integrations/_rank_state.py), in one process: the previous format (a JSON head, a
SHA-256 of the whole, one pwrite of ~15 KiB) against the memory-mapped two-slot record, the
same inputs (this process's RNG snapshots, torch's differing between records as a training
step's dropout makes it, Python's ``random`` not drawn; Trainer's counters), rounds interleaved.
A loop that draws from ``random`` every minibatch adds ~10 us to the new record (its 625 words
re-packed).

    .venv/bin/python scripts/bench_rank_state.py [--rounds 7] [--n 2000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402,F401 - imported, as in a Trainer job: its RNG is in the snapshot
import torch  # noqa: E402

from jitckpt.integrations import _rank_state  # noqa: E402
from jitckpt.resume.data import _portable, _rng_snapshot  # noqa: E402

SCALARS = {"total_loss_scalar": 41.25, "globalstep_last_logged": 45, "current_flos": 1.2e9, "initial_global_step": 0,
           "initial_tokens": 0, "tr_loss": 3.5,
           "stateful": {"TrainerControl": {"args": {"should_training_stop": False, "should_epoch_stop": False,
                                                    "should_save": False, "should_evaluate": False,
                                                    "should_log": False}, "attributes": {}}}}


def _previous(fd: int, snap: dict, step: int) -> None:
    """The record as it was written before the mmap'd one (for the comparison only)."""
    blobs: list[bytes] = []

    def add(t: torch.Tensor) -> int:
        blobs.append(t.contiguous().view(torch.uint8).numpy().tobytes())
        return len(blobs) - 1

    version, state, gauss = snap["random"]
    rng = {"torch": add(snap["torch"])}
    blobs.append(array("Q", state).tobytes())
    rng["random"] = [version, len(blobs) - 1, gauss]
    name, keys, pos, has_gauss, g = snap["numpy"]
    rng["numpy"] = [name, add(keys), pos, has_gauss, g]
    meta = {"job": "bench", "step": step, "scalars": SCALARS, "rng": rng, "sizes": [len(b) for b in blobs]}
    head = json.dumps(meta).encode()
    body = b"".join([len(head).to_bytes(8, "little"), head, *blobs])
    os.pwrite(fd, b"JITRANK1" + len(body).to_bytes(8, "little") + hashlib.sha256(body).digest() + body, 0)


def _per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=2000, help="records per round and format")
    a = ap.parse_args()
    snap = _portable(_rng_snapshot())
    torch.rand(3)  # a minibatch drew from torch's RNG (dropout): its state differs at every record
    snaps = [snap, _portable(_rng_snapshot())]
    with tempfile.TemporaryDirectory() as d:
        fd = os.open(os.path.join(d, "old.bin"), os.O_WRONLY | os.O_CREAT, 0o600)
        w = _rank_state.Writer(Path(d) / "rank-state" / "rank-0.bin")
        old_fn = lambda i: _previous(fd, snaps[i % 2], i)  # noqa: E731
        new_fn = lambda i: w.write(job="bench", step=i, rng=snaps[i % 2], scalars=SCALARS)  # noqa: E731
        old_fn(0)
        new_fn(0)
        old, new = [], []
        for _ in range(a.rounds):
            old.append(_per_call_us(old_fn, a.n))
            new.append(_per_call_us(new_fn, a.n))
        assert _rank_state.read(w_path := Path(d) / "rank-state" / "rank-0.bin", job="bench", step=a.n - 1), w_path
        os.close(fd)
        w.close()
    mo, mn = statistics.median(old), statistics.median(new)
    print(f"per-rank record per minibatch, median of {a.rounds} rounds x {a.n}: previous (JSON + SHA-256 + pwrite) "
          f"{mo:.1f} us [{min(old):.1f}-{max(old):.1f}], mmap two-slot {mn:.1f} us [{min(new):.1f}-{max(new):.1f}]: "
          f"{mo / mn:.1f}x faster")


if __name__ == "__main__":
    main()
