"""Unit tests for jitckpt.resume (the pieces of ``resumable`` that run in one
process): the data position of a plain DataLoader, the RNG snapshot, and the
save/restore of a whole session through a published replica checkpoint.
The end-to-end tests under jitrun are in test_resume_e2e.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from jitckpt import api, hooks, resume
from jitckpt.listeners import Event
from jitckpt.resume import data as resume_data
from jitckpt.wire import layout

ENV = ("JITCKPT_DIR", "JITCKPT_JOB_ID", "JITCKPT_TOKEN", "JITCKPT_RESTORE_STEP", "JITCKPT_FAULT",
       "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "LD_PRELOAD")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(api, "_runtime", None)
    monkeypatch.setattr(api, "_registered_at", None)
    monkeypatch.setattr(resume, "_session", None)
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    # never attach torch hooks to the pytest process
    monkeypatch.setattr(hooks, "install", lambda rt, detect=True: None)


class Counting(Dataset):
    """Sample i is the tensor [i]; counts the samples loaded (main process only)."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loaded += 1
        return torch.tensor([i])


def _loader(kind: str, workers: int, data: Dataset) -> DataLoader:
    if kind == "shuffle":  # order drawn from the global RNG when the iterator starts
        return DataLoader(data, batch_size=4, shuffle=True, num_workers=workers)
    if kind == "generator":  # order from the loader's own generator, advanced every epoch
        return DataLoader(data, batch_size=4, shuffle=True, num_workers=workers,
                          generator=torch.Generator().manual_seed(3))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=11)
    return DataLoader(data, batch_size=4, sampler=sampler, num_workers=workers)


def _run_original(kind: str, workers: int, trained: int) -> tuple[dict, list[list[int]]]:
    """Epoch 0 whole, then `trained` optimizer steps of epoch 1 and the batch of
    the next minibatch fetched (not trained): the position at that minibatch's
    start, and the batches epoch 1 has from there on."""
    torch.manual_seed(5)
    loader = _loader(kind, workers, Counting(40))
    tracker = resume._LoaderTracker(loader, None)
    for epoch in range(2):
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        rest: list[list[int]] = []
        for i, b in enumerate(loader):
            if epoch == 1 and i == trained:
                pos = tracker.position()
            if epoch == 1 and i >= trained:
                rest.append(b.flatten().tolist())
            else:
                tracker.step_done()  # the optimizer step of this batch
    return pos, rest


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["shuffle", "generator", "distributed"])
def test_skip_resumes_the_epoch_where_it_was(kind, workers):
    pos, expected = _run_original(kind, workers, trained=3)
    assert pos["consumed"] == 3 and len(expected) == (20 if kind == "distributed" else 40) // 4 - 3
    torch.manual_seed(999)  # the restarted process: another global RNG state
    data = Counting(40)
    loader = _loader(kind, workers, data)
    if kind == "generator":
        loader.generator.manual_seed(77)  # and another generator state
    tracker = resume._LoaderTracker(loader, None)
    tracker.resume = pos
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(1)
    probe = next(iter(loader)).flatten().tolist()  # the tutorial's `next(iter(loader))` probe
    got = [b.flatten().tolist() for b in loader]
    assert probe == expected[0]
    assert got == expected
    assert len(loader) == len(expected) + 3  # len() still counts the whole epoch
    if workers == 0:
        # the skipped batches' samples were never loaded (probe: 1 batch, epoch: the rest)
        assert data.loaded == 4 * (1 + len(expected))


def test_skip_is_not_vacuous():
    """Without the saved position a restarted loader yields another epoch."""
    pos, expected = _run_original("shuffle", 0, trained=3)
    torch.manual_seed(999)
    loader = _loader("shuffle", 0, Counting(40))
    resume._LoaderTracker(loader, None)
    assert [b.flatten().tolist() for b in loader] != expected


