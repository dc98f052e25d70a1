#!/usr/bin/env python3
"""Erasure-coding throughput: jitckpt.ec (ISA-L via cffi) against zfec and pyeclib, in the same run.

For k=4,m=2 and k=8,m=3 on --size-mib of random data (default 256 MiB), one core each:
  encode GB/s   original bytes / time to produce all k+m chunks
  decode GB/s   original bytes / time to rebuild them with the first m data chunks lost
Ours is measured twice: with fresh output buffers (what encode()/decode() allocate) and with reused ones
(parity=, out=: how a snapshot loop runs). On this VM faulting in fresh memory runs at ~1 GB/s, slower
than the coding itself, so the two differ a lot. zfec and pyeclib allocate their outputs on every call.
Timings are the best of --repeats. Results also go to build/bench/ec.json (--out).

``--overhead`` measures instead what EC snapshots cost a real training job: scripts/demo_train.py (2 ranks,
gloo, CPU) under jitrun with ``--jit-ec-every N`` for every N in ``--intervals`` (0 = no snapshots, the
baseline), all in this session, interleaved in rounds (the order rotates and reverses from round to round, so
a drift of the machine's load favours no interval). Per run, as scripts/bench_overhead.py measures it: the
mean step time after ``--warmup`` (from rank 0's per-step lines, timestamped on arrival), the median step
interval, and CPU seconds per step of the whole process tree. Each round gives the ratio snapshots/baseline
of every metric; the table shows their median (min-max) and the snapshots the background thread had to skip
(the previous one still in flight). Target: < 2 % at the recommended interval. Results go to
build/bench/ec_overhead.json (--out).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jitckpt.ec.codec import Codec, crc32c  # noqa: E402

CODES = [(4, 2), (8, 3)]


def best_time(fn: Callable[[], object], repeats: int) -> tuple[float, float, object]:
    """Best wall and best CPU time (this thread's, user + system) of ``repeats`` runs after a warm-up.

    Every codec here runs on the calling thread only, so CPU time is its cost on one core even when other
    jobs share the machine (wall time then includes waiting for a core)."""
    fn()  # warm-up: tables, caches, first-touch of reused buffers
    best, best_cpu, res = float("inf"), float("inf"), None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.thread_time()
        res = fn()
        best_cpu = min(best_cpu, time.thread_time() - c)
        best = min(best, time.perf_counter() - t)
    return best, best_cpu, res


def rates(name: str, nbytes: int, wall: float, cpu: float) -> dict:
    return {f"{name}_gbps": gbps(nbytes, wall), f"{name}_cpu_gbps": gbps(nbytes, cpu)}


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / max(seconds, 1e-9) / 1e9, 3)


def bench_ours(data: bytes, k: int, m: int, repeats: int) -> dict:
    codec = Codec(k, m)
    size = len(data)
    cs = codec.chunk_size(size)
    t_enc, c_enc, chunks = best_time(lambda: codec.encode(data), repeats)
    parity = [bytearray(cs) for _ in range(m)]
    t_enc_r, c_enc_r, chunks_r = best_time(lambda: codec.encode(data, parity=parity), repeats)
    avail = {i: chunks[i] for i in range(m, k + m)}  # the first m data chunks lost
    t_dec, c_dec, got = best_time(lambda: codec.decode(avail, size), repeats)
    ok = got == data
    out = bytearray(k * cs)
    avail_r = {i: chunks_r[i] for i in range(m, k + m)}
    t_dec_r, c_dec_r, got_r = best_time(lambda: codec.decode(avail_r, size, out=out), repeats)
    ok = ok and got_r == data
    return {**rates("encode", size, t_enc, c_enc), **rates("encode_reuse", size, t_enc_r, c_enc_r),
            **rates("decode", size, t_dec, c_dec), **rates("decode_reuse", size, t_dec_r, c_dec_r),
            "verified": bool(ok)}


def bench_zfec(data: bytes, k: int, m: int, repeats: int) -> dict:
    try:
        import zfec
    except ImportError as e:
        return {"error": f"zfec not installed ({e}); `.venv/bin/python -m pip install zfec`"}
    size = len(data)
    cs = -(-size // k)
    padded = data.ljust(k * cs, b"\0")
    # Splitting into blocks is left out of the timing (zfec needs separate bytes objects; favours zfec).
    blocks = [padded[i * cs:(i + 1) * cs] for i in range(k)]
    enc = zfec.Encoder(k, k + m)
    t_enc, c_enc, parity = best_time(lambda: enc.encode(blocks, list(range(k, k + m))), repeats)
    dec = zfec.Decoder(k, k + m)
    have = blocks[m:] + list(parity)
    nums = list(range(m, k + m))
    # zfec's decode rearranges the lists it is given: pass fresh copies on every call.
    t_dec, c_dec, got = best_time(lambda: b"".join(dec.decode(list(have), list(nums)))[:size], repeats)
    return {"version": getattr(zfec, "__version__", "?"), **rates("encode", size, t_enc, c_enc),
            **rates("decode", size, t_dec, c_dec), "verified": got == data}


def bench_pyeclib(data: bytes, k: int, m: int, repeats: int, ec_type: str) -> dict:
    try:
        from pyeclib.ec_iface import ECDriver
        drv = ECDriver(k=k, m=m, ec_type=ec_type)
    except Exception as e:  # ImportError, or ECBackendNotAvailable for a backend library that is missing
        return {"error": f"pyeclib {ec_type} unavailable: {type(e).__name__}: {e}"}
    size = len(data)
    t_enc, c_enc, frags = best_time(lambda: drv.encode(data), repeats)
    have = frags[m:]  # pyeclib orders fragments data first, then parity
    t_dec, c_dec, got = best_time(lambda: drv.decode(have), repeats)
    import pyeclib
    return {"version": getattr(pyeclib, "__version__", "?"), "ec_type": ec_type, **rates("encode", size, t_enc, c_enc),
            **rates("decode", size, t_dec, c_dec), "verified": got == data}


def bench_checksums(data: bytes) -> dict:
    n = min(len(data), 64 << 20)
    view = memoryview(data)[:n]
    res = {}
    for name, fn in [("crc32c_isal", lambda: crc32c(view)), ("zlib_crc32", lambda: zlib.crc32(view)),
                     ("sha256", lambda: hashlib.sha256(view).digest())]:
        _, c, _ = best_time(fn, 2)
        res[name + "_cpu_gbps"] = gbps(n, c)
    return res


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 1) if a and b else None


# -- step-time overhead of EC snapshots in a real job (--overhead) ------------------------------------------

OVERHEAD_METRICS = ("step_s", "step_median_s", "cpu_per_step_s")


def _ec_run(every: int, steps: int, warmup: int, train_args: list[str], work: Path, shm: Path, n: int,
            timeout_s: float) -> dict:
    """One jitrun of the demo with --jit-ec-every ``every`` (0: none): steady-state step metrics."""
    import bench_overhead as bo

    jit_dir = work / f"jit-{n}"
    cmd = [sys.executable, "-m", "jitrun.cli", "--standalone", "--nproc-per-node", "2", "--jit-dir", str(jit_dir),
           *(["--jit-ec-every", str(every)] if every else []), bo.TRAIN, "--steps", str(steps), "--log-every", "1",
           *train_args]
    cpu: dict[int, float] = {}

    def on_line(_t: float, line: str, pid: int) -> None:
        m = bo.STEP_RE.match(line)
        if m and int(m.group(1)) in (warmup, steps - 1):
            cpu[int(m.group(1))] = bo.tree_cpu_s(pid)

    log = bo.run_timestamped(cmd, env={"JITCKPT_EC_SHM": str(shm), "JITCKPT_EC_STATS": "1"}, timeout_s=timeout_s,
                             cwd=str(work), on_line=on_line)
    shutil.rmtree(jit_dir, ignore_errors=True)
    text = log.text()
    if log.timed_out or log.returncode != 0 or len(cpu) != 2:
        tail = "\n".join(line for _, line in log.lines[-30:])
        raise RuntimeError(f"--jit-ec-every {every}: run failed (rc={log.returncode}, timed_out={log.timed_out}):"
                           f"\n{tail}")
    seen = bo.step_times(log.lines)
    due = len([s for s in range(1, steps) if every and s % every == 0])
    return {"every": every, "step_s": bo.steady_step_s(seen, warmup),
            "step_median_s": bo.median_step_s(seen, warmup),
            "cpu_per_step_s": (cpu[steps - 1] - cpu[warmup]) / (steps - 1 - warmup),
            "snapshots_due": due, "snapshots_skipped": text.count("skipped by every rank"),
            "ec_disabled": "EC snapshots disabled" in text or "EC snapshots DISABLED" in text,
            "ec_stats": next((json.loads(line.split("EC stats: ", 1)[1]) for _, line in reversed(log.lines)
                              if "[jitckpt] EC stats: " in line), None)}


def state_bytes(train_args: list[str]) -> int:
    """Bytes one rank's save_fn writes for this model (what every snapshot packs and codes)."""
    import tempfile as _tf

    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from demo_train import TinyLM

    ap = argparse.ArgumentParser()
    for flag, default in (("--vocab", 256), ("--d-model", 64), ("--layers", 2), ("--seq", 32)):
        ap.add_argument(flag, type=int, default=default)
    a, _ = ap.parse_known_args(train_args)
    model = TinyLM(a.vocab, a.d_model, a.layers, 4, a.seq, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, a.seq, dtype=torch.long)).sum().backward()
    opt.step()  # Adam's moments exist from the first step on
    with _tf.TemporaryDirectory() as d:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(d, "s.pt"))
        return os.path.getsize(os.path.join(d, "s.pt"))


