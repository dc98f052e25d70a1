"""The one builder of what the scheduler hook is told (launcher/devices/scheduler.py
lists the keys each event carries)."""

from __future__ import annotations

import os
from typing import Any


def describe(job_id: str, node, **fields: Any) -> dict:
    """``node``: this agent's NodeInfo. Every event names the job, this node
    and its host; the caller adds the event's own keys."""
    return {"job_id": job_id, "hosts": [node.host],
            "node": {"node_id": node.node_id, "host": node.host, "addr": node.addr}, **fields}


def restart(job_id: str, node, *, restart_count: int, failed_ranks: list[int], local_of: dict[int, int],
            bad_devices: set[str], all_devices: list[str], nproc: int, reasons: dict, restore_step: int | None,
            command: list[str], decision=None, sdc_suspects: list[int] = ()) -> dict:
    """A restart after a failure. ``decision``: the job-wide one when this
    agent made it; job-wide facts (lost nodes, the job's hosts) go to one
    agent's hook only (one drain, one replacement)."""

    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    dev_list = devices.split(",") if devices else []
    failed_devices = sorted({dev_list[local_of[r]] for r in failed_ranks
                             if r in local_of and local_of[r] < len(dev_list)} | bad_devices)
    if bad_devices and not devices:  # NVML's indices: make the visible set explicit
        devices = ",".join(all_devices)
    out = describe(job_id, node, restart_count=restart_count, failed_ranks=failed_ranks,
                   failed_devices=failed_devices, nproc_per_node=nproc, reasons={str(k): v for k, v in reasons.items()},
                   restore_step=restore_step, devices=devices, failed_hosts=[node.host] if failed_ranks else [],
                   lost_nodes=[], command=command, sdc_suspects=sorted(sdc_suspects))
    if decision is not None:
        out["lost_nodes"] = decision.lost
        out["hosts"] = sorted({n["host"] for n in decision.nodes if n not in decision.lost})
    return out
