"""The ``recovery`` record of the timeline: how long each stage of one
recovery took and how much work was redone. Pure: built from a finished
Failure and the workers' start-up reports of the round that resumed."""

from __future__ import annotations

import statistics

from .failure import Failure
from .reports import ReportBook


def recovery_record(f: Failure, book: ReportBook, resumed_t: float) -> dict:
    """``f.fault_t`` must be set (the injector's stamp, else the failed
    process's last sign of life) or the detection time stands for it."""
    failure_t = f.fault_t if f.fault_t is not None else f.detected_t
    # what the ranks actually loaded, not the plan
    loaded = {v for v in book.loaded.values() if v is not None}
    restore: int | None
    if len(loaded) == 1:
        got = next(iter(loaded))
        restore = got if isinstance(got, int) else 0  # "fresh": from the start
    else:
        # no rank asked get_checkpoint_path(): the script restored on its
        # own (or not at all); what it redid is not known here
        restore = None
    assert f.restart_t is not None
    return {
        "failure_t": failure_t,
        "detection_s": round(f.detected_t - failure_t, 3),
        "checkpoint_s": round(f.ckpt_done_t - f.detected_t, 3) if f.ckpt_done_t is not None else None,
        "restart_to_resumed_s": round(resumed_t - f.restart_t, 3),
        "failure_to_resumed_s": round(resumed_t - failure_t, 3),
        "restore_step": restore,
        "progress_step": f.progress,
        # the minibatch in progress at the failure (index f.progress) and
        # every one after the restore step up to it are done again
        # (unknown when no rank reported its step before it stopped)
        "redone_minibatches": (max(f.progress + 1 - restore, 0)
                               if f.progress >= 0 and restore is not None else None),
        "minibatch_s": statistics.median(f.minibatch_s) if f.minibatch_s else None,
        "stages": _stages(f, book, failure_t, resumed_t),
        "fingerprint": verified_fingerprint(book),
    }


def verified_fingerprint(book: ReportBook) -> dict[str, str] | None:
    """Shard -> the state digest its replicas verified before the first step (jitckpt/verify/verifier.py);
    None when a rank reported none (checks off for the job, or a report lost)."""
    if not book.fingerprint or any(not isinstance(v, str) for v in book.fingerprint.values()):
        return None
    out: dict[str, str] = {}
    for r, fp in sorted(book.fingerprint.items()):
        shard = book.shards.get(r, "0")
        if out.setdefault(shard, fp) != fp:
            return None  # replicas that disagree never reach training: a report of another round
    return out


def _stages(f: Failure, book: ReportBook, failure_t: float, resumed_t: float) -> dict[str, float]:
    """Where the time between the failure and the first minibatch finished
    after the restart went, stage by stage; consecutive, so they add up to
    failure_to_resumed_s. A worker milestone is the slowest rank's: the job
    moves at the pace of its last rank."""
    def last(d: dict[int, float]) -> float | None:
        return max(d.values()) if d else None

    query, train = last(book.query), last(book.train)
    if query is None:  # a script that never asked for a checkpoint: all of it is its start-up
        query, train = train, None
    marks = [("detection", f.detected_t), ("checkpoint", f.ckpt_done_t), ("stop", f.stopped_t),
             ("decision", f.restart_t), ("rendezvous", f.rdzv_t), ("process_start", last(book.boot)),
             ("import_and_init", query), ("checkpoint_load", train),
             ("first_minibatch", resumed_t)]
    out: dict[str, float] = {}
    prev = failure_t
    for name, t in marks:
        if t is None:
            continue  # e.g. no checkpoint was taken, or the script never asked for one
        out[name] = round(max(t - prev, 0.0), 3)
        prev = max(prev, t)
    return out
