"""Checks of jitrun's command line that need more than argparse: each returns one line saying
what is wrong and how to fix it, or None (cli.check_args runs them before anything starts)."""

from __future__ import annotations

import math
import os
import shutil
import sys

# --jit-ec-every when not given. A snapshot costs about one minibatch of CPU per rank
# (save_fn into tmpfs, then pack + encode + place on a background thread), so the
# worst case is ~1/N: scripts/bench_ec.py --overhead measured 1.1 % (CPU) / 1.05 %
# (stall + background) at 100 and 1.4-1.9 % at 50 (README, Results). 100 keeps the
# target (< 2 %) with room for a model whose state is large for its step time; the
# cost stays 0 for a script without save_fn (nothing to snapshot).
DEFAULT_EC_EVERY = 100


# --jit-verify-every when not given: the least interval of the replicas' state checks, lengthened by the
# ranks together where a check (fingerprint, store exchange, save_fn into tmpfs) costs more than
# jitckpt/ec/schedule.BUDGET of the training time (verify/verifier.py). scripts/bench_verify.py (demo LM,
# 2 ranks, CPU): one check costs about 0.84 of a 35 ms step's CPU, so 200 is ~0.4 % there; at 6 ms
# minibatches a fixed 200 cost ~2.5 %.
DEFAULT_VERIFY_EVERY = 200


def _check_verify(args) -> str | None:
    """--jit-verify-every: not given, an adaptive interval of at least DEFAULT_VERIFY_EVERY."""
    every = getattr(args, "jit_verify_every", 0)
    args.verify_adaptive = every is None
    if every is None:
        every = args.jit_verify_every = DEFAULT_VERIFY_EVERY
    if every < 0:
        return f"--jit-verify-every {every}: expected a number of minibatches >= 0 (0 = off)"
    return None


def _check_ec(args) -> str | None:
    """--jit-ec-every / --jit-ec-code."""
    every = getattr(args, "jit_ec_every", 0)
    by_default = every is None
    args.ec_adaptive = by_default  # the default is a least interval, lengthened where snapshots cost more
    if by_default:
        every = args.jit_ec_every = DEFAULT_EC_EVERY
    if every < 0:
        return f"--jit-ec-every {every}: expected a number of minibatches >= 0 (0 = no EC snapshots)"
    from jitckpt.ec import memory as ec_memory
    from jitckpt.ec import pack as ec_pack
    from jitckpt.ec import snapshot as ec_snapshot

    try:
        code = ec_snapshot.parse_code(getattr(args, "jit_ec_code", "auto"))
    except ValueError as e:
        return f"--jit-ec-code: {e}"
    max_mem = getattr(args, "jit_ec_max_mem", None)
    if max_mem is not None or every:
        try:
            # (bytes, how it was set) for run(): parses, <= MemAvailable and the size of /dev/shm
            args.ec_cap = ec_memory.resolve_max_mem(max_mem)
        except ValueError as e:
            if by_default and max_mem is None:  # nobody asked for EC here: off, said once, no refusal
                print(f"jitrun: EC snapshots off (the default --jit-ec-every {every} needs a memory cap: {e})",
                      file=sys.stderr, flush=True)
                args.jit_ec_every = 0
                return None
            return f"--jit-ec-max-mem {e}" if max_mem is not None else f"--jit-ec-every {every}: {e}"
    if code is None or not every:
        return None
    from torch.distributed.run import parse_min_max_nnodes

    try:
        lo, hi = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        return None  # _check_sizes says what is wrong with --nnodes
    k, m = code
    if lo == hi and hi > 1 and ec_pack.max_node_losses(hi, k, m) == 0:
        return (f"--jit-ec-code {k}+{m} on {hi} nodes survives no node loss (a node would hold more than {m} "
                f"chunk(s) of a stripe); use a larger M or omit it for {'+'.join(map(str, ec_pack.default_code(hi)))}")
    return None


def _check_seconds(flag: str, value: float | None) -> str | None:
    if value is None or (math.isfinite(value) and value > 0):
        return None
    return f"{flag} {value:g}: expected a finite number of seconds > 0 (e.g. {flag} 60)"


def _check_program(args) -> str | None:
    prog = args.training_script
    if args.no_python:
        if args.module:
            return ("--no-python and -m/--module exclude each other: -m runs a Python module, "
                    "--no-python runs a program without Python; drop one of them")
        if shutil.which(prog) is None:
            where = "" if os.sep in prog else " on PATH"
            return (f"--no-python: program {prog!r} not found{where} or not executable; "
                    "pass its path, or drop --no-python to run a Python script")
        return None
    if args.module and not args.run_path:
        return None  # a module name: the workers' Python resolves it
    if os.path.isdir(prog):
        if os.path.isfile(os.path.join(prog, "__main__.py")):
            return None
        return (f"training script {prog!r} is a directory without __main__.py; "
                "pass the path of a Python script, or -m MODULE to run a module")
    if not os.path.isfile(prog):
        return (f"training script {prog!r} not found (relative to {os.getcwd()}); "
                "pass the script's path, or -m MODULE to run a module")
    return None


def _check_sizes(args) -> str | None:
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    try:
        nproc = determine_local_world_size(args.nproc_per_node)
    except ValueError as e:
        return (f"--nproc-per-node {args.nproc_per_node}: {str(e).rstrip('.')}; expected a number of workers "
                "or one of auto, cpu, gpu, xpu")
    if nproc < 1:
        return f"--nproc-per-node {args.nproc_per_node}: expected at least 1 worker"
    try:
        lo, hi = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        return f"--nnodes {args.nnodes}: expected a number of nodes N >= 1 or a range MIN:MAX, 1 <= MIN <= MAX"
    return None
