"""The short table of a gpu_check run (OUT/gpu_check.md), from its JSON."""

from __future__ import annotations

from typing import Any


def _cost(p: dict[str, Any]) -> list[str]:
    rows = []
    for prog in ("bench", "ncclcost"):
        for call, added in p.get(prog, {}).get("added_ns", {}).items():
            rows.append(f"{call}: {p[prog]['direct_ns'][call]:.0f} ns, +{added:.0f} ns with the shim")
    return rows


def _recovery(p: dict[str, Any]) -> list[str]:
    rows = [f"{p.get('process_groups', '?')}, {p.get('steps', '?')} steps on {p.get('device', '?')}"]
    for kind in ("sigkill", "sigstop"):
        k = p.get(kind)
        if not k:
            continue
        if "failed" in k:
            rows.append(f"{kind}: FAILED: {k['failed']}")
            continue
        same = "bit-identical to torchrun" if k.get("identical") else "DIFFERS from torchrun"
        rows.append(f"{kind} of rank 1 at step {p['fault_step']}: {same} ({k['entries']} entries), failure to "
                    f"resumed {k.get('failure_to_resumed_s') or 0:.2f} s (detection {k.get('detection_s') or 0:.2f} s)")
    return rows


def _steps(p: dict[str, Any]) -> list[str]:
    return [f"torchrun {p['torchrun_ms']:.2f} ms, jitrun {p['jitrun_ms']:.2f} ms a step: "
            f"x{p['jitrun_over_torchrun']:.3f} (runs {p['step_ms']['torchrun']} / {p['step_ms']['jitrun']}, "
            f"order {' '.join(p['order'])})"]


def _fingerprint(p: dict[str, Any]) -> list[str]:
    return [f"{p['one_tensor_s_per_gib'] * 1000:.1f} ms/GiB one tensor, {p['tensors_of_4mib_s_per_gib'] * 1000:.1f}"
            f" ms/GiB in 4 MiB tensors ({p['mib']} MiB on {p['device']})"]


def _probe(p: dict[str, Any]) -> list[str]:
    return [f"torch {p.get('torch')} (CUDA {p.get('cuda')}), {p.get('device') or 'no GPU'}; "
            f"nvidia-smi: {p.get('nvidia_smi') or '-'}"]


def _build(p: dict[str, Any]) -> list[str]:
    return [*p.get("abi_checks", []), f"headers {p.get('includes') or 'none found'}"]


def _under_torch(p: dict[str, Any]) -> list[str]:
    calls = p.get("calls_through_shim", {})
    return [", ".join(f"{k} {v}" for k, v in sorted(calls.items()))]


DETAIL = {"probe": _probe, "build": _build, "shim_under_torch": _under_torch, "call_cost": _cost,
          "recovery": _recovery, "step_time": _steps, "fingerprint": _fingerprint}


def table(doc: dict[str, Any]) -> str:
    lines = [f"gpu_check ({doc['mode']}, {doc['host']}, {doc['date']}, commit {doc.get('commit')}): "
             f"{'OK' if doc['ok'] else 'FAILED'} in {doc['wall_s']} s", "",
             "| phase | result | details |", "| --- | --- | --- |"]
    for name, p in doc["phases"].items():
        try:
            details = DETAIL[name](p) if p["status"] == "ok" else [p.get("why", "")]
        except (KeyError, TypeError, ValueError) as e:
            details = [f"(no details: {type(e).__name__} {e})"]
        cell = "<br>".join(d.replace("|", "/") for d in details if d)
        lines.append(f"| {name} | {p['status']} ({p['phase_s']} s) | {cell} |")
    return "\n".join(lines) + "\n"
