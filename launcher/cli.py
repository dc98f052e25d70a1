"""``jitrun``: every torchrun option, plus --jit-* options; ``jitrun plan`` for the cost model.

Workers start through ``python -m jitckpt._bootstrap`` so failure detection
is in place without code changes (not with --no-python, which runs the
program as is). Environment given to workers: JITCKPT_DIR, JITCKPT_JOB_ID,
JITCKPT_TOKEN, JITCKPT_TIMEOUT, JITCKPT_EC_EVERY, JITCKPT_EC_CODE and, after a
failure, JITCKPT_RESTORE_STEP (with an EC snapshot chosen, also
JITCKPT_RESTORE_SOURCE=ec and JITCKPT_EC_FALLBACK_STEP).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import uuid
from pathlib import Path

from jitckpt import torch_compat
from jitckpt.wire import contract, layout
from jitckpt.wire.config import DEFAULT_TIMEOUT_S

from . import worker_env
from .arg_checks import (
    DEFAULT_EC_EVERY,
    DEFAULT_VERIFY_EVERY,
    _check_ec,
    _check_program,
    _check_seconds,
    _check_sizes,
    _check_verify,
)
from .preempt import DEFAULT_GRACE_S, EXIT_PREEMPTED, Preempted, Preemption

_DESCRIPTION = """\
jitrun: torchrun with just-in-time checkpointing. It takes every torchrun
option plus the --jit-* options below. When a rank crashes or a collective
hangs, the healthy ranks save a checkpoint of the current step and the job
restarts from it (up to --max-restarts): only that minibatch is done again.

