"""Replicas that prove themselves: the runtime's state checks across data-parallel replicas.

* **At the start** (after whatever restore this attempt did: a JIT replica,
  an EC decode, an older fallback, or none), before the first training step,
  the replicas compare state fingerprints (verify/fingerprint.py, verify/replica_check.py).
  A mismatch after a restore stops the job before a step is taken
  (``state_mismatch``, exit EXIT_DIVERGED, which jitrun never restarts),
  naming the ranks and the first differing tensor. The verified digest goes
  into the ``loaded`` report, and from there into the ``recovery`` record.
* **Every N minibatches** (``--jit-verify-every N``): at the start of the
  minibatch after the N-th optimizer step (the state is the one that step
  left, with every optimizer of the minibatch done) the replicas compare
  again. A state that verified is staged in host memory (the save_fn into
  this job's tmpfs directory). On a mismatch every rank publishes the staged
  state as its checkpoint and leaves with the JIT save's exit, so jitrun
  restarts the job and restores it: at most N minibatches are redone. With
  three or more replicas the ranks outside the majority are named
  (``sdc_suspect``, passed on to the scheduler hook as failing); with N = 1
  they take the majority's tensors in place instead and nothing is redone
  (the corrupted state was not used yet). A mismatch at the job's first
  periodic check is taken for replicas that legitimately differ
  (nondeterministic kernels): one line, and checking is off for the job.

What a check cannot see: a wrong gradient that was all-reduced, since every
replica applies it (README).
"""

from __future__ import annotations

import base64
import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from .. import tracked
from ..ec.schedule import interval_for
from ..runtime import Phase, Runtime
from ..wire import auth, contract, layout
from ..wire import config as _config
from . import replica_check
from .fingerprint import Fingerprint, compute, state_items, tensors_by_name, words

REPAIR_MAX_BYTES = 8 << 20  # a tensor sent through the store for a repair in place (records are <= 16 MiB)
FLAG = auth.Schema({"why": str})


