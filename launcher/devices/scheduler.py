"""Scheduler hooks: where the restarted job runs.

``local`` (default): restart on this host; the failed ranks' devices are
dropped from CUDA_VISIBLE_DEVICES when enough spares remain. ``exec:PATH``:
run PATH, write a JSON failure description to its stdin, read a JSON
placement from its stdout::

    in : {"job_id", "restart_count", "failed_ranks": [...], "failed_devices": [...],
          "nproc_per_node", "reasons": {rank: why}, "restore_step", "hosts": [...],
          "devices": "0,1,..." (CUDA_VISIBLE_DEVICES) | null,
          "sdc_suspects": [...] (ranks whose state differed from their replicas' majority;
          also in failed_ranks, their devices in failed_devices)}
    out: {"action": "restart" | "abort", "env": {NAME: VALUE, ...},
          "visible_devices": "0,2" (optional, becomes CUDA_VISIBLE_DEVICES)}

A device found unhealthy while the job runs (NVML, ``launcher/devices/health.py``) is
described with ``"event": "device_unhealthy"`` and its ``ranks``; for that event
the hook may also answer ``{"action": "migrate", "to": "<node address>"}``: the
ranks move there live (``jitrun migrate``, needs ``--jit-migratable on``).
``restart`` (what ``local`` answers) stops them with a JIT checkpoint and restarts
without the device when enough remain.

A device that died under a live process of a ``--jit-migratable on`` job (the
shim parked the process: ``launcher/migration/device_loss.py``) is described with
``"event": "device_lost"``, its ``rank``, ``failed_devices`` and the healthy
devices no local rank uses (``spare_devices``, NVML UUIDs). The hook answers
``{"action": "migrate", "to": "<node address>", "device": "<UUID>"}`` (the
process moves there and attaches that device) or ``restart`` (it falls back to
the JIT checkpoint path at once). ``local`` moves it onto this node's first
spare device, else restarts.

``slurm``: jitrun runs inside a Slurm allocation (checked by parse_hook).
After a failure every lost node (``lost_nodes``: agent vanished) is drained with
reason "jitrun: ..."; one surviving agent (the first of sorted ``hosts``, so
replacements are not started twice) starts a replacement agent with the same
argv (``command``) on a spare node of the allocation through ``srun`` (see
``jitrun.slurm``), and the workers restart with JITCKPT_SLURM_SPARE=node[,...]
in their environment. Without a spare the job restarts anyway and waits for a
replacement to join; Slurm errors are reported on stderr, never fatal.

Failure keys read by the hooks (all optional): ``lost_nodes`` [{"node_id",
"host" (Slurm node name), "addr"}], ``failed_hosts`` [host], ``command``
[argv of the jitrun agent], ``hosts`` [surviving hosts] besides those above.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from jitckpt.wire import contract

from . import slurm


class SchedulerError(RuntimeError):
    pass


class JobAborted(RuntimeError):
    """The scheduler hook answered ``{"action": "abort"}``: the job ends
    without a restart (jitrun exits 1 with one line, no traceback)."""


@dataclass
class Placement:
    action: str = "restart"
    env: dict[str, str] = field(default_factory=dict)
    visible_devices: str | None = None
    to: str | None = None  # action "migrate": the target node's address
    device: str | None = None  # event "device_lost", action "migrate": the device to attach there

    def summary(self) -> dict:
        return {"action": self.action, "env": sorted(self.env), "visible_devices": self.visible_devices}


def place_or_default(hook: str, failure: dict, instead: str) -> Placement:
    """``place``, or the default placement (restart here) with one line saying why
    when the hook cannot answer (``instead``: what happens then, for the line)."""
    try:
        return place(hook, failure)
    except SchedulerError as e:
        print(f"jitrun: {e}; {instead}", file=sys.stderr, flush=True)
        return Placement()


def parse_hook(spec: str) -> str:
    if spec == "local":
        return spec
    if spec == "slurm":
        try:
            slurm.allocation()
            for tool in ("scontrol", "squeue", "srun"):
                slurm.tool(tool)
        except slurm.SlurmError as e:
            raise SchedulerError(f"--jit-scheduler slurm: {e}") from None
        return spec
    if spec.startswith("exec:"):
        path = spec[5:]
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise SchedulerError(f"--jit-scheduler {spec!r}: {path!r} is not an executable file")
        return spec
    raise SchedulerError(f"--jit-scheduler {spec!r}: expected 'local', 'slurm' or 'exec:/path/to/program'")


def place(spec: str, failure: dict, timeout_s: float = 60.0) -> Placement:
    if spec == "local" and failure.get("event") == "device_lost":
        spares = failure.get("spare_devices") or []
        if spares:
            return Placement(action="migrate", to=str(failure["node"]["addr"]), device=str(spares[0]))
        return Placement()
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
    if spec == "slurm":
        return _place_slurm(failure)
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
    live = failure.get("event") in ("device_unhealthy", "device_lost")
    actions = ("restart", "abort", "migrate") if live else ("restart", "abort")
    if not isinstance(ans, dict) or ans.get("action", "restart") not in actions:
        raise SchedulerError(f"scheduler hook {path}: 'action' must be one of {', '.join(actions)}, got {ans!r}")
    to = ans.get("to")
    if ans.get("action") == "migrate" and not (isinstance(to, str) and to):
        raise SchedulerError(f"scheduler hook {path}: 'migrate' needs 'to', the target node's address; got {ans!r}")
    dev = ans.get("device")
    if failure.get("event") == "device_lost" and ans.get("action") == "migrate" and not (
            isinstance(dev, str) and dev and len(dev) < 64 and '"' not in dev):
        raise SchedulerError(f"scheduler hook {path}: 'migrate' of a lost device needs 'device', the UUID of the "
                             f"device to attach on the target (under 64 characters); got {ans!r}")
    env = ans.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SchedulerError(f"scheduler hook {path}: 'env' must map strings to strings")
    vis = ans.get("visible_devices")
    if vis is not None and not isinstance(vis, str):
        raise SchedulerError(f"scheduler hook {path}: 'visible_devices' must be a string like \"0,2\", got {vis!r}")
    return Placement(action=ans.get("action", "restart"), env=env, visible_devices=vis, to=to,
                     device=dev if failure.get("event") == "device_lost" else None)


def _warn(msg: str) -> None:
    print(f"jitrun: slurm: {msg}", file=sys.stderr, flush=True)


def _place_slurm(failure: dict) -> Placement:
    # Restarting matters more than bookkeeping: a Slurm error is reported and
    # the workers restart anyway.
    lost = [n for n in failure.get("lost_nodes") or [] if n.get("host")]
    for n in lost:
        why = f"agent {n.get('node_id', '?')} lost (job {failure.get('job_id', '?')})"
        try:
            slurm.drain(n["host"], f"jitrun: {why}")
            _warn(f"drained node {n['host']}: {why}")
        except slurm.SlurmError as e:
            _warn(f"could not drain {n['host']}: {e}")
    hosts = sorted(slurm.node_name(h) for h in failure.get("hosts") or [])
    me = os.environ.get("SLURMD_NODENAME") or slurm.node_name(os.uname().nodename)
    if not lost or (me in hosts and me != hosts[0]):
        return Placement()  # nothing to replace, or another surviving agent does it
    command = failure.get("command") or []
    if not command:
        _warn("no agent command in the failure description; not starting a replacement")
        return Placement()
    try:
        spares = slurm.spare_nodes(in_use=[*hosts, *(failure.get("failed_hosts") or [])],
                                   lost=[n["host"] for n in lost])
    except slurm.SlurmError as e:
        _warn(f"could not look for spare nodes: {e}")
        spares = []
    started = []
    for n, spare in zip(lost, spares, strict=False):  # fewer spares than lost nodes: replace what we can
        try:
            pid = slurm.start_replacement(spare, command)
            _warn(f"started a replacement agent for {n['host']} on spare node {spare} (srun pid {pid})")
            started.append(spare)
        except slurm.SlurmError as e:
            _warn(f"could not start a replacement agent on {spare}: {e}")
    if len(started) < len(lost):
        _warn(f"no spare node for {len(lost) - len(started)} of {len(lost)} lost node(s) in allocation "
              f"{os.environ.get('SLURM_JOB_ID')}; restarting anyway, the job waits for a replacement agent "
              "to join (start one by hand with srun, or grow the allocation)")
    return Placement(env={contract.SLURM_SPARE.name: ",".join(started)} if started else {})