commands:
  jitrun [options] training_script [args ...]
                  launch training_script (or -m module) on this node, like torchrun
  jitrun plan     the cost model: JIT vs periodic checkpointing for a job and
                  cluster (jitrun plan --help)
  jitrun events   merge the event logs of several nodes (jitrun events --help)
  jitrun doctor   whether CRIU, network namespaces, the shim and ISA-L work here
  jitrun clean    free a job's EC snapshot chunks in /dev/shm and its jit dir's stale
                  temp files (jitrun clean --help)
  jitrun migrate  move live workers of a --jit-migratable job to another node (CRIU)
                  at their next minibatch start (jitrun migrate --help)"""

_EPILOG = """\
The jit dir (--jit-dir, default ./jitckpt_runs/<job id>) holds the checkpoints
and the timeline events.jsonl. Re-running the same command (the same
--rdzv-id, script and arguments) resumes from it, unless that run finished
(exit 0): then the job starts fresh and says so (--jit-resume continues
instead); another job pointed at it is refused, and so is a second jitrun of
the job while it runs (one job per jit dir: <jit dir>/jitrun.lock). Workers get
JITCKPT_DIR, JITCKPT_JOB_ID, JITCKPT_TOKEN, JITCKPT_TIMEOUT and, after a
failure, JITCKPT_RESTORE_STEP in their environment."""


def _parser():
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    torch_compat.unset_master_port_default(p)
    p.prog = "jitrun"
    p.usage = ("jitrun [torchrun options] [--jit-* options] training_script [args ...]\n"
               "       jitrun plan [options]     (jitrun plan --help)\n"
               "       jitrun events [options]   (jitrun events --help)\n"
               "       jitrun doctor             (jitrun doctor --help)\n"
               "       jitrun clean --jit-dir DIR (jitrun clean --help)\n"
               "       jitrun migrate --jit-dir DIR --rank R --to ADDR (jitrun migrate --help)")
    p.description = _DESCRIPTION
    p.epilog = _EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter

    def error(message: str) -> None:  # one line, not torchrun's 20-line usage
        p.exit(2, f"jitrun: error: {message} (see jitrun --help)\n")

    p.error = error
    _add_jit_options(p.add_argument_group("jitckpt"))
    return p


def _add_jit_options(g) -> None:
    g.add_argument("--jit-dir", default=None,
                   help="checkpoint root for JIT checkpoints and events.jsonl "
                        "(default: ./jitckpt_runs/<job id>)")
    g.add_argument("--jit-timeout", type=_timeout_arg, default=None, metavar="SECONDS|fixed:SECONDS",
                   help="hangs are detected from the job's own timing: a rank waiting in a collective past "
                        "max(1 s, 5x its recent minibatch and wait times) has its lagging peers checked, and a "
                        "stopped, deaf or stuck one is ended (the healthy ranks save). SECONDS: the ceiling on "
                        f"that bound (default {DEFAULT_TIMEOUT_S:.0f}); fixed:SECONDS: the old fixed timeout, "
                        "nothing learned (also the process group timeout)")
    g.add_argument("--jit-save-timeout", type=float, default=120.0,
                   help="seconds allowed for the JIT save after detection before giving up on it "
                        "(default 120)")
    g.add_argument("--jit-preempt-grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                   help="on SIGTERM or SIGINT (a scheduler's preemption: Slurm's scancel, a pod deletion; Ctrl-C) "
                        "the workers take the JIT checkpoint of the current minibatch and jitrun exits "
                        f"{EXIT_PREEMPTED}; saves not done within this many seconds of the signal are killed, and a "
                        "second signal kills them at once. Keep it under the scheduler's own grace (Slurm KillWait, "
                        f"Kubernetes terminationGracePeriodSeconds: 30 s by default) (default {DEFAULT_GRACE_S:g})")
    g.add_argument("--jit-health-interval", type=float, default=30.0,  # launcher/devices/health.py
                   help="seconds between NVML health checks of this node's devices while the job runs "
                        "(0: only before each start); a failing device's ranks are migrated or restarted "
                        "without it, as the scheduler hook says (default 30)")
    g.add_argument("--jit-scheduler", default="local",
                   help="scheduler hook: 'local' or 'exec:/path/to/program' (JSON in, JSON out)")
    g.add_argument("--jit-intercept", choices=("auto", "on", "off"), default="auto",
                   help="LD_PRELOAD libjitintercept into workers: auto = when CUDA devices are visible")
    g.add_argument("--jit-resume", action="store_true",
                   help="continue from the checkpoints of a run of this job that already finished (exit 0); "
                        "by default such a run's checkpoints are moved aside and the job starts fresh")
    g.add_argument("--jit-warm-start", choices=("on", "off"), default="on",
                   help="fork workers from a server that has torch imported, so a restart does not pay for "
                        "Python and torch start-up (default on; off: fresh `python -u` processes like "
                        "torchrun; never with --no-python, --run-path or libintercept)")
    g.add_argument("--jit-ec-every", type=int, default=None, metavar="N",
                   help="every N minibatches, an erasure-coded snapshot of every rank's save_fn state in the "
                        "nodes' /dev/shm: the fallback when no replica can take the JIT checkpoint "
                        f"(default: at least every {DEFAULT_EC_EVERY}, further apart where a snapshot costs more "
                        "than 0.2%% of the training; 0 = off; nothing is taken without a registered save_fn)")
    g.add_argument("--jit-ec-code", default="auto", metavar="K+M",
                   help="erasure code of the snapshots: K data + M parity chunks per rank, on distinct nodes "
                        "(default auto: 1+0 on one node, 2+1 on three, ...; see jitckpt.ec.pack.default_code)")
    g.add_argument("--jit-ec-max-mem", default=None, metavar="SIZE",
                   help="most /dev/shm memory this job's EC snapshots may use on each node: bytes with a K/M/G/T "
                        "suffix (powers of 1024) or a percentage of MemAvailable (default 25%% of MemAvailable, "
                        "at most the size of /dev/shm). Checked at start (at most MemAvailable) and at every "
                        "snapshot from the first (2 versions of the node's chunks + staging must fit; else EC "
                        "snapshots are disabled for the job, loudly, and training goes on)")
    g.add_argument("--jit-verify-every", type=int, default=None, metavar="N",
                   help="every N minibatches the data-parallel replicas compare fingerprints of their parameters "
                        "and optimizer state; on a mismatch the job rolls back to the last verified state (at "
                        f"most N minibatches redone) and names the odd replica (default: at least every "
                        f"{DEFAULT_VERIFY_EVERY}, further apart where a check costs more than 0.2%% of the training; "
                        "0 = off; the check after every restore, before the first step, is always on)")
    g.add_argument("--jit-migratable", choices=("on", "off"), default="off",  # launcher/migration/control.py
                   help="run every worker as PID 1 of its own PID namespace, output to <jit dir>/migrate/out/, "
                        "so CRIU can move it to another node (jitrun migrate) and, with the shim preloaded, "
                        "move a rank whose device died to a spare device (scheduler hook: device_lost); "
                        "turns warm start off")


def _timeout_arg(raw: str) -> tuple[float, bool]:
    from jitckpt.hang.bound import parse_timeout

    try:
        return parse_timeout(raw)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_args(args) -> str | None:
    """What is wrong with the command line, as one line for stderr, or None.
    Run before anything is created on disk or started."""
    from .jobdir import blank_path_option

    err = (blank_path_option(args)
           or _check_seconds("--jit-timeout", args.jit_timeout[0] if args.jit_timeout else None)
           or _check_seconds("--jit-save-timeout", args.jit_save_timeout)
           or _check_seconds("--jit-preempt-grace", getattr(args, "jit_preempt_grace", None))
           or (None if args.jit_health_interval == 0 else
               _check_seconds("--jit-health-interval", args.jit_health_interval))
           or _check_sizes(args)
           or _check_ec(args)
           or _check_verify(args)
           or _check_program(args)
           or _check_token(args))
    if err:
        return err
    env_timeout = contract.TIMEOUT.raw()
    if args.jit_timeout is None and env_timeout:
        try:
            bad = _check_seconds(contract.TIMEOUT.name, contract.TIMEOUT.get())
        except ValueError:
            bad = "not a number"
        if bad:
            return (f"{contract.TIMEOUT.name}={env_timeout!r} in the environment is not a finite number "
                    "of seconds > 0; unset it or pass --jit-timeout SECONDS")
    try:
        contract.hang_rule()
    except ValueError as e:
        return (f"the hang bound's settings in the environment: {e} ({contract.TIMEOUT_FLOOR.name}, "
                f"{contract.TIMEOUT_MULT.name} and {contract.TIMEOUT_STARTUP.name} must be numbers > 0)")
    return None


def _check_token(args) -> str | None:
    """Sets ``args.job_token``: JITCKPT_TOKEN, or for a one-node job a random one."""
    from torch.distributed.run import parse_min_max_nnodes

    from jitckpt.wire import auth

    try:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        max_nodes = 1  # the nnodes check reports it
    try:
        args.job_token = auth.job_token(contract.TOKEN.raw(), 1 if args.standalone else max_nodes)
    except ValueError as e:
        return str(e)
    return None


def job_id_for(args) -> str:
    """Stable identity of a job: the rendezvous id when given, else the command.
    Re-running the same command resumes from its jit dir; a different job
    pointed at the same dir is refused."""
    if contract.JOB_ID.get():
        return contract.JOB_ID.get()
    if args.rdzv_id and args.rdzv_id != "none":
        return args.rdzv_id
    ident = "\0".join([os.path.abspath(args.training_script), *args.training_script_args])
    return "cmd-" + hashlib.sha256(ident.encode()).hexdigest()[:16]


def _intercept_lib() -> str | None:
    cand = contract.INTERCEPT_LIB.get() or str(
        Path(__file__).resolve().parent.parent / "build" / "libjitintercept.so")
    return cand if os.path.isfile(cand) else None


def _want_intercept(mode: str) -> bool:
    if mode == "off":
        return False
    if mode == "on":
        return True
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return vis.strip() not in ("", "-1")
    return any(Path("/dev").glob("nvidia[0-9]*"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        from . import plan

        return plan.main(argv[1:])
    if argv[:1] == ["events"]:
        from . import events

        return events.main(argv[1:])
    if argv[:1] == ["doctor"]:
        from . import doctor

        return doctor.main(argv[1:])
    if argv[:1] == ["clean"]:
        from . import ec_clean

        return ec_clean.main(argv[1:])
    if argv[:1] == ["migrate"]:
        from .migration import control as migrate

        return migrate.main(argv[1:])
    args = _parser().parse_args(argv)
    args.argv = list(argv)  # a replacement agent is started with the same command
    return run(args)


def run(args) -> int:
    from .jobdir import DISK_ERRNOS

    try:
        return _run(args)
    except OSError as e:
        if e.errno not in DISK_ERRNOS:
            raise
        where = f" ({e.filename})" if e.filename else ""
        print(f"jitrun: error: {e.strerror or e}{where}; the jit dir's disk (or this node's) failed or is full: free "
              "space or fix it, then rerun the same command (it resumes from the newest complete checkpoint)",
              file=sys.stderr, flush=True)
        return 1


def _run(args) -> int:
    from .devices import scheduler

    # every check before claim_root: a rejected command creates nothing on disk
    err = check_args(args)
    if err:
        print(f"jitrun: error: {err}", file=sys.stderr)
        return 2
    try:
        sched = scheduler.parse_hook(args.jit_scheduler)
    except scheduler.SchedulerError as e:
        print(f"jitrun: error: {e}", file=sys.stderr)
        return 2
    # SIGTERM/SIGINT from here on is a preemption (launcher/preempt.py), before torch is imported
    pre = Preemption(getattr(args, "jit_preempt_grace", DEFAULT_GRACE_S))
    pre.install()
    try:
        return _start(args, sched, pre)
    except Preempted:
        print(f"jitrun: preempted ({pre.name}) before the job's workers started; nothing to save; relaunch the same "
              "command to run it", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED


def _start(args, sched: str, pre: Preemption) -> int:
    from .jobdir import DirRefused, claim, command_of, identity

    job_id = job_id_for(args)
    ident = identity(job_id, command_of(args))
    root = Path(args.jit_dir or Path.cwd() / "jitckpt_runs" / job_id).resolve()
    try:
        lock = claim(root, job_id, ident, command_of(args), one_node=_max_nodes(args) == 1)
    except DirRefused as e:
        print(f"jitrun: error: {e}", file=sys.stderr)
        return 2
    try:
        return _launch(args, root, job_id, ident, sched, lock.release, pre)
    finally:
        lock.release()


def _max_nodes(args) -> int:
    from torch.distributed.run import parse_min_max_nnodes

    return 1 if args.standalone else parse_min_max_nnodes(args.nnodes)[1]  # checked by check_args


def _launch(args, root: Path, job_id: str, ident: str, sched: str, before_exit, pre: Preemption) -> int:
    _previous_run(root, job_id, args.jit_resume)
    _share_rdzv_store()
    timeout, fixed = args.jit_timeout or (contract.TIMEOUT.get(), contract.TIMEOUT_FIXED.get())
    _tell_workers(args, root, job_id, timeout, fixed)
    worker_env.identity(ident)
    intercept = _want_intercept(args.jit_intercept) and _preload_shim(root)
    _warm_start_early(args, intercept)
    from torch.distributed.run import config_from_args

    _torchrun_defaults(args)
    config, cmd, cmd_args = config_from_args(args)
    cmd, cmd_args = _entrypoint(args, config, cmd, cmd_args, root, intercept)

    from .launch import launch

    rc = launch(config, cmd, cmd_args, root=root, job_id=job_id, token=args.job_token, timeout_s=timeout,
                save_timeout_s=args.jit_save_timeout, sched=sched, health_interval_s=args.jit_health_interval,
                timeout_fixed=fixed, identity=ident, before_exit=before_exit, preempt=pre,
                command=[sys.executable, "-m", "jitrun.cli", *getattr(args, "argv", sys.argv[1:])])
    if intercept:
        from .shim_events import collect

        for line in collect(root):
            print(line, flush=True)
    return rc


def _previous_run(root: Path, job_id: str, resume: bool) -> None:
    """A finished run of this job left its jit dir: continue from it (--jit-resume) or start fresh."""
    done = layout.finished_at(root)
    if done is None:
        return
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(done))
    if resume:
        print(f"jitrun: the previous run of this job finished at {when}; resuming from its checkpoints "
              "(--jit-resume)", flush=True)
        return
    moved = layout.retire_finished(root)
    from .ec_clean import free_at_end  # EC chunks of the finished run are never restored

    free_at_end(job_id)
    print(f"jitrun: the previous run of this job finished at {when}; starting fresh (its checkpoints "
          f"moved to {moved}; pass --jit-resume to continue from them instead)", flush=True)


def _tell_workers(args, root: Path, job_id: str, timeout: float, fixed: bool) -> None:
    """The contract's variables every worker starts with (jitckpt/wire/contract.py)."""
    ec_every = getattr(args, "jit_ec_every", 0)
    worker_env.job(root=root, job_id=job_id, token=args.job_token, timeout_s=timeout, fixed=fixed,  # token: check_args
                   ec_every=ec_every, ec_adaptive=getattr(args, "ec_adaptive", False),
                   ec_code=getattr(args, "jit_ec_code", "auto"),
                   verify_every=getattr(args, "jit_verify_every", 0),
                   verify_adaptive=getattr(args, "verify_adaptive", False),
                   ec_cap=args.ec_cap if ec_every else None)  # resolved by check_args


