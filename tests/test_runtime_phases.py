"""Unit tests for jitckpt.runtime: the phase machine, save triggers and the JIT save.

The Runtime is built from a WorkerConfig with no token, so it has no store and
installs nothing; ``_save_and_exit`` (which would ``os._exit``) is replaced by a
recorder that raises.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from jitckpt.collective_errors import find_collective_error, is_collective_error
from jitckpt.faults import InjectedFault
from jitckpt.listeners import Event
from jitckpt.runtime import Phase, Runtime
from jitckpt.wire import layout
from jitckpt.wire.config import WorkerConfig
from jitckpt.wire.contract import RestorePlan


class SaveCalled(Exception):
    pass


def _cfg(root: Path | None = None, **kw) -> WorkerConfig:
    base = dict(root=root, job_id="job-rt", token="", timeout_s=5.0, rank=0, world_size=2, restart_count=0,
                plan=RestorePlan(), store_addr=None, fault_spec="")
    base.update(kw)
    return WorkerConfig(**base)


@pytest.fixture
def rt(tmp_path, monkeypatch):
    calls: list[tuple[str, Phase]] = []

    def fake_save_and_exit(self, reason, phase, announced=False):
        calls.append((reason, phase))
        raise SaveCalled(reason)

    monkeypatch.setattr(Runtime, "_save_and_exit", fake_save_and_exit)
    r = Runtime(_cfg(tmp_path))
    r.saves = calls
    return r


def _minibatch(rt: Runtime, n_optimizers: int = 1) -> None:
    rt.on_forward()
    rt.on_backward(None)
    for _ in range(n_optimizers):
        rt.on_optimizer_pre()
        rt.on_optimizer_post()


# --- phases ---------------------------------------------------------------------------


def test_phase_transitions_and_step_count(rt):
    assert rt.phase is Phase.INIT and rt.steps_done == 0
    rt.on_forward()
    assert rt.phase is Phase.FWD
    rt.on_backward(None)
    assert rt.phase is Phase.BWD
    rt.on_optimizer_pre()
    assert rt.phase is Phase.OPT and rt.steps_done == 0
    rt.on_optimizer_post()
    assert rt.phase is Phase.POST and rt.steps_done == 1
    _minibatch(rt)
    _minibatch(rt)
    assert rt.steps_done == 3
    assert rt.saves == []


def test_two_optimizers_in_one_minibatch_count_once(rt):
    _minibatch(rt, n_optimizers=2)
    assert rt.steps_done == 1
    _minibatch(rt, n_optimizers=3)
    assert rt.steps_done == 2


def test_optimizer_without_forward_counts_each_step(rt):
    # e.g. a loop whose forward is not DDP-wrapped: backward alone separates minibatches
    for _ in range(3):
        rt.on_backward(None)
        rt.on_optimizer_pre()
        rt.on_optimizer_post()
    assert rt.steps_done == 3


def test_training_start_callback_runs_once(rt):
    calls = []
    rt.listeners.add(Event.TRAINING_START, lambda: calls.append(1))
    rt.on_forward()
    rt.on_forward()
    _minibatch(rt)
    assert calls == [1]


def test_listeners_in_order_first_first_and_removable_while_called():
    from jitckpt.listeners import Listeners

    seen: list[str] = []
    ls = Listeners()

    def once(p: bool) -> None:
        ls.remove(Event.MINIBATCH_START, once)
        seen.append(f"once-{p}")

    ls.add(Event.MINIBATCH_START, lambda p: seen.append(f"a-{p}"))
    ls.add(Event.MINIBATCH_START, lambda p: seen.append(f"b-{p}"))
    ls.add(Event.MINIBATCH_START, once, first=True)
    ls.fire(Event.MINIBATCH_START, True)
    ls.fire(Event.MINIBATCH_START, False)
    assert seen == ["once-True", "a-True", "b-True", "a-False", "b-False"]
    ls.remove(Event.MINIBATCH_START, once)  # gone already: nothing to do
    assert not ls.has(Event.SNAPSHOT) and ls.has(Event.MINIBATCH_START)
    ls.add(Event.TRAINING_START, lambda: seen.append("t"))
    ls.fire_once(Event.TRAINING_START)
    ls.fire_once(Event.TRAINING_START)
    assert seen[-1] == "t" and seen.count("t") == 1 and not ls.has(Event.TRAINING_START)


def test_collective_in_post_starts_next_minibatch(rt):
    _minibatch(rt)
    assert rt.phase is Phase.POST
    rt.on_collective()
    assert rt.phase is Phase.FWD
    rt.on_backward(None)
    rt.on_collective()  # a collective inside backward keeps the phase
    assert rt.phase is Phase.BWD


# --- save triggers --------------------------------------------------------------------


@pytest.mark.parametrize("where", ["optimizer", "post"])
@pytest.mark.parametrize("next_hook", ["forward", "collective", "backward"])
def test_request_save_deferred_in_opt_and_post(rt, where, next_hook):
    _minibatch(rt)  # steps_done 1
    rt.on_forward()
    rt.on_backward(None)
    rt.on_optimizer_pre()
    if where == "post":
        rt.on_optimizer_post()
    assert rt.request_save("sigterm") is False
    assert rt.deferred == "sigterm" and rt.saves == [] and not rt.saving
    assert rt.request_save("collective_error") is False
    assert rt.deferred == "sigterm"  # the first reason is kept
    if where == "optimizer":
        rt.on_optimizer_post()  # the optimizer step runs to completion
        assert rt.saves == []
    assert rt.steps_done == 2
    with pytest.raises(SaveCalled):
        {"forward": rt.on_forward, "collective": rt.on_collective,
         "backward": lambda: rt.on_backward(None)}[next_hook]()
    # a plain collective after the step is marked post-step: its label must be
    # confirmed by save_fn (checkpoint_step()) before it can be restored
    assert rt.saves == [("sigterm", Phase.POST if next_hook == "collective" else Phase.FWD)]
    assert rt.saving
    assert rt.steps_done == 2  # the checkpoint is of the start of the next minibatch


@pytest.mark.parametrize("phase_hooks, phase", [
    (("on_forward",), Phase.FWD),
    (("on_forward", "on_backward"), Phase.BWD),
])
def test_request_save_in_fwd_bwd_is_immediate(rt, phase_hooks, phase):
    _minibatch(rt)
    for h in phase_hooks:
        getattr(rt, h)(*(() if h == "on_forward" else (None,)))
    with pytest.raises(SaveCalled):
        rt.request_save("sigterm")
    assert rt.saves == [("sigterm", phase)]
    assert rt.saving and rt.deferred is None


def test_request_save_before_training_saves_as_init(rt):
    with pytest.raises(SaveCalled):
        rt.request_save("sigterm")
    assert rt.saves == [("sigterm", Phase.INIT)]


@pytest.mark.parametrize("next_hook", ["ddp-forward", "forward", "collective", "backward"])
def test_a_failed_migration_is_saved_where_the_rank_paused(rt, store, next_hook):
    """A migration that fails leaves this rank's groups and DDP's reducer torn down. The
    save must come at that minibatch start, before DDP's ``_pre_forward`` (its buffer
    broadcast), a collective or backward runs on what is gone: not when a stop signal from
    the agent happens to arrive first."""
    from jitckpt import migrate_worker as mw
    from jitrun.migration import control as migrate

    _minibatch(rt)
    sent: list[tuple[str, dict]] = []
    rt.reporter = SimpleNamespace(send=lambda event, **fields: sent.append((event, fields)))
    rt._migration = mw.Watch(store, "tok")
    gen = migrate.request(store, "tok", rank=1, to="nowhere")  # a peer moves; this rank waits for it
    migrate.put(store, "tok", "transfer failed: no agent there", gen, "failed")
    assert rt._migration.poll(0) is None  # seen during minibatch 0: the pause is at the start of 1
    with pytest.raises(SaveCalled, match="migration failed"):
        {"ddp-forward": lambda: rt.on_forward(body_follows=True), "forward": rt.on_forward,
         "collective": rt.on_collective, "backward": lambda: rt.on_backward(None)}[next_hook]()
    # at a plain collective after the step, as any save there: labelled post-step
    assert rt.saves == [(rt.deferred, Phase.POST if next_hook == "collective" else Phase.FWD)]
    assert rt.steps_done == 1
    assert migrate.paused_ranks(store, "tok", gen, 1) == [0]  # it did pause (told its agent), then saved
    assert [f["reason"] for e, f in sent if e == "failure_detected"] == ["migration_failed"]


def test_no_migration_request_takes_no_save(rt, store):
    from jitckpt import migrate_worker as mw

    _minibatch(rt)
    rt._migration = mw.Watch(store, "tok")
    rt.on_forward(body_follows=True)
    rt.on_forward_body()
    assert rt.saves == [] and rt.deferred is None


def test_on_collective_error_saves_now_in_backward(rt):
    rt.on_forward()
    rt.on_backward(None)
    with pytest.raises(SaveCalled):
        rt.on_collective_error(RuntimeError("gloo: Connection closed by peer"))
    assert rt.saves == [("collective_error", Phase.BWD)]


def test_second_trigger_while_saving_parks(rt):
    rt.on_forward()
    with pytest.raises(SaveCalled):
        rt.request_save("sigterm")
    returned = []
    t = threading.Thread(target=lambda: returned.append(rt.request_save("hang")), daemon=True)
    t.start()
    t.join(timeout=0.5)
    # the thread is parked on _halt for good (daemon; never proceeds to a second save)
    assert returned == [] and rt.saves == [("sigterm", Phase.FWD)]


def test_optimizer_entry_while_saving_parks(rt):
    # a save owned by another thread: the main thread must not write parameters
    rt.on_forward()
    rt.saving = True
    entered = []

    def step():
        rt.on_optimizer_pre()
        entered.append(rt.phase)

    t = threading.Thread(target=step, daemon=True)
    t.start()
    t.join(timeout=0.5)
    assert entered == [] and rt.phase is Phase.FWD


# --- a collective error a framework would catch ------------------------------------------

PEER_GONE = "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed by peer"


class Exited(Exception):
    pass


@pytest.fixture
def managed(rt, monkeypatch):
    """``rt`` as under jitrun (a token), with os._exit recorded instead of taken."""
    codes: list[int] = []

    def fake_exit(code):
        codes.append(code)
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    rt.cfg = _cfg(rt.cfg.root, token="job-token")
    rt.exits = codes
    return rt


def test_collective_error_in_the_optimizer_step_leaves_unsaved(managed):
    rt = managed
    _minibatch(rt)
    rt.on_forward()
    rt.on_backward(None)
    rt.on_optimizer_pre()
    with pytest.raises(Exited):
        rt.on_collective_error(RuntimeError(PEER_GONE))
    assert rt.exits == [76] and rt.saves == [] and rt.saving  # parameters partly written: no save


def test_collective_error_after_the_step_is_saved_at_the_script_end(managed):
    rt = managed
    snapshots = []
    rt.listeners.add(Event.MINIBATCH_START, lambda provisional=False: snapshots.append(rt.steps_done))
    _minibatch(rt)
    err = RuntimeError(PEER_GONE)
    rt.on_collective_error(err)  # e.g. a Work.wait after the step: deferred to the next minibatch start
    rt.on_collective_error(err)  # the same error seen again further up
    assert rt.deferred == "collective_error" and rt.saves == [] and rt.collective_exc is err
    # ... which never comes: the exception ended the training, a catcher calls sys.exit(1)
    try:
        try:
            raise err
        except RuntimeError:
            raise SystemExit(1) from None
    except SystemExit as e:
        ended = e
    with pytest.raises(SaveCalled):
        rt.script_ended(ended)
    assert rt.saves == [("collective_error", Phase.POST)] and snapshots == [0, 1]  # the snapshot of step 1 first


def test_script_end_finds_the_error_a_catcher_swallowed(managed):
    rt = managed
    _minibatch(rt)
    rt.on_forward()
    try:
        try:
            raise RuntimeError(PEER_GONE)  # raised where no hook saw it
        except RuntimeError:
            raise SystemExit(1)  # noqa: B904 - what Hydra and a try/except around main() do
    except SystemExit as e:
        ended = e
    with pytest.raises(SaveCalled):
        rt.script_ended(ended)
    assert rt.saves == [("collective_error", Phase.FWD)]


@pytest.mark.parametrize("exc", [None, SystemExit(0), SystemExit(1), ValueError("bad input")])
def test_script_end_without_a_collective_error_does_nothing(managed, exc):
    rt = managed
    _minibatch(rt)
    rt.request_save("sigterm")  # deferred, no collective failed: the script's own end stands
    rt.script_ended(exc)
    assert rt.saves == [] and rt.exits == []


def test_script_end_outside_jitrun_does_nothing(rt):
    _minibatch(rt)
    rt.on_forward()
    try:
        raise SystemExit(1) from RuntimeError(PEER_GONE)
    except SystemExit as e:
        rt.script_ended(e)
    assert rt.saves == []


def test_find_collective_error_follows_cause_and_context():
    err = RuntimeError(PEER_GONE)
    wrapped = ValueError("job failed")
    wrapped.__cause__ = err
    assert find_collective_error(wrapped) is err
    outer = SystemExit(1)
    outer.__context__ = wrapped
    assert find_collective_error(outer) is err
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a  # a cycle ends the walk
    assert find_collective_error(a) is None and find_collective_error(None) is None


def test_wait_guard_acts_only_in_the_main_thread_once_training_started(managed, monkeypatch):
    from jitckpt import hooks

    rt = managed
    seen = []
    monkeypatch.setattr(rt, "on_collective_error", lambda e: seen.append(threading.current_thread().name))

    def failing_wait(self):
        raise RuntimeError(PEER_GONE)

    wait = hooks._wait_guard(rt, failing_wait)
    with pytest.raises(RuntimeError):
        wait(None)  # INIT: jitckpt's own EC restore handles its errors
    rt.on_forward()
    t = threading.Thread(target=lambda: pytest.raises(RuntimeError, wait, None), name="jitckpt-ec")
    t.start()
    t.join()
    assert seen == []
    with pytest.raises(RuntimeError):
        wait(None)
    assert seen == ["MainThread"]


# --- is_collective_error ----------------------------------------------------------------


@pytest.mark.parametrize("exc", [
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:53412: "
                 "Connection reset by peer"),
    RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                 "Timed out waiting 3000ms for recv operation to complete"),
    RuntimeError("[/pytorch/third_party/gloo/gloo/allreduce.cc:155] Application timeout caused pair closure"),
    RuntimeError("NCCL communicator was aborted on rank 1"),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited"),
    dist.DistError("store timeout"),
], ids=["gloo-reset", "gloo-timeout", "gloo-closure", "nccl", "DistBackendError", "DistError"])
def test_is_collective_error_true(exc):
    assert is_collective_error(exc)


@pytest.mark.parametrize("exc", [
    InjectedFault("injected fault at rank 1 step 2 phase allreduce"),
    InjectedFault("NCCL look-alike text in an injected fault"),
    ValueError("third_party/gloo"),
    RuntimeError("shape mismatch"),
    KeyboardInterrupt(),
], ids=["injected", "injected-with-marker", "ValueError", "shape", "KeyboardInterrupt"])
def test_is_collective_error_false(exc):
    assert not is_collective_error(exc)


# --- the real JIT save (no exit) -----------------------------------------------------------


def test_jit_save_publishes_verified_replica(tmp_path):
    cfg = _cfg(tmp_path / "jit", job_id="job-save", rank=1, world_size=4)
    rt = Runtime(cfg)
    rt.shard = "s0"
    rt.steps_done = 6
    seen = []

    def save_fn(d: str) -> None:
        seen.append(d)
        assert not Path(d).name.startswith("rank-")  # staged under a temporary name
        Path(d, "model.pt").write_bytes(b"model")
        Path(d, "optim.pt").write_bytes(b"optim")

    rt.save_fn = save_fn
    umask = os.umask(0o022)
    os.umask(umask)
    rt._jit_save()
    assert os.umask(umask) == umask  # restored

    final = layout.replica_dir(cfg.root, 6, "s0", 1)
    r = layout.verify(final, "job-save")
    assert isinstance(r, layout.Replica), r
    assert (r.step, r.shard, r.rank) == (6, "s0", 1)
    m = json.loads((final / layout.MANIFEST).read_text())
    assert (m["step"], m["rank"], m["shard"], m["world_size"], m["job_id"]) == (6, 1, "s0", 4, "job-save")
    assert m["progress_step"] == 6
    assert set(m["files"]) == {"model.pt", "optim.pt"}
    assert len(seen) == 1 and not Path(seen[0]).exists()  # staging dir renamed into place


def test_jit_save_fault_in_save_phase_leaves_no_replica(tmp_path):
    """A save that fails leaves nothing: no replica, and its staging dir removed."""
    cfg = _cfg(tmp_path, fault_spec="rank=0,step=99,phase=save,kind=exception")
    rt = Runtime(cfg)
    rt.steps_done = 2
    rt.save_fn = lambda d: Path(d, "x").write_bytes(b"x")
    with pytest.raises(InjectedFault):
        rt._jit_save()
    good, bad = layout.scan(tmp_path, "job-rt")
    assert good == [] and bad == []
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("labels", [False, True])
def test_post_step_save_is_restorable_only_when_save_fn_reads_checkpoint_step(tmp_path, labels):
    """A save at a collective after the optimizer step with no minibatch start
    in between (a barrier after the loop) describes the state after the step;
    unless save_fn recorded checkpoint_step(), its label is refused."""
    from jitckpt import api

    r = Runtime(_cfg(tmp_path))

    def save_fn(d):
        if labels:
            api._runtime, old = r, api._runtime
            try:
                assert api.checkpoint_step() == 3
            finally:
                api._runtime = old
        Path(d, "state.pt").write_bytes(b"x")

    r.save_fn, r.steps_done = save_fn, 3
    r._jit_save("post-step")
    got = layout.verify(layout.replica_dir(tmp_path, 3, "0", 0), "job-rt")
    if labels:
        assert isinstance(got, layout.Replica)
    else:
        assert isinstance(got, str) and "step label unverified" in got
        assert layout.scan(tmp_path, "job-rt")[0] == []
