"""The one writer of what jitrun's workers find in their environment beyond
torchrun's own variables: the job's settings (once, before anything starts),
this node's report stream, each round's attempt and restore plan, and a
scheduler's placement. Every value is a ``jitckpt.wire.contract`` variable or one
of the few variables of others that jitrun sets for its workers (LD_PRELOAD,
PYTHONPATH, CUDA_VISIBLE_DEVICES, the scheduler's own).

Values go into this process's environment, which torchrun's agent copies into
every worker it starts as a subprocess (and reads CUDA_VISIBLE_DEVICES from),
and are remembered: a warm worker is forked from a server started before the
first round, so ``into`` hands it what changed since explicitly.

Main thread of the jitrun process only (the CLI, then the agent's).
"""

from __future__ import annotations

import os
from pathlib import Path

from jitckpt.wire import contract

_changed: set[str] = set()  # names set after the warm-start server took its copy of the environment


def _set(name: str, value: object) -> None:
    os.environ[name] = str(value)
    _changed.add(name)


def job(*, root: Path, job_id: str, token: str, timeout_s: float, fixed: bool, ec_every: int, ec_code: str,
        verify_every: int, ec_cap: tuple[str, str] | None, ec_adaptive: bool = False,
        verify_adaptive: bool = False) -> None:
    """The job's settings, before the agent or the warm-start server starts."""
    contract.DIR.set(root)
    contract.JOB_ID.set(job_id)
    contract.TOKEN.set(token)
    contract.TIMEOUT.set(timeout_s)
    contract.TIMEOUT_FIXED.set(int(fixed))
    contract.AGENT_PID.set(os.getpid())  # a worker dies with this process (jitckpt/parent_death.py)
    contract.RestorePlan().to_env()  # a first attempt restores what it finds, nothing handed down
    contract.MIGRATABLE.unset()
    contract.EC_EVERY.set(ec_every)  # 0 = off: nothing of it runs in the workers
    contract.EC_ADAPTIVE.set(int(ec_adaptive and ec_every > 0))
    contract.EC_CODE.set(ec_code)
    contract.VERIFY_EVERY.set(verify_every)
    contract.VERIFY_ADAPTIVE.set(int(verify_adaptive and verify_every > 0))
    if ec_cap is not None:
        contract.EC_MAX_MEM.set(ec_cap[0])
        contract.EC_MAX_MEM_HOW.set(ec_cap[1])


def identity(ident: str) -> None:
    contract.JOB_IDENTITY.set(ident)


def migratable(no_pause: bool) -> None:
    contract.MIGRATABLE.set(1)
    contract.MIGRATE_NO_PAUSE.set(1 if no_pause else 0)


def preload(lib: str, shim_events: Path) -> None:
    """libintercept into every worker, with its defaults: lost collectives recovered in place,
    its event log in the jit dir (an operator's own settings of either stay)."""
    os.environ["LD_PRELOAD"] = ":".join(filter(None, [lib, os.environ.get("LD_PRELOAD")]))
    contract.ON_HANG.setdefault("recover")
    contract.SHIM_EVENTS.setdefault(shim_events)


def park_on_device_loss(control_dir: Path) -> None:
    """A sticky device error parks the process for a move to a new device (launcher/migration/
    device_loss.py) instead of ending it (an operator's own settings stay)."""
    contract.ON_DEVICE_LOSS.setdefault("migrate")
    contract.DEVICE_DIR.setdefault(control_dir)


def network(derived: dict[str, str]) -> None:
    """What jitrun derived of the network settings (launcher/netconf.py: GLOO_SOCKET_IFNAME)."""
    os.environ.update(derived)


def drop(name: str) -> None:
    """A variable of the operator's that jitrun's workers must not inherit."""
    os.environ.pop(name, None)


def python_path(path: str) -> None:
    """A directory first on the workers' PYTHONPATH (a ``--no-python`` program's sitecustomize)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))


def signals_to_handle(names: str) -> None:
    """The signals torchelastic forwards to its workers (its own variable)."""
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = names


def report_stream(name: str) -> None:
    """This node's workers report to this node's agent only."""
    _set(contract.REPORT_STREAM.name, name)


def attempt(n: int) -> None:
    _set(contract.ATTEMPT.name, n)


def plan(p: contract.RestorePlan) -> None:
    """The round's restore plan (the restorer's decision)."""
    p.to_env()
    _changed.update({contract.RESTORE_STEP.name, contract.RESTORE_SOURCE.name, contract.EC_FALLBACK_STEP.name})


def placement(env: dict[str, str], visible_devices: str | None) -> None:
    """A scheduler hook's answer, or the devices left after a failing one: for the next workers."""
    for k, v in env.items():
        _set(k, v)
    if visible_devices is not None:
        _set("CUDA_VISIBLE_DEVICES", visible_devices)


def into(worker_env: dict) -> None:
    """What this module set since the warm-start server started, into one worker's environment
    (a forked worker would otherwise see the server's values; a variable unset since was
    never in the server's environment either: RestorePlan().to_env() ran before it started)."""
    for k in _changed:
        if k in os.environ:
            worker_env[k] = os.environ[k]
