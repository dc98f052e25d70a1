"""Step-time cost of capturing the module buffers at every minibatch start.

    python scripts/bench_buffers.py [--blocks 16] [--steps 6] [--batch 8] [--image-size 64] [--json] [--quick]

What is measured: the capture the runtime takes at the start of every
minibatch so that a JIT save can rewind BatchNorm statistics (running mean,
running variance, num_batches_tracked) to that point: one
``torch._foreach_copy_`` of every buffer of the model into a mirror allocated
once. The model is the ResNet-18 of tests/imagenet_main.py (torchvision's
layout: 20 BatchNorm layers, 11.7 M parameters, 1000 classes); a step is
forward + cross-entropy + backward + SGD with momentum on one process and one
thread (no DDP: the copy is local, and a gradient all-reduce would only add
time to both sides).

How: one process trains in blocks of ``--steps`` steps, alternately without
the copy (A) and with it just before the forward (B), in ABBA order so that a
drift of the machine's load favours neither; each block gives its median step
time, each adjacent A/B pair a ratio B/A. Reported, for this thread's CPU
time (the headline: on the shared 2-core machine other processes stretch the
wall clock of single blocks by more than the effect) and for the wall clock:
the median, min and max of those ratios and the ratio of the medians of all A
and all B step times; and the copy alone (median of 2000 calls, microseconds),
the bytes it copies and its share of a step's CPU time. The first block of
each kind is a warm-up and is dropped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent


def resnet18() -> nn.Module:
    sys.path.insert(0, str(ROOT / "tests"))
    from imagenet_main import ResNet  # the one ResNet-18 of the repository (torchvision's layout)

    return ResNet()


class Capture:
    """The buffers and their mirror, allocated once; ``take`` is the per-minibatch copy."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = [b for b in model.buffers()]
        self.mirror = [torch.empty_like(b) for b in self.buffers]

    def take(self) -> None:
        torch._foreach_copy_(self.mirror, self.buffers)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def matches(self) -> bool:
        return all(torch.equal(m, b) for m, b in zip(self.mirror, self.buffers, strict=True))


def make_step(model: nn.Module, batch: int, size: int):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(batch, 3, size, size, generator=g)
    y = torch.randint(0, 1000, (batch,), generator=g)

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def run_block(step, capture: Capture | None, steps: int) -> tuple[list[float], list[float]]:
    """(wall seconds, this thread's CPU seconds) of each step."""
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        if capture is not None:
            capture.take()  # at the minibatch start, before the forward updates the statistics
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return wall, cpu


def copy_alone_us(capture: Capture, calls: int = 2000) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        capture.take()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def measure(blocks: int, steps: int, batch: int, size: int) -> dict:
    torch.manual_seed(0)
    model = resnet18()
    model.train()
    capture = Capture(model)
    step = make_step(model, batch, size)
    order = [(i // 2 + i) % 2 == 1 for i in range(2 * blocks + 2)]  # ABBA ABBA ...: True is B (with the copy)
    blocks_of: dict[str, dict[bool, list[list[float]]]] = {"wall": {False: [], True: []}, "cpu": {False: [], True: []}}
    seen = set()
    for with_copy in order:
        wall, cpu = run_block(step, capture if with_copy else None, steps)
        if with_copy not in seen:  # warm-up block of each kind
            seen.add(with_copy)
            continue
        blocks_of["wall"][with_copy].append(wall)
        blocks_of["cpu"][with_copy].append(cpu)
    capture.take()
    assert capture.matches(), "the mirror does not hold the buffers after a copy"
    r = {"model": "resnet18", "batch": batch, "image_size": size, "threads": torch.get_num_threads(),
         "blocks_per_side": blocks, "steps_per_block": steps,
         "buffers": len(capture.buffers), "buffer_bytes": capture.nbytes(), "copy_alone_us": copy_alone_us(capture)}
    for clock, sides in blocks_of.items():
        r[clock] = summarize(sides[False], sides[True])
    r["copy_share_of_cpu_step"] = r["copy_alone_us"] * 1e-6 / (r["cpu"]["step_ms_without"] * 1e-3)
    return r


def summarize(without: list[list[float]], with_copy: list[list[float]]) -> dict:
    """Per clock: median step times, the ratio of adjacent blocks' medians (median, min, max)
    and the ratio of all steps' medians."""
    ratios = [statistics.median(b) / statistics.median(a) for a, b in zip(without, with_copy, strict=True)]
    flat_a, flat_b = [t for blk in without for t in blk], [t for blk in with_copy for t in blk]
    return {"step_ms_without": statistics.median(flat_a) * 1e3, "step_ms_with": statistics.median(flat_b) * 1e3,
            "block_ratio_median": statistics.median(ratios), "block_ratio_min": min(ratios),
            "block_ratio_max": max(ratios), "ratio_of_medians": statistics.median(flat_b) / statistics.median(flat_a)}


def report(r: dict) -> str:
    lines = [
        f"buffer capture on a ResNet-18 step (batch {r['batch']}, {r['image_size']}x{r['image_size']}, "
        f"{r['threads']} thread(s)): {r['buffers']} buffers, {r['buffer_bytes'] / 1024:.1f} KiB",
        f"  copy alone (torch._foreach_copy_ into the mirror): {r['copy_alone_us']:.1f} us "
        f"= {100 * r['copy_share_of_cpu_step']:.4f} % of a step's CPU time",
    ]
    for clock, what in (("cpu", "CPU time (this thread)"), ("wall", "wall clock")):
        c = r[clock]
        lines.append(
            f"  {what}: step {c['step_ms_without']:.2f} ms without, {c['step_ms_with']:.2f} ms with the copy; "
            f"ratio with/without over {r['blocks_per_side']} interleaved block pairs of {r['steps_per_block']} "
            f"steps: median {c['block_ratio_median']:.4f} (min {c['block_ratio_min']:.4f}, "
            f"max {c['block_ratio_max']:.4f}), of all steps' medians {c['ratio_of_medians']:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=16, help="measured blocks per side (plus one warm-up each)")
    ap.add_argument("--steps", type=int, default=6, help="steps per block")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="4 blocks of 3 steps per side at batch 2, 32x32")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the lines")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.steps, args.batch, args.image_size = 4, 3, 2, 32
    if args.batch < 2 or args.image_size < 32:
        ap.error("--batch 2 or more and --image-size 32 or more: BatchNorm in training needs at least 2 values "
                 "per channel, and ResNet-18's last stage is image-size/32 pixels wide")
    torch.set_num_threads(args.threads)
    r = measure(args.blocks, args.steps, args.batch, args.image_size)
    print(json.dumps(r) if args.json else report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
