"""gpu_check phases measured in one process: the shim under torch, its cost per call, the fingerprint."""

from __future__ import annotations

import json
from typing import Any

from common import ROOT, Ctx, fail, last_json, median, run, skip

# torch on the GPU with the shim preloaded: kernels, an event, and an NCCL all-reduce (a group of one).
UNDER_TORCH = r"""
import json, sys, tempfile, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="file://" + tempfile.mktemp(prefix="gpu-check-"), rank=0, world_size=1)
x = torch.ones(1 << 20, device="cuda")
dist.all_reduce(x)
ev = torch.cuda.Event()
ev.record()
y = (x * 2).sum()
ev.synchronize()
torch.cuda.synchronize()
ok = y.item() == 2 * (1 << 20)
dist.destroy_process_group()
print(json.dumps({"ok": ok, "torch": torch.__version__}))
"""


def shim_under_torch(ctx: Ctx) -> dict[str, Any]:
    """The shim preloaded under torch's own libcudart and libnccl: torch runs and its calls pass the hooks."""
    if not ctx.device:
        raise skip("needs the device (the stand-in under torch: tests/intercept/test_python_over_shim.py)")
    counters = ctx.work / "counters.json"
    r = run([ctx.py, "-c", UNDER_TORCH], env=ctx.env(LD_PRELOAD=str(ctx.shim), JITCKPT_COUNTERS_DUMP=str(counters)),
            timeout=ctx.t(120))
    if r.rc != 0 or not counters.exists():
        raise fail(f"torch under the shim exited {r.rc}", log=r.tail())
    seen = {k: v for k, v in json.loads(counters.read_text()).items() if v}
    res = last_json(r.out)
    # torch records its events with cudaEventRecord or a variant of it (flags, per-thread stream)
    missed = [w for w in ("cudaEventRecord", "ncclAllReduce") if not any(k.startswith(w) for k in seen)]
    if not res["ok"] or missed:
        raise fail(f"a wrong result, or no call of {missed} passed the hooks", counters=seen, log=r.tail())
    return {"calls_through_shim": seen, "secs": round(r.secs, 1)}


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = list(runs[0]["added_ns"])
    return {"direct_ns": {n: median([r["direct_ns"][n] for r in runs]) for n in names},
            "added_ns": {n: median([r["added_ns"][n] for r in runs]) for n in names},
            "added_ns_runs": {n: [r["added_ns"][n] for r in runs] for n in names}}


def call_cost(ctx: Ctx) -> dict[str, Any]:
    """Added ns per hooked call: each program pairs, in one process, batches through the shim with
    batches calling the library's own definitions (tests/intercept/shim_progs/bench.c, ncclcost.c)."""
    reps, nruns = (300, 3) if ctx.device else (30, 1)
    out: dict[str, Any] = {"runtime": "torch's libcudart/libnccl" if ctx.device else "the CPU stand-in",
                           "workers": "live"}
    for prog, args in (("bench", [str(reps), "live"]), ("ncclcost", [str(min(reps, 100))])):
        runs = []
        for _ in range(nruns):
            r = run([ctx.tools[prog], *args], env=ctx.env(LD_PRELOAD=str(ctx.shim)), timeout=ctx.t(120))
            if r.rc != 0:
                raise fail(f"{prog} exited {r.rc}", log=r.tail())
            res = last_json(r.out)
            if not res["shim"]:
                raise fail(f"{prog}: the shim was not loaded", log=r.tail())
            runs.append(res)
        out[prog] = _median_runs(runs)
    return out


FINGERPRINT = r"""
import json, statistics, sys, time, torch
from jitckpt.verify.fingerprint import compute
dev, mib = sys.argv[1], int(sys.argv[2])
one = [("w", torch.randn(mib << 18, device=dev))]
many = [(f"w{i}", torch.randn(1 << 20, device=dev)) for i in range(mib // 4)]
def timed(items):
    compute(items)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); compute(items); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
gib = mib / 1024
print(json.dumps({"device": dev, "mib": mib, "one_tensor_s_per_gib": timed(one) / gib,
                  "tensors_of_4mib_s_per_gib": timed(many) / gib}))
"""


def fingerprint(ctx: Ctx) -> dict[str, Any]:
    """The replicas' state fingerprint (jitckpt/verify/fingerprint.py), seconds per GiB, where the state lives."""
    dev, mib = ("cuda", 1024) if ctx.device else ("cpu", 16)
    r = run([ctx.py, "-c", FINGERPRINT, dev, str(mib)], env=ctx.env(), timeout=ctx.t(180), cwd=ROOT)
    if r.rc != 0:
        raise fail(f"fingerprint timing exited {r.rc}", log=r.tail())
    return last_json(r.out)