def _preload_shim(root: Path) -> bool:
    """LD_PRELOAD libintercept into the workers; False (with a line) when it is not built."""
    lib = _intercept_lib()
    if lib is None:
        print("jitrun: warning: libjitintercept.so not found (run `make build` or set "
              f"{contract.INTERCEPT_LIB.name}); NCCL hangs are then detected by the process group "
              "timeout only", file=sys.stderr)
        return False
    # The shim recovers lost collectives and NCCL errors in place; what it cannot
    # recover falls back to jitckpt's JIT save (Python workers, the hang handler)
    # or to an exit 75 for a restart (any program).
    from .shim_events import SHIM_EVENTS

    worker_env.preload(lib, root / SHIM_EVENTS)
    return True


def _torchrun_defaults(args) -> None:
    """torchrun's own defaulting (torch.distributed.run.run), then the network settings it would need."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    from . import netconf

    env = dict(os.environ)
    for line in netconf.derive(args, env):
        print(f"jitrun: derived {line}", flush=True)
    worker_env.network({k: v for k, v in env.items() if os.environ.get(k) != v})


def _share_rdzv_store() -> None:
    """jitrun's agents coordinate through the store the rendezvous shares with the
    workers, served by the agent. torch's opt-out of that sharing
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) moves the workers' store into worker
    rank 0, which a failure takes down with it, and leaves the agent connecting to
    a store nobody serves yet: the job would end on a store timeout. Dropped here,
    before the warm-start server copies the environment, and said."""
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        worker_env.drop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
        print("jitrun: ignoring TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: jitrun's agents coordinate through the "
              "rendezvous store they share with the workers (unset it to silence this line)", file=sys.stderr,
              flush=True)


def _warm_start(args, intercept: bool) -> bool:
    """Workers are forks of the warm-start server: a Python script, not the GPU path
    (CUDA and fork do not mix), not a migratable job (each worker its own namespace)."""
    return (args.jit_warm_start == "on" and not intercept and not args.no_python and not args.run_path
            and getattr(args, "jit_migratable", "off") != "on")


def _warm_start_early(args, intercept: bool) -> None:
    """Start the warm-start server before this process imports torch: a node
    that joins a running job (a replacement) would otherwise import torch twice
    in a row, here and then in the server, before its first worker exists.
    Only where ``_entrypoint`` will use it, and only for a number of processes
    per node (``auto``/``gpu``/... need torch to resolve)."""
    if not _warm_start(args, intercept):
        return
    try:
        nproc = int(args.nproc_per_node)
    except ValueError:
        return
    from . import warm

    # torchrun's config_from_args sets OMP_NUM_THREADS=1 for several workers, later: the
    # server's OpenMP runtime reads it when torch loads, so it must start with it
    env = {"OMP_NUM_THREADS": "1"} if nproc > 1 and "OMP_NUM_THREADS" not in os.environ else {}
    warm.start_server(env)


def _entrypoint(args, config, cmd, cmd_args: list, root: Path, intercept: bool) -> tuple:
    """How each worker starts so jitckpt's runtime is attached before the user's code."""
    migratable = getattr(args, "jit_migratable", "off") == "on"
    if isinstance(cmd, str) and not args.no_python and not args.run_path:
        worker_env.python_path(str(Path(__file__).resolve().parent.parent))
        if _warm_start(args, intercept):
            from . import warm

            warm.start_server()
            cmd, cmd_args = warm.worker_main, cmd_args[1:]  # drop "-u"
            config.start_method = "forkserver"
        else:
            # [-u, (-m,) script, args...] -> [-u, -m, jitckpt._bootstrap, (-m,) script, args...]
            cmd_args = [cmd_args[0], "-m", "jitckpt._bootstrap", *cmd_args[1:]]
    elif args.run_path:
        # torchrun's --run-path runs the script with runpy.run_path in a spawned
        # interpreter; the bootstrap does the same after attaching the runtime
        from . import warm

        cmd = warm.worker_main
    elif args.no_python:
        import jitckpt

        worker_env.python_path(str(Path(jitckpt.__file__).resolve().parent / "_autoload"))
    if migratable and isinstance(cmd, str) and not args.run_path:  # launcher/migration/control.py
        from .migration import control as migrate

        worker_env.migratable(no_pause=bool(args.no_python))
        cmd, cmd_args = migrate.wrap(cmd, cmd_args)
        if "libjitintercept" in os.environ.get("LD_PRELOAD", ""):
            # a sticky device error parks the process for a move to a new device
            # (launcher/migration/device_loss.py) instead of ending it
            from .migration import device_loss

            worker_env.park_on_device_loss(device_loss.control_dir(root))
    return cmd, cmd_args


if __name__ == "__main__":
    raise SystemExit(main())
