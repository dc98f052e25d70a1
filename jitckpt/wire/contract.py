"""What jitrun tells its workers, and what operators and tests tell jitrun:
every ``JITCKPT_*`` environment variable, with its type, default and
meaning. Both sides read and write them only through this module (a
``Var``'s ``get``/``set``), so a name, a default or a parse lives in one
place. The shim (libintercept) reads JITCKPT_TIMEOUT (and _FIXED, _MULT,
_FLOOR; its own default floor, contract.SHIM_FLOOR_S), JITCKPT_ON_HANG,
JITCKPT_ON_DEVICE_LOSS, JITCKPT_DEVICE_DIR, JITCKPT_SHIM_EVENTS and
JITCKPT_RECOVER_TIMEOUT in C with the same meanings.

The one timeout rule: a rank's hang bound is learned from the job's own
timing (jitckpt/hang/bound.py: ``TIMEOUT_FLOOR``, ``TIMEOUT_MULT``), and
``TIMEOUT`` (``--jit-timeout S``) is its ceiling; with ``TIMEOUT_FIXED``
(``--jit-timeout fixed:S``) ``TIMEOUT`` is the fixed seconds a collective
may hang before the healthy ranks save, nothing learned. Every other bound
that depends on it is derived from it here (``ec_op_timeout_s``,
``pg_timeout_s``, ``hang_rule``), never re-read with a default of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from ..hang.bound import FLOOR_S, MULT, STARTUP_S, Rule

T = TypeVar("T")
Env = MutableMapping[str, str]

DEFAULT_TIMEOUT_S = 120.0
SHIM_FLOOR_S = 30.0  # the shim's watchdog acts on its own, unconfirmed: a floor of its own (libintercept)


def _env(env: Env | None) -> Env:
    return os.environ if env is None else env


def _flag(raw: str) -> bool:
    return raw not in ("", "0", "false", "off", "no")


@dataclass(frozen=True)
class Var(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    meaning: str

    def get(self, env: Env | None = None) -> T:
        """The value, or the default when unset or empty (a malformed value raises ValueError)."""
        raw = _env(env).get(self.name)
        return self.default if raw is None or raw == "" else self.parse(raw)

    def raw(self, env: Env | None = None) -> str | None:
        return _env(env).get(self.name)

    def set(self, value: object, env: Env | None = None) -> None:
        _env(env)[self.name] = str(value)

    def setdefault(self, value: object, env: Env | None = None) -> None:
        _env(env).setdefault(self.name, str(value))

    def unset(self, env: Env | None = None) -> str | None:
        return _env(env).pop(self.name, None)


def _path(raw: str) -> Path:
    return Path(raw)


# -- launcher -> worker ----------------------------------------------------------------------------
DIR = Var[Path | None]("JITCKPT_DIR", _path, None, "the job's jit dir on this node; set only under jitrun")
JOB_ID = Var("JITCKPT_JOB_ID", str, "", "the job's identity (the rendezvous id, else a hash of the command)")
JOB_IDENTITY = Var("JITCKPT_JOB_IDENTITY", str, "",
                   "what makes it the same job: a digest of the job id, the script and its arguments")
AGENT_PID = Var("JITCKPT_AGENT_PID", int, 0, "the PID of the worker's jitrun agent: its death ends the worker")
TOKEN = Var("JITCKPT_TOKEN", str, "", "the job's secret: key names and seals of every record in the store")
TIMEOUT = Var("JITCKPT_TIMEOUT", float, DEFAULT_TIMEOUT_S,
              "ceiling of the learned hang bound; with TIMEOUT_FIXED the fixed seconds a collective may hang")
TIMEOUT_FIXED = Var("JITCKPT_TIMEOUT_FIXED", _flag, False, "TIMEOUT is a fixed hang bound: nothing is learned")
TIMEOUT_FLOOR = Var("JITCKPT_TIMEOUT_FLOOR", float, FLOOR_S, "the learned hang bound is never below this")
TIMEOUT_STARTUP = Var("JITCKPT_TIMEOUT_STARTUP", float, STARTUP_S, "the bound's least over the first minibatches")
TIMEOUT_MULT = Var("JITCKPT_TIMEOUT_MULT", float, MULT, "the learned bound: this x the recent high quantile")
REPORT_STREAM = Var("JITCKPT_REPORT_STREAM", str, "", "the report stream its reports go to (its node's; '': the job's)")
ATTEMPT = Var("JITCKPT_ATTEMPT", int, 0, "job-wide attempt (rendezvous round, or the static group's restarts)")
RESTORE_STEP = Var("JITCKPT_RESTORE_STEP", str, "", "the step the job restores: a number, 'none', or unset")
RESTORE_SOURCE = Var("JITCKPT_RESTORE_SOURCE", str, "", "'ec': decode RESTORE_STEP from EC chunks first")
EC_FALLBACK_STEP = Var("JITCKPT_EC_FALLBACK_STEP", str, "none", "what to load if the EC decode fails job-wide")
EC_EVERY = Var("JITCKPT_EC_EVERY", int, 0, "an EC snapshot every N minibatches (0: off)")
EC_ADAPTIVE = Var("JITCKPT_EC_ADAPTIVE", _flag, False, "EC_EVERY is the least interval: the ranks lengthen it "
                  "together so that snapshots cost at most ec/snapshot.BUDGET of the training time")
EC_CODE = Var("JITCKPT_EC_CODE", str, "auto", "'K+M' or 'auto' (from the node count)")
EC_SHM = Var("JITCKPT_EC_SHM", str, "", "base directory of EC chunks instead of /dev/shm (tests: nodes on one host)")
EC_MAX_MEM = Var("JITCKPT_EC_MAX_MEM", str, "", "bytes of /dev/shm this job's EC files may use on this node")
EC_MAX_MEM_HOW = Var("JITCKPT_EC_MAX_MEM_HOW", str, "", "where that cap came from, for messages")
EC_STATS = Var("JITCKPT_EC_STATS", _flag, False, "rank 0 prints per-snapshot timings")
FAULT = Var("JITCKPT_FAULT", str, "", "fault injection (jitckpt/faults.py's language)")
VERIFY_EVERY = Var("JITCKPT_VERIFY_EVERY", int, 0, "replicas compare state fingerprints every N minibatches (0: off)")
VERIFY_ADAPTIVE = Var("JITCKPT_VERIFY_ADAPTIVE", _flag, False, "VERIFY_EVERY is the least interval: the ranks "
                      "lengthen it together so that checks cost at most ec/schedule.BUDGET of the training time")
MIGRATABLE = Var("JITCKPT_MIGRATABLE", _flag, False, "workers run under --jit-migratable on")
MIGRATE_NO_PAUSE = Var("JITRUN_MIGRATE_NO_PAUSE", _flag, False, "migratable workers cannot pause (--no-python)")
NODE = Var("JITCKPT_NODE", str, "", "a migrated worker's new node (set by the target agent)")
ON_HANG = Var("JITCKPT_ON_HANG", str, "", "the shim's answer to a hung collective ('recover')")
ON_DEVICE_LOSS = Var("JITCKPT_ON_DEVICE_LOSS", str, "", "the shim's answer to a lost device ('migrate')")
DEVICE_DIR = Var("JITCKPT_DEVICE_DIR", str, "", "where parked workers ask their agent for a new device")
SHIM_EVENTS = Var("JITCKPT_SHIM_EVENTS", str, "", "the shim's event log")
SLURM_SPARE = Var("JITCKPT_SLURM_SPARE", str, "", "spare nodes the Slurm hook started, for the workers")

# -- operator / test -> jitrun ---------------------------------------------------------------------
INTERCEPT_LIB = Var("JITCKPT_INTERCEPT_LIB", str, "", "the shim jitrun preloads (default build/libjitintercept.so)")
NVML_LIB = Var("JITCKPT_NVML_LIB", str, "", "libnvidia-ml to load instead of the system's")
CRIU = Var("JITCKPT_CRIU", str, "", "the criu binary to use")
CRIU_CACHE = Var("JITCKPT_CRIU_CACHE", str, "", "where scripts/build_criu.sh keeps its build")
MIGRATE_TIMEOUT = Var("JITCKPT_MIGRATE_TIMEOUT", float, 120.0, "seconds for a migration's transfer and restore")
SLURM_LOG = Var("JITCKPT_SLURM_LOG", str, "", "the Slurm hook's log file")
TEST_MIGRATE_FAULT = Var("JITCKPT_TEST_MIGRATE_FAULT", str, "", "tests: break a dump (kill-criu | corrupt-image)")
WARM_IMPORTS = Var("JITCKPT_WARM_IMPORTS", str, "", "packages the warm-start server imports (jitckpt/_warm_imports.py)")
NO_WARM_IMPORTS = Var("JITRUN_NO_WARM_IMPORTS", _flag, False, "restarts do not preload what the script imported")
WARM_STATUS = Var("JITCKPT_WARM_STATUS", str, "", "where the warm-start server says those imports are done")
TEST_CORRUPT_TRANSFER = Var("JITCKPT_TEST_CORRUPT_TRANSFER", _flag, False, "tests: serve corrupted replicas")

VARS: tuple[Var[Any], ...] = tuple(v for v in globals().values() if isinstance(v, Var))


def attempt(env: Env | None = None) -> int:
    """The job-wide attempt; under plain torchrun (no jitrun) the restart count."""
    e = _env(env)
    return ATTEMPT.get(e) if ATTEMPT.raw(e) else int(e.get("TORCHELASTIC_RESTART_COUNT") or 0)


@dataclass(frozen=True)
class RestorePlan:
    """What the job restores this round: decided by the agents once per round
    (launcher/recovery/restore.py), handed to the workers by jitrun's one
    environment writer (launcher/worker_env.py) and read once by each worker
    (config.WorkerConfig.plan). On the wire it stays RESTORE_STEP,
    RESTORE_SOURCE and EC_FALLBACK_STEP, so a plan is one value on both sides.

    ``decided``: False when no decision was handed (a first attempt, plain
    torchrun): a worker then takes the newest complete replica it finds.
    ``step``: the replica step (None: a fresh start). ``ec_step``: an EC
    snapshot to decode first, job-wide; ``step`` is then its fallback."""

    decided: bool = False
    step: int | None = None
    ec_step: int | None = None

    @classmethod
    def from_env(cls, env: Env | None = None) -> RestorePlan:
        raw = RESTORE_STEP.get(env).strip()
        if not raw:
            return cls()
        chosen = int(raw) if raw.isdigit() else None
        if RESTORE_SOURCE.get(env) == "ec" and chosen is not None:
            fallback = EC_FALLBACK_STEP.get(env).strip()
            return cls(True, int(fallback) if fallback.isdigit() else None, chosen)
        return cls(True, chosen)

    def to_env(self, env: Env | None = None) -> None:
        if not self.decided:
            for var in (RESTORE_STEP, RESTORE_SOURCE, EC_FALLBACK_STEP):
                var.unset(env)
            return
        step = "none" if self.step is None else self.step
        if self.ec_step is not None:
            RESTORE_STEP.set(self.ec_step, env)
            RESTORE_SOURCE.set("ec", env)
            EC_FALLBACK_STEP.set(step, env)
        else:
            RESTORE_STEP.set(step, env)
            RESTORE_SOURCE.unset(env)
            EC_FALLBACK_STEP.unset(env)

    def fallback(self) -> RestorePlan:
        """The plan once the EC decode failed job-wide: the replica step."""
        return RestorePlan(self.decided, self.step)

    def decoded(self) -> RestorePlan:
        """The plan once the EC snapshot was decoded into the replica layout: its step."""
        return RestorePlan(self.decided, self.ec_step)


def ec_op_timeout_s(timeout_s: float) -> float:
    """An EC snapshot's or decode's collectives: never shorter than two JIT timeouts or 2 min."""
    return max(DEFAULT_TIMEOUT_S, 2 * timeout_s)


def pg_timeout_s(timeout_s: float, shim: bool, fixed: bool = True) -> float:
    """The process groups' timeout once training runs. Fixed: the JIT timeout.
    Learned, or with the shim: longer than the ceiling, so a slow but live peer
    never makes gloo tear the group down on its own; the agent confirms a hang
    and ends the hung rank (launcher/recovery/hang.py), the shim's watchdog
    sees an NCCL hang first, and this is only the backstop without either."""
    return timeout_s if fixed and not shim else 2 * timeout_s + 30


def hang_rule(env: Env | None = None) -> Rule:
    """The hang bound's rule as jitrun set it for this worker."""
    return Rule(floor_s=TIMEOUT_FLOOR.get(env), mult=TIMEOUT_MULT.get(env), startup_s=TIMEOUT_STARTUP.get(env),
                ceiling_s=TIMEOUT.get(env), fixed=TIMEOUT_FIXED.get(env))
