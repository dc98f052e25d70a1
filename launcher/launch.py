"""Start the JitAgent the way torch.distributed.launcher.api.launch_agent starts
LocalElasticAgent, record the timeline, and map the outcome to an exit code."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic import events as te_events
from torch.distributed.elastic import metrics, rendezvous
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig

from jitckpt import torch_compat
from jitckpt.torch_compat import elastic
from jitckpt.wire import layout

from . import rdzv, worker_env
from .agent import JitAgent
from .events import EventLog, summary
from .options import JitOptions
from .preempt import Preempted, Preemption, torch_signals
from .recovery.restore import NodeEvicted


def launch(config: LaunchConfig, cmd, cmd_args: list, *, root: Path, job_id: str, token: str,
           timeout_s: float, save_timeout_s: float, sched: str, command: list[str] | None = None,
           health_interval_s: float = 0.0, timeout_fixed: bool = False, identity: str | None = None,
           before_exit=None, preempt: Preemption | None = None) -> int:
    pre = preempt or Preemption()
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    events = EventLog(root / "events.jsonl")
    events.emit("job_start", job_id=job_id, nproc_per_node=config.nproc_per_node,
                max_restarts=config.max_restarts, timeout_s=timeout_s, timeout_fixed=timeout_fixed, jit_dir=str(root),
                pid=os.getpid())
    spec = _worker_spec(config, cmd, cmd_args)
    handler = spec.rdzv_handler
    agent = JitAgent(
        spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        **torch_compat.agent_shutdown_kwargs(config),
        jit=JitOptions(root=root, job_id=job_id, token=token, timeout_s=timeout_s,
                       save_timeout_s=save_timeout_s, scheduler=sched, command=list(command or []),
                       health_interval_s=health_interval_s, timeout_fixed=timeout_fixed, identity=identity,
                       preempt_grace_s=pre.grace_s),
        events=events, preempt=pre)
    code, shutdown_rdzv = 1, True
    try:
        code, shutdown_rdzv = _run(agent, handler, config, cmd, cmd_args, token, sched)
    finally:
        pre.handling = True  # from here a signal is noted, nothing is interrupted
        agent.announce_hang_bound("at the end")
        stopped = agent.close()
        _close_rendezvous(handler, token, code, shutdown_rdzv)
        from .ec_clean import free_at_end  # this node's EC chunks go with the job

        free_at_end(job_id, events)
        events.emit("job_end", exitcode=code)
        if code == 0:
            _mark_finished(root)
        print(summary(events.events), flush=True)
        print(f"jitrun: timeline in {events.path}", flush=True)
        if agent.preempt_result is not None:
            print(agent.preempt_result[1], file=sys.stderr, flush=True)  # the operator's one line, last
    if not stopped:
        # a thread still inside a store call would abort the interpreter's exit
        if before_exit is not None:
            before_exit()
        sys.stderr.flush()
        os._exit(code)
    return code


def _mark_finished(root: Path) -> None:
    """FINISHED.json, or one line saying why not (the next run then resumes instead of starting fresh)."""
    try:
        layout.mark_finished(root)
    except OSError as e:
        print(f"jitrun: warning: could not mark the job finished in {root} ({e.strerror or e}): a rerun of this "
              "command resumes from its checkpoints instead of starting fresh", file=sys.stderr, flush=True)


def _worker_spec(config: LaunchConfig, cmd, cmd_args: list) -> WorkerSpec:
    """What torch.distributed.launcher.api.launch_agent builds for its agent."""
    params = rendezvous.RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **config.rdzv_configs)
    master_addr, master_port = elastic.addr_and_port(params)
    worker_env.signals_to_handle(torch_signals(config.signals_to_handle))
    return WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=cmd,
        args=tuple(cmd_args), rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
        master_addr=master_addr, master_port=master_port, local_addr=config.local_addr,
        event_log_handler=config.event_log_handler, numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank)


def _run(agent: JitAgent, handler, config: LaunchConfig, cmd, cmd_args: list, token: str, sched: str
         ) -> tuple[int, bool]:
    """The agent's run mapped to (exit code, whether to shut the rendezvous down)."""
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        if result is None:
            # torch returns None to a node waiting in the redundancy list when the job's rendezvous closes
            return _waited_out(handler, token), True
        te_events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            err = ChildFailedError(name=entrypoint_name(cmd, cmd_args), failures=result.failures)
            print(err.format_msg(), file=sys.stderr)
            return 1, True
        return 0, True
    except RendezvousTimeoutError:
        join = rdzv.join_timeout_s(handler)
        print(f"jitrun: the job could not gather {config.min_nodes} node(s) within the rendezvous join timeout "
              f"({join:.0f}s): a lost node was not replaced. Start a replacement with the same command, or raise "
              "the wait with --rdzv-conf join_timeout=SECONDS", file=sys.stderr)
        return 1, True
    except RendezvousClosedError:
        return _waited_out(handler, token), True
    except Preempted:
        # the rendezvous stays open, as torch leaves it on a signal: a preempted node is not the job's end
        return agent.finish_preempted()[0], False
    except NodeEvicted as e:
        print(e, file=sys.stderr, flush=True)
        return 1, False  # the job goes on without this node: its rendezvous stays open
    except RendezvousConnectionError as e:
        print(f"jitrun: the job's rendezvous store went away ({e}) before this node learned the job's outcome; "
              "see the other nodes' logs", file=sys.stderr)
        return 1, True
    except Exception as e:
        print(error_line(e, sched), file=sys.stderr)
        return 1, type(e).__name__ != "SignalException"


