"""A failure episode's state machine and the agent's book of episodes
(launcher/recovery/failure.py), and the modules that move it (episode.py,
reports.py, detect.py): pure parts, no processes."""

from __future__ import annotations

import pytest

from jitckpt.wire.config import EXIT_DIVERGED, EXIT_REFUSED, EXIT_SAVED
from jitrun.recovery.detect import Detector
from jitrun.recovery.episode import Episode
from jitrun.recovery.failure import Failure, IllegalTransition, RecoveryBook, Stage
from jitrun.recovery.reports import ReportBook
from jitrun.workers import Proc


class _Events:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event: str, **fields) -> None:
        self.events.append({"event": event, **fields})


def _stopped(saved: dict[int, dict] | None = None) -> Failure:
    f = Failure(10.0)
    f.saving_started()
    f.saved.update(saved or {})
    f.stopped(12.0)
    return f


def _at(stage: Stage) -> Failure:
    """A failure moved along the legal path up to ``stage``."""
    f = Failure(10.0)
    steps = [f.saving_started, lambda: f.stopped(12.0), lambda: f.decided(4), lambda: f.restarted(13.0), f.resumed]
    for step in steps[:stage.value - 1]:
        step()
    assert f.stage is stage
    return f


def test_the_legal_path_sets_each_stage_and_its_time():
    f = Failure(10.0)
    assert f.stage is Stage.DETECTED
    f.saving_started()
    assert f.stage is Stage.SAVING
    f.saved[0] = {"shard": "0", "step": 4}
    f.stopped(12.0)
    assert (f.stage, f.stopped_t) == (Stage.STOPPED, 12.0)
    f.decided(4)
    assert (f.stage, f.restore_step) == (Stage.DECIDED, 4)
    f.restarted(13.0)
    assert (f.stage, f.restart_t) == (Stage.RESTARTED, 13.0)
    f.note_rendezvous(13.5)
    assert f.rdzv_t == 13.5
    f.resumed()
    assert f.stage is Stage.RESUMED


def test_stop_completes_the_checkpoint_only_when_something_was_saved_and_no_report_completed_it():
    assert _stopped({0: {"shard": "0", "step": 4}}).ckpt_done_t == 12.0
    assert _stopped().ckpt_done_t is None
    f = Failure(10.0)
    f.saving_started()
    f.saved[0] = {"shard": "0", "step": 4}
    f.ckpt_done_t = 11.0  # a report completed the saved set before the stop
    f.stopped(12.0)
    assert f.ckpt_done_t == 11.0


MOVES = {
    Stage.SAVING: lambda f: f.saving_started(),
    Stage.STOPPED: lambda f: f.stopped(1.0),
    Stage.DECIDED: lambda f: f.decided(3),
    Stage.RESTARTED: lambda f: f.restarted(1.0),
    Stage.RESUMED: lambda f: f.resumed(),
}


@pytest.mark.parametrize("frm", list(Stage), ids=lambda s: s.name)
@pytest.mark.parametrize("to", list(MOVES), ids=lambda s: s.name)
def test_every_move_but_to_the_next_stage_raises_naming_both(frm: Stage, to: Stage):
    f = _at(frm)
    if to.value == frm.value + 1:
        MOVES[to](f)
        assert f.stage is to
        return
    with pytest.raises(IllegalTransition) as e:
        MOVES[to](f)
    assert f"{frm.name} -> {to.name}" in str(e.value)
    assert f.stage is frm  # a refused move changes nothing
    assert (f.restore_step, f.restart_t) == ((4 if frm.value >= Stage.DECIDED.value else None),
                                             (13.0 if frm.value >= Stage.RESTARTED.value else None))


def test_a_rendezvous_is_noted_only_on_a_restarted_episode():
    f = _at(Stage.DECIDED)
    with pytest.raises(IllegalTransition, match="DECIDED -> rendezvous"):
        f.note_rendezvous(1.0)
    assert f.rdzv_t is None


def test_exits_say_who_will_not_save_and_why():
    f = Failure(1.0)
    f.note_exit(0, EXIT_SAVED)
    f.note_exit(1, -9)
    assert f.done == {0, 1} and f.reasons == {1: "exit -9"}
    assert not (f.diverged or f.refused)
    f.note_exit(2, EXIT_DIVERGED)
    assert f.diverged and not f.refused
    f.note_exit(3, EXIT_REFUSED)
    assert f.refused
    f.reasons[4] = "sigterm"
    f.note_exit(4, 1)
    assert f.reasons[4] == "sigterm"  # the first reason stands