class Verifier:
    def __init__(self, rt: Runtime, every: int, adaptive: bool = False) -> None:
        self.rt = rt
        self.every = every
        self.adaptive = adaptive
        # adaptive: the step of the next periodic check, agreed at the last one (every rank reads every
        # rank's proposal in the same records); None: at the multiples of ``every``
        self.next_at: int | None = None
        self._check_s: float | None = None  # what the last periodic check cost this rank (compare + stage)
        self.off = False
        self.ever_ok = False  # a periodic check of this job passed (a later mismatch is corruption)
        self.stage_pending = False
        self.staged: tuple[int, Path] | None = None  # (step, dir) of the last verified state
        self._prev_label: tuple | None = None
        self._checked_step = -1
        self._at_end = False

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def _store(self):
        return self.rt.reporter._store

    def fingerprint(self) -> Fingerprint:
        return compute(state_items(tracked.models(), tracked.optimizers()))

    def _timeout(self) -> float:
        """At the start ranks may be minutes apart (loading, a slow node); once training runs (or the
        script ended), a peer that does not post within the JIT timeout failed, as in a hung collective."""
        if self.rt.phase is Phase.INIT and not self._at_end:
            return max(600.0, self.rt.cfg.timeout_s)
        return self.rt.cfg.timeout_s

    def _flag(self, name: str) -> str | None:
        rec = auth.of(self.rt.cfg.token).get(self._store, f"verify {name} flag", "verify", name, schema=FLAG)
        return None if rec is None else rec["why"]

    def _set_flag(self, name: str, why: str) -> None:
        auth.of(self.rt.cfg.token).put(self._store, {"why": why}, "verify", name)

    def _compare(self, *label: object, propose: int | None = None) -> tuple[Fingerprint, replica_check.Verdict]:
        cfg = self.rt.cfg
        fp = self.fingerprint()
        full = (cfg.attempt, *label)
        try:
            verdict = replica_check.compare(self._store, cfg.token, full, cfg.rank, cfg.world_size,
                                            self.rt.shard, fp, self._timeout(), propose=propose)
        except replica_check.RecordTampered as e:
            self._refuse(str(e), {})
        if self._prev_label is not None:
            replica_check.forget(self._store, cfg.token, self._prev_label, cfg.rank)
        self._prev_label = full
        return fp, verdict

    def _say(self, msg: str) -> None:
        print(f"[jitckpt] rank {self.rt.cfg.rank}: {msg}", file=sys.stderr, flush=True)

    def _refuse(self, why: str, fields: dict) -> None:
        # at_step, not step: the agent reads a report's step as work done (the minibatch in progress)
        self.rt.report("state_mismatch", error=why, at_step=self.rt.steps_done, **fields)
        self._say(f"REFUSING TO TRAIN: {why}")
        os._exit(_config.EXIT_DIVERGED)

    # -- at the start --------------------------------------------------------------------------

    def at_start(self, loaded: dict[int, object]) -> str | None:
        """Before the first training step: the replicas' states agree, or the job stops here.
        Returns this rank's verified digest (None when checking is off for the job)."""
        off = self._flag("off")
        if off is not None:
            self.off = True
            self._say(f"replica state checks are off for this job: {off}")
            return None
        self.ever_ok = self._flag("ok") is not None
        restored = self.rt.cfg.attempt > 0 or any(type(v) is int for v in loaded.values())
        _, verdict = self._compare("start")
        if not verdict.ok:
            if not restored:
                self._turn_off(verdict, "at the start")
                return None
            self._refuse(f"the replicas restored different states ({verdict.describe()}); training on would "
                         "mix them. No training step was taken. Check the replicas this attempt loaded "
                         "(events: loaded, restore_fallback) and the jit dirs of every node",
                         {"mismatch": _fields(verdict)})
        if self.every > 0 and self.ever_ok:
            # a mismatch at the next check is corruption (not replicas that differ by nature): keep
            # the state just verified to roll back to; a replica restored here is that state already
            loaded_here = self.rt.loaded_path is not None and type(self.rt.loaded) is int
            if loaded_here and self.rt.loaded == self.rt.steps_done:
                self.staged = (self.rt.steps_done, Path(self.rt.loaded_path))
            else:
                self.stage_pending = True
        return verdict.digests.get(self.rt.shard)

    def at_end(self) -> str | None:
        """The script ended without a training step after its restore (restored after the last
        minibatch): the replicas compare once, so the result written from that state is verified
        too. A peer that does not post within the JIT timeout leaves it unverified (None)."""
        rt = self.rt
        if self.off or rt._checked or not rt.restored or rt.reporter is None:
            return None
        rt._checked = self._at_end = True
        try:
            _, verdict = self._compare("end")
        except Exception as e:  # a peer that failed at its end: nothing trains on, say it
            self._say(f"the replicas' states were not compared at the end: {type(e).__name__}: {e}")
            return None
        if not verdict.ok:
            self._refuse(f"the replicas restored different states ({verdict.describe()}) and the script "
                         "ended on them", {"mismatch": _fields(verdict)})
        return verdict.digests.get(rt.shard)

    def _turn_off(self, verdict: replica_check.Verdict, when: str) -> None:
        why = (f"the replicas' states differed {when} ({verdict.describe()}), as replicas of a job with "
               "nondeterministic kernels or per-rank state do; a job's replicas are checked only when they "
               "agree from the start")
        self.off = True
        if self.rt.cfg.rank == 0:
            self._set_flag("off", why)
            self.rt.report("verify_off", step=self.rt.steps_done, why=why)
        self._say(f"replica state checks turned off for this job: {why}")

    def after_migration(self, gen: int) -> str | None:
        """Every rank at the minibatch start where migration ``gen`` put the moved ranks back
        (restored from their CRIU images): the replicas compare again, and a mismatch is handled
        as at a periodic check (repaired, rolled back to the staged state, or refused). This
        rank's verified digest (None: not checked)."""
        if self.off or self.rt.reporter is None:
            return None
        step = self.rt.steps_done
        try:
            _, verdict = self._compare("migration", gen)
        except Exception as e:  # a peer failed meanwhile: the JIT save handles it, as for a periodic check
            self.rt.request_save(f"replica check after migration {gen} failed: {type(e).__name__}: {e}")
            return None
        if verdict.ok:
            return verdict.digests.get(self.rt.shard)
        if not self.ever_ok:
            self._turn_off(verdict, f"after migration {gen}, before any periodic check passed")
        else:
            self._mismatch(step, verdict)
        return None

    # -- every N minibatches -------------------------------------------------------------------

    def at_minibatch_start(self, collective: bool, post: bool) -> None:
        """The runtime's minibatch-start hook (after resumable's snapshot, so a staged save is
        complete, and after the buffers' capture). ``collective``: reached at a collective, which
        may not start a minibatch; ``post``: the first start after an optimizer step."""
        if self.off or self.every <= 0 or self.rt.reporter is None:
            return
        step = self.rt.steps_done
        due = step % self.every == 0 if self.next_at is None else step >= self.next_at
        checked = post and due and step != self._checked_step
        if checked:
            t0 = time.perf_counter()
            self._checked_step = step
            self._periodic(step)
        if self.stage_pending and self.rt.save_fn is not None:
            self.stage_pending = False
            try:
                self._stage(step, collective)
            except Exception as e:  # tmpfs full, not ours: a rollback would go back further, or stop the job
                self._say(f"could not stage the verified state of step {step} in host memory "
                          f"({type(e).__name__}: {e}); the last one staged stays the rollback point")
        if checked:  # its cost, the stage after it included: what the next interval is sized by
            self._check_s = time.perf_counter() - t0

    def _periodic(self, step: int) -> None:
        wish = interval_for(self.every, self._check_s, self.rt.minibatch_s()) if self.adaptive else None
        try:
            _, verdict = self._compare("step", step, propose=wish)
        except Exception as e:  # the store's timeout or a lost store: a peer failed during the check
            self.rt.request_save(f"replica check after step {step} failed: {type(e).__name__}: {e}")
            return  # deferred (after a step): the JIT save runs at this minibatch start
        if verdict.ok:
            if self.adaptive and verdict.next:
                self.next_at = step + verdict.next
            if not self.ever_ok and self.rt.cfg.rank == 0:
                self._set_flag("ok", f"step {step}")
            self.ever_ok = True
            self.stage_pending = True
            return
        if not self.ever_ok:
            self._turn_off(verdict, f"at the job's first check (step {step})")
            return
        self._mismatch(step, verdict)

    def _mismatch(self, step: int, verdict: replica_check.Verdict) -> None:
        cfg = self.rt.cfg
        odd = verdict.odd_ranks()
        fields = {"mismatch": _fields(verdict), "suspects": odd, "verified_step": self.staged and self.staged[0]}
        if cfg.rank == min(r for m in verdict.mismatches for rs in m.groups.values() for r in rs):
            self.rt.report("state_mismatch", at_step=step, error=verdict.describe(), **fields)
        self._say(f"replica states differ after step {step}: {verdict.describe()}")
        if cfg.rank in odd:
            self.rt.report("sdc_suspect", at_step=step, tensor=next(m.tensor for m in verdict.mismatches
                                                                 if cfg.rank in m.odd))
        if self.every == 1 and self._repairable(verdict) and self._repair(step, verdict):
            return
        self._rollback(step, verdict, odd)

    # -- repair in place (N = 1, a strict majority) --------------------------------------------

    def _repairable(self, verdict: replica_check.Verdict) -> bool:
        if not all(m.majority is not None and len(m.groups) > 1 for m in verdict.mismatches):
            return False
        mine = tensors_by_name(tracked.models(), tracked.optimizers())
        return all(n in mine and words(mine[n]).numel() * words(mine[n]).element_size() <= REPAIR_MAX_BYTES
                   for n in self._to_fix(verdict))

    def _to_fix(self, verdict: replica_check.Verdict) -> list[str]:
        names: list[str] = []
        for m in verdict.mismatches:
            donor = verdict.details[m.groups[m.majority][0]]
            for r in m.odd:
                fp = verdict.details[r]
                names += [n for n, a, b in zip(donor.names, donor.sums, fp.sums, strict=False)
                          if a != b and n not in names]
        return names

    def _repair(self, step: int, verdict: replica_check.Verdict) -> bool:
        """The odd ranks take the majority's tensors that differ (through the store, sealed), then
        every rank compares again. True when the replicas agree again."""
        cfg = self.rt.cfg
        a = auth.of(cfg.token)
        mine = tensors_by_name(tracked.models(), tracked.optimizers())
        names = self._to_fix(verdict)
        for m in verdict.mismatches:
            donor = m.groups[m.majority][0]
            if cfg.rank == donor:
                for i, n in enumerate(names):
                    raw = words(mine[n]).view(-1).cpu().numpy().tobytes()
                    a.put(self._store, {"name": n, "data": base64.b64encode(raw).decode()},
                          "fix", cfg.attempt, step, m.shard, i)
            if cfg.rank in m.odd:
                for i, n in enumerate(names):
                    _take(a, self._store, mine[n], n, self._timeout(), "fix", cfg.attempt, step, m.shard, i)
        _, again = self._compare("step", step, "repaired")
        if again.ok:
            self.rt.report("state_repaired", step=step, tensors=names, suspects=verdict.odd_ranks())
            self._say(f"replica state repaired in place from the majority ({len(names)} tensor(s)); "
                      "nothing redone")
            self.stage_pending = True
        return again.ok

    # -- rollback to the last verified state ---------------------------------------------------

    def _stage(self, step: int, collective: bool) -> None:
        """The save_fn into host memory (this job's tmpfs directory), replacing the last one."""
        from ..ec import files as ec_files

        rt = self.rt
        base = ec_files.private_root(rt.cfg.job_id) / "verified"
        base.mkdir(mode=0o700, exist_ok=True)
        tmp, final = base / f".tmp-rank-{rt.cfg.rank}", base / f"rank-{rt.cfg.rank}"
        shutil.rmtree(tmp, ignore_errors=True)
        old_umask = os.umask(0o077)
        try:
            tmp.mkdir(mode=0o700)
            rt.step_read = False
            rt.save_fn(str(tmp))
        finally:
            os.umask(old_umask)
        if collective and not rt.step_read:
            # a collective after the step that may not start a minibatch (a barrier after the loop),
            # and a save_fn that did not label its state with checkpoint_step(): keep the last one
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        self.staged = (step, final)

    def _all_at(self, step: int, what: str) -> None:
        """Wait (at most the JIT timeout) until every rank got here."""
        cfg = self.rt.cfg
        a = auth.of(cfg.token)
        try:
            a.put(self._store, {"at": step}, what, cfg.attempt, step, cfg.rank)
            self._store.wait([a.key(what, cfg.attempt, step, r) for r in range(cfg.world_size)],
                             timedelta(seconds=cfg.timeout_s))
        except Exception as e:  # a peer gone: the episode's SIGTERM may then be reported, nothing worse
            self._say(f"not every rank reached the {what} within {cfg.timeout_s}s: {e}")

    def _rollback(self, step: int, verdict: replica_check.Verdict, odd: list[int]) -> None:
        rt = self.rt
        if self.staged is None:
            self._refuse(f"the replicas' states differ after step {step} ({verdict.describe()}) and no verified "
                         "state is staged to roll back to (jitckpt.register a save_fn)", {"suspects": odd})
        good, src = self.staged
        with rt._lock:  # from here a SIGTERM of the episode finds a save pending and reports nothing
            if rt.deferred is None:
                rt.deferred = "state_mismatch"
        self._all_at(step, "rollback")  # ... on every rank, before the first report starts the episode
        rt.report("failure_detected", reason="sdc_suspect" if rt.cfg.rank in odd else "state_mismatch",
                  phase=rt.phase.value, step=step - 1, minibatch_s=rt.minibatch_s(),
                  action=f"rolling back to the verified state of step {good}")
        self._say(f"rolling back to the verified state of step {good}: {step - good} minibatch(es) redone")
        rt._claim_save()

        def copy_staged(d: str) -> None:
            shutil.copytree(src, d, dirs_exist_ok=True, ignore=shutil.ignore_patterns(layout.MANIFEST))

        from ..ec import files as ec_files

        try:  # EC snapshots taken since may be of the corrupted state: the restart must not prefer them
            ec_files.drop_versions_after(rt.cfg.job_id, good)
        except OSError as e:
            self._say(f"could not drop the EC snapshots newer than step {good}: {e}")
        rt.save_fn = copy_staged
        rt.steps_done = good
        rt._save_and_exit("state_mismatch", Phase.FWD, announced=True)