def _close_rendezvous(handler, token: str, code: int, shutdown: bool) -> None:
    waiting = 0
    if code == 0:
        rdzv.mark_succeeded(handler, token)  # before the close: what a waiting spare reads
        waiting = rdzv.waiting_nodes(handler)
    if shutdown:
        handler.shutdown()
        if waiting:
            rdzv.wait_outcome_read(handler, token, waiting)
    else:
        # torch's heartbeat timer is a daemon thread making store calls: at
        # interpreter exit it would abort the process (see ReplicaServer.stop)
        stop = getattr(handler, "_stop_heartbeats", None)
        if stop is not None:
            stop()


def _waited_out(handler, token: str) -> int:
    """This node waited to join (a spare, or one left out of a restart's round
    when a spare took its place) and the job ended without it: the job's
    outcome is its outcome."""
    ok = rdzv.job_succeeded(handler, token)
    rdzv.outcome_read(handler, token)
    print("jitrun: the job " + ("finished" if ok else "ended without success") + " while this node waited to "
          "join its next round (a spare); nothing of it runs here", file=sys.stderr)
    return 0 if ok else 1


def entrypoint_name(cmd, cmd_args) -> str:
    """The user's program for torch's failure report: the script or module
    after ``-m jitckpt._bootstrap`` (or handed to the warm-start worker), not
    the bootstrap itself."""
    args = [str(a) for a in cmd_args]
    if callable(cmd) and getattr(cmd, "__name__", "") in ("worker_main", "run_script_path"):
        rest = args
    elif isinstance(cmd, str) and "jitckpt._bootstrap" in args:
        rest = args[args.index("jitckpt._bootstrap") + 1:]
    else:
        return elastic.entrypoint_name(cmd, cmd_args)
    if rest[:1] == ["-m"] and len(rest) > 1:
        return rest[1]
    return next((a for a in rest if not a.startswith("-")), "") or elastic.entrypoint_name(cmd, cmd_args)


def error_line(e: BaseException, sched: str = "") -> str:
    """One stderr line for an exception that ends the launch."""
    from .devices.scheduler import JobAborted

    msg = str(e)
    if isinstance(e, JobAborted) or "scheduler hook asked to abort" in msg:
        return (f"jitrun: the scheduler hook{f' ({sched})' if sched else ''} asked to abort the job; "
                "not restarting (see job_abort in events.jsonl)")
    if msg.startswith("jitrun: "):
        return msg
    return f"jitrun: {type(e).__name__}: {msg}"