def test_the_job_facts_take_the_earliest_fault_and_the_furthest_progress():
    f = Failure(10.0, fault_t=9.0, progress=5)
    f.note_job_facts(3, 8.5, None)
    assert (f.progress, f.fault_t) == (5, 8.5)
    f.note_job_facts(7, 9.5, 1.0)
    assert (f.progress, f.fault_t) == (7, 8.5)
    g = Failure(10.0)
    g.note_job_facts(-1, None, 11.0)  # a last sign of life after the detection: the detection stands
    assert g.fault_t == 10.0
    g.note_fault_at(3.0)
    assert g.fault_t == 10.0
    h = Failure(10.0)
    h.note_fault_at(None)
    h.note_fault_at(4.0)
    assert h.fault_t == 4.0


def test_the_book_moves_an_episode_from_detection_through_restart_to_resumed():
    book = RecoveryBook()
    assert book.resumed() is None  # nothing restarted
    f = Failure(1.0)
    book.detected(f)
    assert book.current is f
    book.exited.update({0: EXIT_SAVED, 1: -9})
    f.saving_started()
    f.stopped(2.0)
    f.decided(3)
    assert book.restarted(5.0) is f
    assert (book.current, book.pending, book.exited, f.stage) == (None, f, {}, Stage.RESTARTED)
    book.rendezvous_done(6.0)
    assert f.rdzv_t == 6.0
    assert book.resumed() is f
    assert f.stage is Stage.RESUMED
    assert book.resumed() is None  # its record is written once
    book.rendezvous_done(7.0)  # nothing waits: nothing to note
    assert f.rdzv_t == 6.0


def test_a_restart_without_a_failure_keeps_the_pending_one_and_forgets_exits():
    book = RecoveryBook()
    f = _at(Stage.DECIDED)
    book.current = f
    book.restarted(5.0)
    book.exited[0] = 0
    assert book.restarted(6.0) is None  # a node joined: not a failure's restart
    assert book.pending is f and book.exited == {}
    assert f.restart_t == 5.0


def test_a_second_restart_replaces_an_episode_that_never_resumed():
    book = RecoveryBook()
    first, second = _at(Stage.DECIDED), Failure(7.0)
    book.current = first
    book.restarted(5.0)
    book.detected(second)  # the restarted round failed before its first minibatch
    second.saving_started()
    second.stopped(7.5)
    second.decided(None)
    book.restarted(8.0)
    assert book.pending is second
    assert book.resumed() is second and first.stage is Stage.RESTARTED


def test_the_book_refuses_an_episode_over_another_or_an_old_one():
    book = RecoveryBook()
    f = Failure(1.0)
    book.detected(f)
    f.saving_started()
    with pytest.raises(IllegalTransition, match="SAVING -> DETECTED"):
        book.detected(Failure(2.0))
    assert book.current is f
    book.current = None
    with pytest.raises(IllegalTransition, match="SAVING -> DETECTED"):
        book.detected(f)
    assert book.current is None


def test_a_restart_of_an_undecided_episode_raises_and_keeps_it():
    book = RecoveryBook()
    f = _stopped()
    book.current = f
    book.exited[0] = 75
    with pytest.raises(IllegalTransition, match="STOPPED -> RESTARTED"):
        book.restarted(5.0)
    assert (book.current, book.pending, book.exited) == (f, None, {0: 75})


def test_only_a_stopped_episode_ends_in_a_finished_job():
    book = RecoveryBook()
    with pytest.raises(IllegalTransition, match=r"\(no episode\) -> finished"):
        book.finished()
    f = Failure(1.0)
    book.detected(f)
    f.saving_started()
    with pytest.raises(IllegalTransition, match="SAVING -> finished"):
        book.finished()
    f.stopped(2.0)
    book.finished()
    assert book.current is None and book.pending is None


def test_a_preemption_reads_into_the_current_episode_else_a_new_one():
    book = RecoveryBook()
    f = book.preempted(3.0)
    assert (book.current, f.detected_t, f.stage) == (f, 3.0, Stage.DETECTED)
    assert book.preempted(4.0) is f
    g = _at(Stage.DECIDED)
    book.current = g
    assert book.preempted(5.0) is g and g.stage is Stage.DECIDED  # wherever it stands


def _report(book: ReportBook, f: Failure | None, **m) -> None:
    book.absorb({"attempt": 1, "t": 5.0, **m}, f, lambda _m: None)