def test_rng_snapshot_round_trip(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    snap = resume._portable(resume._rng_snapshot())
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.save(snap, tmp_path / "rng.pt")
    torch.manual_seed(100)
    np.random.seed(100)
    random.seed(100)
    resume._rng_restore(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


def _objects(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    return model, opt, sched


def test_resumable_restores_everything_from_a_replica(tmp_path, monkeypatch):
    """Session A trains 3 steps and saves at the start of the 4th (as the JIT
    save would); resumable() in a fresh 'process' B restores the objects and
    counters at once and the RNG at its first minibatch start."""
    model, opt, sched = _objects(0)
    state = {"epoch": 2, "note": "x"}
    a = resume._Session({"model": model, "optimizer": opt, "scheduler": sched}, state, [])
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
    state["epoch"] = 3
    a.on_minibatch_start()  # the runtime's minibatch boundary: RNG and counters as of now
    want_rng = torch.rand(5)  # what the minibatch draws
    root = tmp_path / "jit"
    stage = layout.staging_dir(root, 3, "0", 0)
    a.save(str(stage))
    layout.publish(stage, root=root, step=3, shard="0", rank=0, world_size=1, job_id="j")

    monkeypatch.setenv("JITCKPT_DIR", str(root))
    monkeypatch.setenv("JITCKPT_JOB_ID", "j")
    monkeypatch.setattr(api, "_runtime", None)  # the restarted process reads its environment afresh
    model2, opt2, sched2 = _objects(1)
    counters = {"epoch": 0}
    assert jitckpt_resumable(model=model2, optimizer=opt2, scheduler=sched2, state=counters) is counters
    assert counters == {"epoch": 3, "note": "x"}
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k])
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg_sq"], opt2.state_dict()["state"][0]["exp_avg_sq"])
    assert sched2.state_dict() == sched.state_dict()
    torch.manual_seed(1234)  # drawn between restore and the first minibatch (a loader seed): must not matter
    api._get_runtime().listeners.fire(Event.MINIBATCH_START, False)
    assert torch.equal(torch.rand(5), want_rng)


def jitckpt_resumable(**kw):
    import jitckpt

    return jitckpt.resumable(**kw)


def test_resumable_argument_errors():
    with pytest.raises(TypeError, match="state_dict"):
        jitckpt_resumable(model=object())
    with pytest.raises(TypeError, match="nothing to checkpoint"):
        jitckpt_resumable()
    with pytest.raises(TypeError, match="dict"):
        jitckpt_resumable(model=torch.nn.Linear(1, 1), state=[0])
    jitckpt_resumable(model=torch.nn.Linear(1, 1))
    with pytest.raises(RuntimeError, match="already"):
        jitckpt_resumable(model=torch.nn.Linear(1, 1))


def test_checkpoint_from_other_objects_is_refused(tmp_path, monkeypatch):
    model, opt, _ = _objects(0)
    a = resume._Session({"model": model}, {}, [])
    a.on_minibatch_start()
    stage = tmp_path / "d"
    stage.mkdir()
    a.save(str(stage))
    b = resume._Session({"model": model, "optimizer": opt}, {}, [])
    with pytest.raises(RuntimeError, match="lacks"):
        b.load(str(stage))


def test_rng_snapshot_holds_no_ndarray():
    # weights_only=True loads what the snapshot holds: no ndarray inside
    snap = resume._portable(resume._rng_snapshot())
    assert not any(isinstance(v, np.ndarray) for v in (snap.get("numpy") or ()))



@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("trained", [0, 3])
def test_stateful_dataloader_position(workers, trained):
    """torchdata's StatefulDataLoader keeps its own position; jitckpt takes it
    where no batch is in flight (after an optimizer step, at a new iterator),
    not at the save, when the next minibatch's batch is already fetched."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> DataLoader:
        return sdl.StatefulDataLoader(Counting(40), batch_size=4, shuffle=True, num_workers=workers,
                                      generator=torch.Generator().manual_seed(3))

    loader = make()
    tracker = resume._StatefulLoaderTracker(loader)
    expected: list[list[int]] = []
    for epoch in range(2):
        for i, b in enumerate(loader):
            if epoch == 1 and i == trained:
                pos = tracker.position()
            if epoch == 1 and i >= trained:
                expected.append(b.flatten().tolist())
            else:
                tracker.step_done()
    loader2 = make()
    resume._StatefulLoaderTracker(loader2)
    loader2.load_state_dict(pos)
    assert [b.flatten().tolist() for b in loader2] == expected


class LazySampler(torch.utils.data.RandomSampler):
    """Creates its generator on its first ``__iter__``, as Accelerate's SeedableRandomSampler
    (Trainer's default) does; never reseeds it, so epoch 1's order depends on its state."""

    def __iter__(self):
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(7)
        yield from super().__iter__()


def _lazy_run(epoch: int, trained: int) -> tuple[dict, list[list[int]]]:
    torch.manual_seed(5)
    loader = DataLoader(Counting(40), batch_size=4, sampler=LazySampler(Counting(40)))
    tracker = resume._LoaderTracker(loader, None)
    for e in range(epoch + 1):
        rest: list[list[int]] = []
        for i, b in enumerate(loader):
            if e == epoch and i == trained:
                pos = tracker.position()
            if e == epoch and i >= trained:
                rest.append(b.flatten().tolist())
            else:
                tracker.step_done()
    return pos, rest


@pytest.mark.parametrize("epoch,eager", [(1, False), (0, True), (0, False)],
                         ids=["made-before-restart", "none-then-made-eagerly", "none-both"])
def test_lazily_created_sampler_generator(tmp_path, epoch, eager):
    """The checkpoint's iterator began with its sampler's generator already made (epoch 1) or not
    yet (epoch 0); the restarted sampler has none yet, or one made another way: either way the
    rest of the epoch is the original's (once a crash: the generators were matched by count)."""
    pos, expected = _lazy_run(epoch, trained=3)
    torch.save(pos, tmp_path / "pos.pt")  # through the checkpoint's own round trip
    pos = torch.load(tmp_path / "pos.pt", weights_only=True)
    torch.manual_seed(999)
    sampler = LazySampler(Counting(40))
    if eager:
        sampler.generator = torch.Generator().manual_seed(123)
    loader = DataLoader(Counting(40), batch_size=4, sampler=sampler)
    tracker = resume._LoaderTracker(loader, None)
    tracker.resume = pos
    got = [b.flatten().tolist() for b in loader]
    assert got == expected and len(got) == 7
    if epoch == 1 or eager:
        # not vacuous: the same restarted loader, not restored, yields another order
        sampler = LazySampler(Counting(40))
        if eager:
            sampler.generator = torch.Generator().manual_seed(123)
        other = DataLoader(Counting(40), batch_size=4, sampler=sampler)
        assert [b.flatten().tolist() for b in other][3:] != expected


def test_shared_generator_stays_shared():
    """DataLoader(generator=g) hands g to its RandomSampler: restored once, still one object."""
    loader = DataLoader(Counting(8), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))
    saved = resume_data._gen_states(loader)
    assert sum(v is not None and v[0] != "=" for v in saved.values()) == 1
    fresh = DataLoader(Counting(8), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(9))
    resume_data._set_gen_states(fresh, saved)
    assert fresh.generator is fresh.sampler.generator
    assert torch.equal(fresh.generator.get_state(), loader.generator.get_state())


def test_different_samplers_are_refused_not_crashed():
    """A loader whose samplers are not the checkpoint's: one clear error (a refusal under jitrun)."""
    pos, _ = _lazy_run(1, trained=3)
    loader = DataLoader(Counting(40), batch_size=4)  # sequential: no sampler generator
    tracker = resume._LoaderTracker(loader, None)
    tracker.resume = pos
    with pytest.raises(RuntimeError, match="samplers differ from the checkpoint"):
        iter(loader)
