"""gpu_check phases that run the 2-rank DDP job (train.py): recovery under jitrun, step time."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from common import HERE, ROOT, Ctx, Run, fail, last_json, median, run

sys.path.insert(0, str(ROOT / "scripts"))
from compare_state import diff_states  # noqa: E402

TRAIN = HERE / "train.py"
# rank 1 fails in minibatch STEP: SIGKILLed in its backward; SIGSTOPped in the gradient all-reduce
FAULTS = {"sigkill": "rank=1,step={step},phase=backward,kind=sigkill",
          "sigstop": "rank=1,step={step},phase=allreduce,kind=sigstop"}


def torchrun(ctx: Ctx, args: list[str], timeout: float) -> Run:
    return run([ctx.py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TRAIN, *args],
               env=ctx.env(), timeout=ctx.t(timeout), cwd=ctx.work)


def jitrun(ctx: Ctx, jit_dir: Path, args: list[str], timeout: float, fault: str = "", hang_s: int = 10) -> Run:
    """The launch line users type (no rendezvous flags), with the shim preloaded into the workers."""
    cmd = [ctx.py, "-m", "jitrun.cli", "--nproc-per-node", "2", "--jit-intercept", "on", "--max-restarts", "2",
           "--jit-timeout", str(hang_s), "--jit-dir", jit_dir, TRAIN, *args]
    return run(cmd, env=ctx.env(**({"JITCKPT_FAULT": fault} if fault else {})), timeout=ctx.t(timeout),
               cwd=ctx.work)


def _events(jit_dir: Path) -> list[dict[str, Any]]:
    p = jit_dir / "events.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _recovered(ctx: Ctx, kind: str, step: int, train: list[str], ref: Path) -> dict[str, Any]:
    jit, out = ctx.work / f"jit-{kind}", ctx.work / f"{kind}.pt"
    shutil.rmtree(jit, ignore_errors=True)
    r = jitrun(ctx, jit, [*train, "--out", str(out)], timeout=240, fault=FAULTS[kind].format(step=step),
               hang_s=10 if ctx.device else 3)
    evs = _events(jit)
    fired = [e for e in evs if e["event"] == "fault_injected"]
    rec = [e for e in evs if e["event"] == "recovery"]
    res: dict[str, Any] = {"rc": r.rc, "secs": round(r.secs, 1), "faults_fired": len(fired),
                           "recoveries": len(rec)}
    if rec:
        res.update({k: rec[0].get(k) for k in ("failure_to_resumed_s", "detection_s", "checkpoint_s",
                                                "restart_to_resumed_s", "redone_minibatches")})
    if r.rc != 0 or not out.exists():
        raise fail(f"jitrun with a {kind} of rank 1 exited {r.rc}", **res, log=r.tail())
    n, diffs = diff_states(str(ref), str(out))
    res.update({"entries": n, "identical": not diffs})
    if diffs or len(fired) != 1 or not rec:
        raise fail(f"{kind}: {len(fired)} fault(s) fired, {len(rec)} recovery(ies), "
                   f"{len(diffs)} entries differ from torchrun", **res, differs=diffs[:5])
    return res


def recovery(ctx: Ctx) -> dict[str, Any]:
    """2 ranks under `jitrun --jit-intercept on`: one SIGKILLed, then (another run) one SIGSTOPped;
    each run's final model and optimizer state equal, bit for bit, plain torchrun's without a failure."""
    dev = "cuda" if ctx.device else "cpu"
    steps, step = (40, 15) if ctx.device else (10, 4)
    train = ["--device", dev, "--steps", str(steps)] + ([] if ctx.device else ["--width", "32", "--batch", "16"])
    ref = ctx.work / "reference.pt"
    r = torchrun(ctx, [*train, "--out", str(ref)], timeout=180)
    if r.rc != 0:
        raise fail(f"the torchrun reference exited {r.rc}", log=r.tail())
    out: dict[str, Any] = {"device": dev, "steps": steps, "fault_step": step,
                           "process_groups": "gloo for DDP (CUDA tensors); one NCCL group per rank (itself)"
                           if ctx.device else "gloo (CPU)", "reference_secs": round(r.secs, 1)}
    failed = []
    for kind in ("sigkill", "sigstop"):
        try:
            out[kind] = _recovered(ctx, kind, step, train, ref)
        except Exception as e:  # noqa: BLE001 - the other kind still runs; both are reported
            out[kind] = {"failed": str(e), **getattr(e, "data", {})}
            failed.append(kind)
    if failed:
        raise fail(f"recovery failed for {', '.join(failed)}", **out)
    return out


CALIBRATE = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
from train import mlp
width, depth, target = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
model = mlp(width, depth).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
def step_s(bs):
    x, y = torch.randn(bs, width, device="cuda"), torch.randn(bs, 1, device="cuda")
    ts = []
    for _ in range(6):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
        torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return sorted(ts)[3]
bs = 1024
while step_s(bs) < target and bs < (1 << 20):
    bs *= 2
print(json.dumps({"batch": bs, "alone_s": step_s(bs)}))
"""


def _config(ctx: Ctx) -> tuple[list[str], dict[str, Any]]:
    """The step-time job: on the GPU, a batch for ~25 ms of one rank's work alone (two ranks share the
    device: ~50 ms a step); on the CPU a small one, only to keep the phase running."""
    if not ctx.device:
        return ["--device", "cpu", "--steps", "10", "--width", "32", "--batch", "16"], {"warmup": 2}
    width, depth = 1024, 4
    r = run([ctx.py, "-c", CALIBRATE, str(HERE), str(width), str(depth), "0.025"], env=ctx.env(), timeout=ctx.t(120))
    if r.rc != 0:
        raise fail(f"calibration exited {r.rc}", log=r.tail())
    cal = last_json(r.out)
    args = ["--device", "cuda", "--steps", "160", "--width", str(width), "--depth", str(depth),
            "--batch", str(cal["batch"])]
    return args, {"warmup": 20, "width": width, "depth": depth, **cal}


def _steady_ms(times_file: Path, warmup: int) -> float:
    t = json.loads(times_file.read_text())
    return 1000 * median([b - a for a, b in zip(t[warmup:], t[warmup + 1:], strict=False)])


def step_time(ctx: Ctx) -> dict[str, Any]:
    """Steady-state step time, jitrun (shim on) against torchrun, interleaved T J J T (T J on the CPU)."""
    args, info = _config(ctx)
    order = ["torchrun", "jitrun", "jitrun", "torchrun"] if ctx.device else ["torchrun", "jitrun"]
    ms: dict[str, list[float]] = {"torchrun": [], "jitrun": []}
    for i, who in enumerate(order):
        times = ctx.work / f"times-{i}.json"
        a = [*args, "--times", str(times)]
        r = torchrun(ctx, a, 300) if who == "torchrun" else jitrun(ctx, ctx.work / f"jit-steps-{i}", a, 300)
        if r.rc != 0 or not times.exists():
            raise fail(f"{who} run {i} exited {r.rc}", log=r.tail())
        ms[who].append(round(_steady_ms(times, info["warmup"]), 3))
    t, j = median(ms["torchrun"]), median(ms["jitrun"])
    return {**info, "order": order, "step_ms": ms, "torchrun_ms": t, "jitrun_ms": j,
            "jitrun_over_torchrun": round(j / t, 4)}
