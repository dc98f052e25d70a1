#!/usr/bin/env python3
"""Erasure-coding throughput: jitckpt.ec (ISA-L via cffi) against zfec and pyeclib, in the same run.

For k=4,m=2 and k=8,m=3 on --size-mib of random data (default 256 MiB), one core each:
  encode GB/s   original bytes / time to produce all k+m chunks
  decode GB/s   original bytes / time to rebuild them with the first m data chunks lost
Ours is measured twice: with fresh output buffers (what encode()/decode() allocate) and with reused ones
(parity=, out=: how a snapshot loop runs). On this VM faulting in fresh memory runs at ~1 GB/s, slower
than the coding itself, so the two differ a lot. zfec and pyeclib allocate their outputs on every call.
Timings are the best of --repeats. Results also go to build/bench/ec.json (--out).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jitckpt.ec import Codec, crc32c  # noqa: E402

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=None, help="stripe size in MiB (default 256; 16 with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per measurement, best kept (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke test: small size, one timed run each")
    ap.add_argument("--out", default=str(ROOT / "build" / "bench" / "ec.json"), help="JSON results path")
    a = ap.parse_args(argv)
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
