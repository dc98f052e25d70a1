"""The checks of scripts/gpu_check.sh, in order, each with its verdict; results in OUT/gpu_check.json
and a short table in OUT/gpu_check.md (also printed). Exit 0 iff no phase failed.

    python scripts/gpu_check/check.py --out DIR [--standin]

Run through scripts/gpu_check.sh, which picks the Python and makes jitckpt importable first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import costs  # noqa: E402
import jobs  # noqa: E402
import report  # noqa: E402
from common import HERE, ROOT, Ctx, Phase, fail, last_json, run, skip  # noqa: E402

PROBE = r"""
import json, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": None}
if torch.cuda.is_available():
    torch.cuda.init()
    info["device"] = torch.cuda.get_device_name(0)
maps = open("/proc/self/maps").read().split()
for lib in ("libcudart.so.13", "libnccl.so.2"):
    info[lib] = next((p for p in maps if p.startswith("/") and p.rsplit("/", 1)[-1] == lib), None)
print(json.dumps(info))
"""


def probe(ctx: Ctx) -> dict[str, Any]:
    r = run([ctx.py, "-c", PROBE], env=ctx.env(), timeout=ctx.t(120))
    if r.rc != 0:
        raise fail(f"import torch exited {r.rc}", log=r.tail())
    info = last_json(r.out)
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    smi = run(query, timeout=ctx.t(30)) if shutil.which("nvidia-smi") else None
    info["nvidia_smi"] = smi.out.strip() if smi and smi.rc == 0 else None
    info["python"] = platform.python_version()
    if ctx.device and not (info["device"] and info["libcudart.so.13"] and info["libnccl.so.2"]):
        raise fail("a device was expected but torch found no GPU, libcudart.so.13 or libnccl.so.2", **info)
    ctx.probe = info
    return info


def _includes(ctx: Ctx) -> dict[str, str]:
    """Real headers: the CUDA toolkit's (nvcc's, else /usr/local/cuda, else the runtime wheel's) and NCCL's."""
    cands = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(Path(nvcc).resolve().parent.parent / "include")
    cands.append(Path("/usr/local/cuda/include"))
    cudart = ctx.probe.get("libcudart.so.13")
    if cudart:
        cands.append(Path(cudart).parent.parent / "include")
    inc = {}
    cuda = next((c for c in cands if (c / "cuda_runtime_api.h").exists()), None)
    if cuda:
        inc["CUDA_INCLUDE"] = str(cuda)
    nccl = ctx.probe.get("libnccl.so.2")
    header = Path(nccl).parent.parent / "include" / "nccl.h" if nccl else None
    if header and header.exists():
        theirs, ours = _nccl_version(header), _nccl_version(ROOT / "libintercept" / "abi" / "nccl_abi.h")
        inc["NCCL_INCLUDE"] = str(header.parent) if theirs[:2] == ours[:2] else ""  # "": sim.mk finds none
        if theirs[:2] != ours[:2]:  # check-abi proves the layout of one version's ncclConfig_t field by field
            inc["nccl_not_checked"] = (f"torch's NCCL header is {'.'.join(map(str, theirs))}, abi/nccl_abi.h "
                                       f"describes {'.'.join(map(str, ours))}; the shim copies a config by its "
                                       "own size field, so an older, shorter ncclConfig_t is read as a prefix")
    return inc


def _nccl_version(header: Path) -> tuple[int, ...]:
    text = header.read_text(errors="replace")
    return tuple(int(re.search(rf"#define NCCL_{k}\s+(\d+)", text).group(1)) for k in ("MAJOR", "MINOR", "PATCH"))


def _cc(ctx: Ctx, name: str, src: Path, libdirs: dict[str, str]) -> str:
    exe = ctx.build / "gpu-check" / name
    exe.parent.mkdir(parents=True, exist_ok=True)
    link = []
    for lib, d in libdirs.items():
        link += [f"-L{d}", f"-Wl,-rpath,{d}", f"-l:{lib}"]
    cmd = ["cc", "-O1", "-g", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
           f"-I{ROOT / 'libintercept' / 'abi'}", f"-I{ROOT / 'tests' / 'intercept' / 'shim_progs'}",
           "-o", str(exe), str(src), *link, "-ldl", "-lpthread"]
    r = run(cmd, timeout=ctx.t(120))
    if r.rc != 0:
        raise fail(f"building {name} failed", log=r.tail())
    return str(exe)


def build(ctx: Ctx) -> dict[str, Any]:
    """libintercept against the real CUDA (and NCCL) headers, then the per-call cost programs linked
    against torch's own libcudart and libnccl (the stand-in's without a device)."""
    inc = _includes(ctx)
    targets = ["shim", "check-abi"] + ([] if ctx.device else ["sim"])
    cmd = ["make", "-C", str(ROOT / "libintercept"), f"BUILD={ctx.build}", f"-j{min(os.cpu_count() or 1, 8)}",
           *targets, *(f"{k}={v}" for k, v in inc.items() if k.endswith("_INCLUDE"))]
    r = run(cmd, timeout=ctx.t(300))
    if r.rc != 0:
        raise fail("make -C libintercept failed", includes=inc, log=r.tail(3000))
    checked = [line for line in r.out.splitlines() if line.startswith(("check-abi:", "shim: "))]
    libs = {"libcudart.so.13": ctx.probe.get("libcudart.so.13"), "libnccl.so.2": ctx.probe.get("libnccl.so.2")}
    dirs = {k: str(Path(v).parent) for k, v in libs.items() if v} if ctx.device else \
        {k: str(ctx.build / "sim") for k in libs}
    ctx.tools["bench"] = _cc(ctx, "bench", ROOT / "tests" / "intercept" / "shim_progs" / "bench.c",
                             {"libcudart.so.13": dirs["libcudart.so.13"]})
    ctx.tools["ncclcost"] = _cc(ctx, "ncclcost", HERE / "ncclcost.c", dirs)
    return {"includes": inc, "abi_checks": checked, "linked_against": dirs, "secs": round(r.secs, 1)}


PHASES = [("probe", probe), ("build", build), ("shim_under_torch", costs.shim_under_torch),
          ("call_cost", costs.call_cost), ("recovery", jobs.recovery), ("step_time", jobs.step_time),
          ("fingerprint", costs.fingerprint)]
NEEDS = {"build": ["probe"], "shim_under_torch": ["build"], "call_cost": ["build"], "recovery": ["build"],
         "step_time": ["build"], "fingerprint": ["probe"]}


def _one(ctx: Ctx, name: str, fn, results: dict[str, Any]) -> None:
    t0 = time.monotonic()
    missing = [n for n in NEEDS.get(name, []) if results[n]["status"] != "ok"]
    try:
        if missing:
            raise skip(f"{', '.join(missing)} did not pass")
        if time.monotonic() > ctx.deadline - 5:
            raise fail("out of time (--budget-s)")
        results[name] = {"status": "ok", **fn(ctx)}
    except Phase as p:
        results[name] = {"status": p.status, "why": p.why, **p.data}
    except Exception as e:  # noqa: BLE001 - a broken phase is reported, the others still run
        results[name] = {"status": "failed", "why": f"{type(e).__name__}: {e}"}
    results[name]["phase_s"] = round(time.monotonic() - t0, 1)
    print(f"gpu_check: {name}: {results[name]['status']} ({results[name]['phase_s']} s)"
          + (f": {results[name]['why']}" if "why" in results[name] else ""), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--build", type=Path, default=ROOT / "build" / "gpu_check")
    ap.add_argument("--standin", action="store_true", help="no device: the CPU stand-in, device phases skipped")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--budget-s", type=float, default=450, help="every phase ends by then (default 450)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.build / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0, results = time.monotonic(), {}
    ctx = Ctx(device=not a.standin, py=a.python, out=a.out, build=a.build, work=work, deadline=t0 + a.budget_s)
    for name, fn in PHASES:
        _one(ctx, name, fn, results)
    doc = {"mode": "device" if ctx.device else "stand-in", "host": platform.node(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _commit(), "wall_s": round(time.monotonic() - t0, 1),
           "ok": all(r["status"] != "failed" for r in results.values()), "phases": results}
    (a.out / "gpu_check.json").write_text(json.dumps(doc, indent=2) + "\n")
    table = report.table(doc)
    (a.out / "gpu_check.md").write_text(table)
    print(table, end="")
    return 0 if doc["ok"] else 1


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except OSError:
        return None
    return out if re.fullmatch(r"[0-9a-f]+", out or "") else None


if __name__ == "__main__":
    sys.exit(main())