def _take(a: auth.Auth, store, dst, name: str, timeout_s: float, *parts: object) -> None:
    key = a.key(*parts)
    store.wait([key], timedelta(seconds=timeout_s))
    rec = a.open(key, store.get(key), f"the majority's {name}", auth.Schema({"name": str, "data": str}))
    if rec is None or rec["name"] != name:
        raise replica_check.RecordTampered(-1, f"repair record of {name}")
    src = torch.frombuffer(bytearray(base64.b64decode(rec["data"])), dtype=torch.uint8)
    w = words(dst)
    w.view(-1).view(torch.uint8).copy_(src.to(w.device))


def _fields(verdict: replica_check.Verdict) -> list[dict]:
    return [{"shard": m.shard, "groups": m.groups, "tensor": m.tensor, "odd": m.odd} for m in verdict.mismatches]


def install(rt: Runtime) -> Verifier | None:
    """The replica checks of a jitrun worker (the start check always; the periodic one when
    JITCKPT_VERIFY_EVERY > 0)."""
    if not rt.cfg.managed or rt.reporter is None:
        return None
    try:
        every = contract.VERIFY_EVERY.get()
    except ValueError as e:
        print(f"[jitckpt] rank {rt.cfg.rank}: periodic replica checks off: {e}", file=sys.stderr)
        every = 0
    tracked.track_optimizers()
    v = Verifier(rt, max(every, 0), adaptive=contract.VERIFY_ADAPTIVE.get())
    rt.verifier = v
    return v

