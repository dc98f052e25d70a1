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
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port, _get_entrypoint_name

from .agent import JitAgent, JitOptions
from .events import EventLog, summary


def launch(config: LaunchConfig, cmd, cmd_args: list, *, root: Path, job_id: str, token: str,
           timeout_s: float, save_timeout_s: float, sched: str) -> int:
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    events = EventLog(root / "events.jsonl")
    events.emit("job_start", job_id=job_id, nproc_per_node=config.nproc_per_node,
                max_restarts=config.max_restarts, timeout_s=timeout_s, jit_dir=str(root),
                pid=os.getpid())
    params = rendezvous.RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **config.rdzv_configs)
    master_addr, master_port = _get_addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=cmd,
        args=tuple(cmd_args), rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
        master_addr=master_addr, master_port=master_port, local_addr=config.local_addr,
        event_log_handler=config.event_log_handler, numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank)
    agent = JitAgent(
        spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
        jit=JitOptions(root=root, job_id=job_id, token=token, timeout_s=timeout_s,
                       save_timeout_s=save_timeout_s, scheduler=sched),
        events=events)
    code = 1
    shutdown_rdzv = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        te_events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            err = ChildFailedError(name=_get_entrypoint_name(cmd, cmd_args), failures=result.failures)
            print(err.format_msg(), file=sys.stderr)
            code = 1
        else:
            code = 0
    except Exception as e:
        if type(e).__name__ == "SignalException":
            shutdown_rdzv = False
        print(f"jitrun: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        events.emit("job_end", exitcode=code)
        print(summary(events.events), flush=True)
    return code
