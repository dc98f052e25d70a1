"""Scheduler hooks: where the restarted job runs.

``local`` (default): restart on this host; the failed ranks' devices are
dropped from CUDA_VISIBLE_DEVICES when enough spares remain. ``exec:PATH``:
run PATH, write a JSON failure description to its stdin, read a JSON
placement from its stdout::

    in : {"job_id", "restart_count", "failed_ranks": [...], "failed_devices": [...],
          "nproc_per_node", "reasons": {rank: why}, "restore_step", "hosts": [...],
          "devices": "0,1,..." (CUDA_VISIBLE_DEVICES) | null}
    out: {"action": "restart" | "abort", "env": {NAME: VALUE, ...},
          "visible_devices": "0,2" (optional, becomes CUDA_VISIBLE_DEVICES)}

A Slurm deployment points exec: at a script that asks the controller for a
replacement node (e.g. ``scontrol`` / ``sbatch --dependency``) and answers with
the placement; jitrun itself stays scheduler-agnostic.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field


class SchedulerError(RuntimeError):
    pass


@dataclass
class Placement:
    action: str = "restart"
    env: dict[str, str] = field(default_factory=dict)
    visible_devices: str | None = None


def parse_hook(spec: str) -> str:
    if spec == "local":
        return spec
    if spec.startswith("exec:"):
        path = spec[5:]
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise SchedulerError(f"--jit-scheduler {spec!r}: {path!r} is not an executable file")
        return spec
    raise SchedulerError(f"--jit-scheduler {spec!r}: expected 'local' or 'exec:/path/to/program'")


def place(spec: str, failure: dict, timeout_s: float = 60.0) -> Placement:
    if spec == "local":
        devices = failure.get("devices")
        bad = set(failure.get("failed_devices") or [])
        if devices and bad:
            keep = [d for d in devices.split(",") if d not in bad]
            # Only with spares: with fewer devices than workers the restart
            # could not start at all, so keep the suspect device and let the
            # JIT restart retry it.
            if len(keep) >= int(failure.get("nproc_per_node") or 1):
                return Placement(visible_devices=",".join(keep))
        return Placement()
    path = spec[5:]
    try:
        out = subprocess.run([path], input=json.dumps(failure), capture_output=True, text=True,
                             timeout=timeout_s, check=True).stdout
    except subprocess.CalledProcessError as e:
        raise SchedulerError(f"scheduler hook {path} exited {e.returncode}: {e.stderr.strip()[:500]}") from None
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"scheduler hook {path} did not answer within {timeout_s:.0f}s") from None
    try:
        ans = json.loads(out)
    except ValueError:
        raise SchedulerError(f"scheduler hook {path} answered non-JSON: {out[:200]!r}") from None
    if not isinstance(ans, dict) or ans.get("action", "restart") not in ("restart", "abort"):
        raise SchedulerError(f"scheduler hook {path}: 'action' must be 'restart' or 'abort', got {ans!r}")
    env = ans.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SchedulerError(f"scheduler hook {path}: 'env' must map strings to strings")
    vis = ans.get("visible_devices")
    if vis is not None and not isinstance(vis, str):
        raise SchedulerError(f"scheduler hook {path}: 'visible_devices' must be a string like \"0,2\", got {vis!r}")
    return Placement(action=ans.get("action", "restart"), env=env, visible_devices=vis)