def test_reports_fill_the_current_episode():
    book = ReportBook(_Events())
    book.new_round(1, {0, 1})
    _report(book, None, event="registered", rank=0, shard="a")
    _report(book, None, event="registered", rank=1, shard="b")
    f = Failure(10.0)
    _report(book, f, event="failure_detected", rank=0, step=6, reason="sigterm", t=9.0, minibatch_s=0.5)
    _report(book, f, event="failure_detected", rank=1, step=6, reason="sdc_suspect", t=9.5)
    assert (f.detected_t, f.progress, f.rank_step, f.minibatch_s) == (9.0, 6, {0: 6, 1: 6}, [0.5])
    assert f.reasons == {0: "sigterm", 1: "sdc_suspect"} and f.stop_reports == {0: ("sigterm", 9.0)}
    _report(book, f, event="save_started", rank=0, step=6)
    _report(book, f, event="checkpoint_saved", rank=0, step=6, shard="a", t=11.0)
    assert f.saving == set() and f.ckpt_done_t is None  # shard b has no replica yet
    _report(book, f, event="checkpoint_failed", rank=1, no_space=True, error="disk full")
    assert f.done == {1} and f.no_space == "disk full" and f.responded == {0, 1}
    _report(book, f, event="failure_detected", rank=1, step=9, t=1.0, attempt=0)  # an earlier round's, read late
    assert (f.detected_t, f.progress) == (9.0, 6)
    g = Failure(10.0)
    _report(book, g, event="checkpoint_saved", rank=0, step=6, shard="a", t=11.0)
    _report(book, g, event="checkpoint_saved", rank=1, step=6, shard="b", t=12.0)
    assert g.ckpt_done_t == 12.0  # every shard of this node saved


def test_a_detected_hang_names_its_ranks_and_the_injected_fault():
    book = ReportBook(_Events())
    book.new_round(1, {0, 1})
    d, procs = Detector(book, _Events()), _procs({0: 0, 1: 0})  # pid 0: not looked at as a process
    assert d.check([{"event": "fault_injected", "t": 3.0, "step": 7, "attempt": 1}], {0: None, 1: None},
                   procs, False) is None
    f = d.check([], {0: None, 1: None}, procs, False, hung={0: "stopped", 1: "slow"})
    assert f is not None and f.stage is Stage.DETECTED
    assert (f.fault_t, f.progress) == (3.0, 7)
    assert f.reasons == {0: "hang: stopped", 1: "hang: slow"} and f.done == {0}
    g = d.check([], {0: 1, 1: None}, procs, False)
    assert g is not None and (g.fault_t, g.progress) == (None, -1)  # the fault's stamp went to one episode


def _unsignalled(sig: int) -> None:
    raise AssertionError(f"a worker that already exited was sent signal {sig}")


def _procs(codes: dict[int, int]) -> dict[int, Proc]:
    """Workers that already exited with ``codes``; pid 0 with ``send``: never a signal to a real process."""
    return {r: Proc(pid=0, poll=lambda c=c: c, wait=lambda: None, send=_unsignalled, rank=r)
            for r, c in codes.items()}


def _episode(f: Failure, codes: dict[int, int], exited: dict[int, int], events: _Events) -> Episode:
    def poll() -> None:
        f.note_report("checkpoint_saved", 0, {"shard": "0", "step": 3, "t": 20.0}, lambda: ["0"])

    return Episode(f, _procs(codes), exited=exited, shards={0: "0", 1: "0"}, timeout_s=1.0, save_timeout_s=1.0,
                   wait=lambda pids, s: None, poll=poll, events=events)


def test_an_episode_moves_its_failure_from_detected_to_stopped():
    f, exited, events = Failure(10.0), {}, _Events()
    _episode(f, {0: EXIT_SAVED, 1: -9}, exited, events).run()
    assert f.stage is Stage.STOPPED and f.stopped_t is not None
    assert exited == {0: EXIT_SAVED, 1: -9} and f.done == {0, 1} and f.reasons == {1: "exit -9"}
    assert f.ckpt_done_t == 20.0  # the saver's report read at the stop completed the checkpoint
    assert [e["rank"] for e in events.events if e["event"] == "worker_exit"] == [0, 1]
    with pytest.raises(IllegalTransition, match="STOPPED -> SAVING"):
        _episode(f, {0: EXIT_SAVED}, {}, _Events()).run()  # an episode runs once
