"""Unit tests for jitckpt.verify.fingerprint: the state fingerprint the replicas compare."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from jitckpt.verify import fingerprint as fpm
from jitckpt.verify.fingerprint import compute, state_items, tensor_sum

MASK = (1 << 64) - 1


def _reference(t: torch.Tensor) -> int:
    """The definition, in Python integers: sum over words of (2 i + 1) * word, mod 2**64."""
    w = fpm.words(t)
    return sum((2 * i + 1) * int(x) for i, x in enumerate(w.tolist())) & MASK


@pytest.fixture
def small_chunks(monkeypatch):
    """Blocks of 8 words, so the chunked path runs on small tensors."""
    monkeypatch.setattr(fpm, "CHUNK", 8)
    monkeypatch.setattr(fpm, "_weights", {})


@pytest.mark.parametrize("t", [
    torch.arange(6, dtype=torch.float32),  # 24 bytes: int64 words
    torch.arange(3, dtype=torch.float32),  # 12 bytes: int32 words
    torch.arange(7, dtype=torch.uint8),  # 7 bytes: bytes
    torch.tensor(2.5, dtype=torch.bfloat16),  # a 0-dim tensor
])
def test_sum_is_the_definition(t):
    assert int(tensor_sum(t)) & MASK == _reference(t)


def test_chunked_sum_is_the_definition(small_chunks):
    t = torch.randn(101, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert int(tensor_sum(t)) & MASK == _reference(t)


@pytest.mark.parametrize("dtype, n", [(torch.float32, 6), (torch.float32, 3), (torch.float16, 7),
                                      (torch.bfloat16, 4), (torch.int64, 5), (torch.bool, 5)])
def test_every_single_bit_flip_changes_the_sum(dtype, n):
    t = (torch.arange(n) % 2 == 0) if dtype is torch.bool else torch.arange(n).to(dtype) * 3 - 1
    base = int(tensor_sum(t))
    raw = t.view(-1).view(torch.uint8)
    for byte in range(raw.numel()):
        for bit in range(8):
            flipped = t.clone()
            flipped.view(-1).view(torch.uint8)[byte] ^= 1 << bit
            assert int(tensor_sum(flipped)) != base, (dtype, byte, bit)


def test_every_single_bit_flip_changes_the_chunked_sum(small_chunks):
    t = torch.randn(40, generator=torch.Generator().manual_seed(1))
    base = int(tensor_sum(t))
    for byte in range(0, t.numel() * 4, 3):
        for bit in range(8):
            flipped = t.clone()
            flipped.view(torch.uint8)[byte] ^= 1 << bit
            assert int(tensor_sum(flipped)) != base, (byte, bit)


def test_swapped_elements_change_the_sum():
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert int(tensor_sum(t)) != int(tensor_sum(t[[1, 0, 2, 3]]))


def test_non_contiguous_tensor_is_fingerprinted_by_its_values():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert int(tensor_sum(t)) == int(tensor_sum(t.contiguous()))


def _model_and_adam(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    return m, opt


def test_fingerprint_covers_parameters_buffers_and_optimizer_state():
    m, opt = _model_and_adam()
    fp = compute(state_items([m], [opt]))
    names = set(fp.names)
    assert {"m0.0.weight", "m0.1.running_mean", "m0.1.num_batches_tracked", "o0.group0",
            "o0:m0.0.weight.exp_avg", "o0:m0.0.weight.exp_avg_sq", "o0:m0.0.weight.step"} <= names
    # a model's parameter reached again through the optimizer is taken once
    assert len(fp.names) == len(set(fp.names))
    assert len(fp.digest) == 32 and all(len(s) == 16 for s in fp.sums)


@pytest.mark.parametrize("where, name", [
    (lambda m, o: m[2].bias, "m0.2.bias"),
    (lambda m, o: m[1].running_var, "m0.1.running_var"),
    (lambda m, o: o.state[m[0].weight]["exp_avg_sq"], "o0:m0.0.weight.exp_avg_sq"),
])
def test_one_flipped_bit_names_the_tensor(where, name):
    m, opt = _model_and_adam()
    before = compute(state_items([m], [opt]))
    t = where(m, opt).detach()
    t.view(-1)[-1:].view(torch.uint8)[1] ^= 1 << 5
    after = compute(state_items([m], [opt]))
    assert after.digest != before.digest
    assert before.first_difference(after) == name
    assert before.first_difference(before) is None


def test_hyperparameters_are_part_of_it():
    m, opt = _model_and_adam()
    before = compute(state_items([m], [opt]))
    opt.param_groups[0]["lr"] = 5e-3
    assert before.first_difference(compute(state_items([m], [opt]))) == "o0.group0"


_CHILD = """
import torch, sys
sys.path.insert(0, {tests!r})
from test_fingerprint import _model_and_adam
from jitckpt.verify.fingerprint import compute, state_items
m, opt = _model_and_adam(7)  # trained with the default threads, as in the parent: the same state
torch.set_num_threads({threads})
big = torch.randn(3_000_000, generator=torch.Generator().manual_seed(9))
print(compute(state_items([m], [opt]) + [("big", big)]).digest)
"""


def test_deterministic_across_processes_and_thread_counts():
    """The same state gives the same digest in another process, with another number of threads
    (the modular sum does not depend on the order a parallel reduction adds in)."""
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    got = []
    for threads in (1, 2):
        cp = subprocess.run([sys.executable, "-c", _CHILD.format(tests=tests, threads=threads)],
                            capture_output=True, text=True, timeout=120)
        assert cp.returncode == 0, cp.stderr
        got.append(cp.stdout.strip())
    m, opt = _model_and_adam(7)
    big = torch.randn(3_000_000, generator=torch.Generator().manual_seed(9))
    here = compute(state_items([m], [opt]) + [("big", big)]).digest
    assert got == [here, here]


_ZERO = """
import os, sys, torch, torch.distributed as dist
from jitckpt import tracked
from jitckpt.verify.fingerprint import compute, state_items
rank = int(sys.argv[1])
tracked.track_optimizers()
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
from torch.distributed.optim import ZeroRedundancyOptimizer
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
for step in range(3):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    model(x).square().mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
opts = tracked.optimizers()
assert opts == [opt], opts  # the inner optimizer of the local partition is left out
print("DIGEST", compute(state_items([model], opts)).digest, compute(state_items([model], [opt.optim])).digest)
dist.destroy_process_group()
"""


def test_zero_sharded_optimizer_state_is_no_replica(tmp_path):
    """ZeroRedundancyOptimizer: each rank keeps the optimizer state of its own partition, so
    the replicas' fingerprints cover the parameters and hyperparameters but not that state
    (else every ZeRO job's restore would be refused); the partition's own optimizer (what
    the replicas must not compare) does differ across the two ranks."""
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, "-c", _ZERO, str(r), str(init)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    got = [next(ln.split()[1:] for ln in o.splitlines() if ln.startswith("DIGEST")) for o, _ in outs]
    assert got[0][0] == got[1][0], got  # the replicated state agrees
    assert got[0][1] != got[1][1], got  # each rank's partition differs: comparing it would refuse