def bench_overhead(intervals: list[int], rounds: int, steps: int, warmup: int, train_args: list[str],
                   timeout_s: float, say: Callable[..., None]) -> dict:
    import statistics

    sys.path.insert(0, str(ROOT / "scripts"))
    work = Path(tempfile.mkdtemp(prefix="jitckpt-bench-ec-"))
    shm_parent = "/dev/shm" if os.path.isdir("/dev/shm") else None
    shm = Path(tempfile.mkdtemp(prefix="jitckpt-bench-ec-", dir=shm_parent))  # the chunks' /dev/shm, ours alone
    runs: dict[int, list[dict]] = {n: [] for n in intervals}
    try:
        for r in range(rounds):
            k = r % len(intervals)
            order = intervals[k:] + intervals[:k]
            if r % 2:
                order = order[::-1]
            for i, n in enumerate(order):
                res = _ec_run(n, steps, warmup, train_args, work, shm, r * len(intervals) + i, timeout_s)
                runs[n].append(res)
                say(f"  round {r + 1}/{rounds}  --jit-ec-every {n:<4} mean step {res['step_s'] * 1e3:7.2f} ms  "
                    f"median {res['step_median_s'] * 1e3:7.2f} ms  CPU/step {res['cpu_per_step_s'] * 1e3:7.2f} ms"
                    + (f"  ({res['snapshots_skipped']} of {res['snapshots_due']} snapshots skipped)" if n else ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    base = runs[0]
    out: dict = {"intervals": {}}
    for n in intervals:
        if n == 0:
            continue
        row: dict = {"runs": runs[n]}
        for metric in OVERHEAD_METRICS:
            ratios = [a[metric] / b[metric] for a, b in zip(runs[n], base, strict=True)]
            row[metric] = {"ratios": ratios, "median": statistics.median(ratios), "min": min(ratios),
                           "max": max(ratios), "overhead_pct": (statistics.median(ratios) - 1) * 100}
        st = [x["ec_stats"] for x in runs[n] if x.get("ec_stats") and x["ec_stats"]["versions"]]
        if st:
            stall = statistics.median(x["stall_s_median"] for x in st)
            bg = statistics.median(x["bg_cpu_s_median"] for x in st)
            step = statistics.median(x["step_s"] for x in base)
            stall_cpu = statistics.median(x.get("stall_cpu_s_median") or 0.0 for x in st)
            cpu_rank = statistics.median(x["cpu_per_step_s"] for x in base) / 2  # 2 ranks (+ the agent's little)
            row["per_snapshot"] = {"stall_s": stall, "bg_cpu_s": bg, "stall_cpu_s": stall_cpu,
                                   # load-independent: CPU per snapshot over N steps' CPU of one rank, with the
                                   # background thread's CPU (CPU-bound job) or without (a core of its own)
                                   "est_cpu_overhead_pct": 100 * (stall_cpu + bg) / (n * cpu_rank),
                                   "est_cpu_overhead_stall_pct": 100 * stall_cpu / (n * cpu_rank),
                                   "committed_last": [x["committed"] for x in st],
                                   # what a snapshot costs training per step, from its own costs: the stall only
                                   # when the background thread has a core of its own (a GPU job), the stall
                                   # plus its CPU when it takes it from training (this CPU-only job, worst case)
                                   "est_overhead_stall_pct": 100 * stall / (n * step),
                                   "est_overhead_stall_bg_pct": 100 * (stall + bg) / (n * step)}
        row["snapshots_skipped"] = sum(x["snapshots_skipped"] for x in runs[n])
        row["snapshots_due"] = sum(x["snapshots_due"] for x in runs[n])
        out["intervals"][str(n)] = row
    out["baseline"] = {m: statistics.median(x[m] for x in base) for m in OVERHEAD_METRICS}
    out["baseline_runs"] = base
    return out


def _print_overhead(res: dict, target_pct: float) -> None:
    b = res["baseline"]
    print(f"\nbaseline (no snapshots): mean step {b['step_s'] * 1e3:.2f} ms, median {b['step_median_s'] * 1e3:.2f} ms, "
          f"CPU {b['cpu_per_step_s'] * 1e3:.2f} ms/step (medians over rounds)")
    print(f"{'--jit-ec-every':>14}  {'mean-step ratio':>26}  {'median-step ratio':>26}  {'CPU/step ratio':>26}  "
          "skipped")
    for n, row in res["intervals"].items():
        cells = [f"{row[m]['median']:.3f} ({row[m]['min']:.3f}-{row[m]['max']:.3f})" for m in OVERHEAD_METRICS]
        print(f"{n:>14}  {cells[0]:>26}  {cells[1]:>26}  {cells[2]:>26}  "
              f"{row['snapshots_skipped']}/{row['snapshots_due']}")
    print("per snapshot (rank 0, medians): main-thread stall / background-thread CPU, and the overhead they imply "
          "at the baseline step time: stall only (background on a spare core) / stall + background CPU")
    for n, row in res["intervals"].items():
        ps = row.get("per_snapshot")
        if ps:
            print(f"{n:>14}  stall {ps['stall_s'] * 1e3:6.2f} ms  background CPU {ps['bg_cpu_s'] * 1e3:6.2f} ms  "
                  f"-> {ps['est_overhead_stall_pct']:.2f} % / {ps['est_overhead_stall_bg_pct']:.2f} %;  in CPU "
                  f"time (load-independent): stall {ps.get('stall_cpu_s', 0) * 1e3:6.2f} ms -> "
                  f"{ps.get('est_cpu_overhead_stall_pct', 0):.2f} % / {ps.get('est_cpu_overhead_pct', 0):.2f} % of "
                  "a rank's CPU per step")
    def met_from(pct) -> int | None:
        """The smallest interval from which on every measured interval is under the target."""
        ns = sorted(int(n) for n in res["intervals"])
        good = [n for n in ns if all((pct(res["intervals"][str(x)]) or 0) < target_pct for x in ns if x >= n)]
        return min(good) if good else None

    res["target_pct"] = target_pct
    res["met_from"] = {
        # per-snapshot costs: robust to other load (CPU time and a short stall), the worst case of a CPU-bound job
        "cpu_estimate_stall_bg": met_from(lambda r: r.get("per_snapshot", {}).get("est_cpu_overhead_pct")),
        "cpu_estimate_stall": met_from(lambda r: r.get("per_snapshot", {}).get("est_cpu_overhead_stall_pct")),
        "estimate_stall_bg": met_from(lambda r: r.get("per_snapshot", {}).get("est_overhead_stall_bg_pct")),
        "estimate_stall": met_from(lambda r: r.get("per_snapshot", {}).get("est_overhead_stall_pct")),
        "cpu_per_step_ratio": met_from(lambda r: r["cpu_per_step_s"]["overhead_pct"]),
        "mean_step_ratio": met_from(lambda r: r["step_s"]["overhead_pct"]),
    }
    res["recommended_every"] = res["met_from"]["cpu_estimate_stall_bg"]
    say = {None: "not met at any measured interval"}
    print(f"target < {target_pct:g} %, met from --jit-ec-every ... on: "
          + "; ".join(f"{k.replace('_', ' ')}: {say.get(v, v)}" for k, v in res["met_from"].items())
          + " (the wall-clock ratios are only as good as the machine is quiet: see their min-max)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=None, help="stripe size in MiB (default 256; 16 with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per measurement, best kept (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke test: small size, one timed run each")
    ap.add_argument("--out", default=None, help="JSON results path (default build/bench/ec.json, "
                    "with --overhead build/bench/ec_overhead.json)")
    g = ap.add_argument_group("--overhead: step-time cost of EC snapshots in a real 2-rank job under jitrun")
    g.add_argument("--overhead", action="store_true", help="measure that instead of the codec throughput")
    g.add_argument("--intervals", default="0,10,25,50,100",
                   help="comma-separated --jit-ec-every values; 0 (no snapshots, the baseline) is always run")
    g.add_argument("--rounds", type=int, default=4, help="interleaved rounds over all intervals (default 4)")
    g.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    g.add_argument("--warmup", type=int, default=20, help="first steps left out of the means (default 20)")
    g.add_argument("--train-args", default="", help="extra demo_train.py arguments, e.g. '--d-model 256 --layers 4'")
    g.add_argument("--target-pct", type=float, default=2.0, help="overhead target in percent (default 2)")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is killed")
    a = ap.parse_args(argv)
    if a.overhead:
        return main_overhead(a, ap)
    a.out = a.out or str(ROOT / "build" / "bench" / "ec.json")
    size_mib = a.size_mib if a.size_mib is not None else (16 if a.quick else 256)
    repeats = a.repeats if a.repeats is not None else (1 if a.quick else 3)
    if size_mib < 1 or repeats < 1:
        ap.error("--size-mib and --repeats must be >= 1")

    data = os.urandom(size_mib << 20)
    load = os.getloadavg()
    print(f"bench_ec: {size_mib} MiB, best of {repeats}, one thread; load average {load[0]:.2f} "
          f"on {os.cpu_count()} CPUs")
    results = {"size_mib": size_mib, "repeats": repeats, "machine": platform.machine(),
               "cpu": _cpu_model(), "cpus": os.cpu_count(), "loadavg_start": load, "codes": []}
    for k, m in CODES:
        row = {"k": k, "m": m, "ours": bench_ours(data, k, m, repeats), "zfec": bench_zfec(data, k, m, repeats),
               "pyeclib": bench_pyeclib(data, k, m, repeats, "liberasurecode_rs_vand"),
               "pyeclib_isal": bench_pyeclib(data, k, m, repeats, "isa_l_rs_cauchy")}
        o = row["ours"]
        # ratios of CPU-time throughputs (one core each), robust to other load on the machine
        row["ratios"] = {
            f"{op}{'_reuse' if reuse else ''}_vs_{lib}": ratio(o[f"{op}{'_reuse' if reuse else ''}_cpu_gbps"],
                                                               row[lib].get(f"{op}_cpu_gbps"))
            for op in ("encode", "decode") for reuse in (False, True) for lib in ("zfec", "pyeclib", "pyeclib_isal")}
        results["codes"].append(row)
        _print_row(row)
    results["checksums"] = bench_checksums(data)
    print("checksums (CPU GB/s, 64 MiB): " + ", ".join(f"{k[:-9]} {v}" for k, v in results["checksums"].items()))
    results["loadavg_end"] = os.getloadavg()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    bad = [f"{r['k']}+{r['m']} {lib}" for r in results["codes"] for lib in ("ours", "zfec", "pyeclib", "pyeclib_isal")
           if r[lib].get("verified") is False]
    if bad:
        print(f"DECODE MISMATCH: {bad}", file=sys.stderr)
        return 1
    return 0


def main_overhead(a: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    try:
        intervals = sorted({0, *(int(x) for x in a.intervals.split(",") if x.strip())})
    except ValueError:
        ap.error(f"--intervals {a.intervals!r}: expected comma-separated integers")
    if intervals[0] < 0 or a.rounds < 1 or a.steps < a.warmup + 10:
        ap.error("--intervals must be >= 0, --rounds >= 1 and --steps >= --warmup + 10")
    train_args = a.train_args.split()
    load = os.getloadavg()
    nbytes = state_bytes(train_args)
    print(f"bench_ec --overhead: demo LM {' '.join(train_args) or '(defaults)'}, 2 ranks (gloo, CPU), one node "
          f"(code 1+0), {a.steps} steps/run, steady state after step {a.warmup}, {a.rounds} rounds; state per rank "
          f"{nbytes / 2**20:.2f} MiB; load average {load[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    res = bench_overhead(intervals, a.rounds, a.steps, a.warmup, train_args, a.timeout,
                         lambda *x: print(*x, flush=True))
    res.update({"train_args": train_args, "state_bytes_per_rank": nbytes, "steps": a.steps, "warmup": a.warmup,
                "rounds": a.rounds, "cpus": os.cpu_count(), "cpu": _cpu_model(), "loadavg_start": load,
                "loadavg_end": os.getloadavg()})
    _print_overhead(res, a.target_pct)
    out = Path(a.out or ROOT / "build" / "bench" / "ec_overhead.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _print_row(row: dict) -> None:
    k, m, o = row["k"], row["m"], row["ours"]
    print(f"\nk={k} m={m}   GB/s on one core (CPU time) [wall clock]")
    print(f"  ours (ISA-L, cffi)   encode {o['encode_cpu_gbps']:7.2f} [{o['encode_gbps']:6.2f}]"
          f"  reused buffers {o['encode_reuse_cpu_gbps']:7.2f} [{o['encode_reuse_gbps']:6.2f}]"
          f"   decode {o['decode_cpu_gbps']:7.2f} [{o['decode_gbps']:6.2f}]"
          f"  reused {o['decode_reuse_cpu_gbps']:7.2f} [{o['decode_reuse_gbps']:6.2f}]")
    for lib, label in (("zfec", "zfec"), ("pyeclib", "pyeclib rs_vand"), ("pyeclib_isal", "pyeclib isa_l")):
        r = row[lib]
        if "error" in r:
            print(f"  {lib}: unavailable: {r['error']}")
            continue
        print(f"  {label:<20} encode {r['encode_cpu_gbps']:7.2f} [{r['encode_gbps']:6.2f}]{'':33}"
              f"decode {r['decode_cpu_gbps']:7.2f} [{r['decode_gbps']:6.2f}]")
        rr = row["ratios"]
        print(f"    ours/{lib}: encode {rr[f'encode_vs_{lib}']}x (reused {rr[f'encode_reuse_vs_{lib}']}x), "
              f"decode {rr[f'decode_vs_{lib}']}x (reused {rr[f'decode_reuse_vs_{lib}']}x)")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


if __name__ == "__main__":
    sys.exit(main())
