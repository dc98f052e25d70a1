"""Unit tests for the launcher's scheduler hooks (jitrun.devices.scheduler) and event log (jitrun.events)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from jitrun import events
from jitrun.devices import scheduler
from jitrun.devices.scheduler import Placement, SchedulerError

FAILURE = {"job_id": "j1", "restart_count": 1, "failed_ranks": [1], "reasons": {"1": "sigkill"},
           "restore_step": 6, "hosts": ["node0"], "devices": "0,1"}


def _hook(tmp_path: Path, body: str, name: str = "hook.sh") -> str:
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o700)
    return f"exec:{p}"


# --- parse_hook --------------------------------------------------------------------------


def test_parse_hook_accepts_local_and_executable(tmp_path):
    assert scheduler.parse_hook("local") == "local"
    spec = _hook(tmp_path, "exit 0")
    assert scheduler.parse_hook(spec) == spec


@pytest.mark.parametrize("spec", ["Slurm", "", "exec", "Local"])
def test_parse_hook_unknown_spec(spec):
    with pytest.raises(SchedulerError, match="expected 'local', 'slurm' or 'exec:"):
        scheduler.parse_hook(spec)


def test_parse_hook_non_executable(tmp_path):
    p = tmp_path / "plain.sh"
    p.write_text("#!/bin/sh\n")
    p.chmod(0o600)
    with pytest.raises(SchedulerError, match="not an executable file") as ei:
        scheduler.parse_hook(f"exec:{p}")
    assert str(p) in str(ei.value)
    with pytest.raises(SchedulerError, match="not an executable file"):
        scheduler.parse_hook(f"exec:{tmp_path / 'missing'}")
    with pytest.raises(SchedulerError, match="not an executable file"):
        scheduler.parse_hook(f"exec:{tmp_path}")  # a directory is "executable" but not a file


# --- place("local") ------------------------------------------------------------------------


def test_place_local_keeps_devices_without_blame():
    assert scheduler.place("local", FAILURE) == Placement()
    assert scheduler.place("local", {**FAILURE, "devices": None, "failed_devices": ["1"]}) == Placement()


def test_place_local_excludes_failed_devices():
    p = scheduler.place("local", {**FAILURE, "devices": "0,1,2,3", "failed_devices": ["1", "3"]})
    assert p.action == "restart" and p.visible_devices == "0,2" and p.env == {}


def test_place_local_all_devices_failed():
    p = scheduler.place("local", {**FAILURE, "devices": "0,1", "failed_devices": ["0", "1"]})
    assert p.visible_devices is None


# --- place("exec:...") -----------------------------------------------------------------------


def test_place_exec_good_answer_and_failure_on_stdin(tmp_path):
    seen = tmp_path / "stdin.json"
    spec = _hook(tmp_path, f"cat > {seen}\n"
                 'echo \'{"action": "restart", "env": {"NODE": "n7", "X": ""}, "visible_devices": "2,3"}\'')
    p = scheduler.place(spec, FAILURE)
    assert p == Placement(action="restart", env={"NODE": "n7", "X": ""}, visible_devices="2,3")
    assert json.loads(seen.read_text()) == FAILURE


def test_place_exec_defaults(tmp_path):
    p = scheduler.place(_hook(tmp_path, "cat >/dev/null; echo '{}'"), FAILURE)
    assert p == Placement(action="restart", env={}, visible_devices=None)


def test_place_exec_abort(tmp_path):
    p = scheduler.place(_hook(tmp_path, 'cat >/dev/null; echo \'{"action": "abort"}\''), FAILURE)
    assert p.action == "abort"


def test_place_exec_non_json(tmp_path):
    spec = _hook(tmp_path, "cat >/dev/null; echo 'placing on node7'")
    with pytest.raises(SchedulerError, match="non-JSON") as ei:
        scheduler.place(spec, FAILURE)
    assert "placing on node7" in str(ei.value)


def test_place_exec_non_zero_exit(tmp_path):
    spec = _hook(tmp_path, "cat >/dev/null; echo 'no nodes left' >&2; exit 3")
    with pytest.raises(SchedulerError, match="exited 3") as ei:
        scheduler.place(spec, FAILURE)
    assert "no nodes left" in str(ei.value)


@pytest.mark.parametrize("answer", ['{"action": "reboot"}', '["restart"]', "null"])
def test_place_exec_bad_action(tmp_path, answer):
    spec = _hook(tmp_path, f"cat >/dev/null; echo '{answer}'")
    with pytest.raises(SchedulerError, match="'action' must be one of restart, abort, got"):
        scheduler.place(spec, FAILURE)


def test_place_exec_migrate_only_for_a_device_and_with_a_target(tmp_path):
    """'migrate' moves running ranks (jitrun migrate): an answer to a device found
    unhealthy while they run, never to a failure (the ranks are gone), and it needs 'to'."""
    spec = _hook(tmp_path, """cat >/dev/null; echo '{"action": "migrate", "to": "10.0.0.7"}'""")
    with pytest.raises(SchedulerError, match="must be one of restart, abort, got"):
        scheduler.place(spec, FAILURE)
    unhealthy = {**FAILURE, "event": "device_unhealthy", "ranks": [1]}
    got = scheduler.place(spec, unhealthy)
    assert (got.action, got.to) == ("migrate", "10.0.0.7")
    spec = _hook(tmp_path, """cat >/dev/null; echo '{"action": "migrate"}'""")
    with pytest.raises(SchedulerError, match="'migrate' needs 'to'"):
        scheduler.place(spec, unhealthy)


@pytest.mark.parametrize("env", ['{"N": 1}', '["N=1"]', '{"N": null}', '{"N": ["a"]}'])
def test_place_exec_bad_env_types(tmp_path, env):
    spec = _hook(tmp_path, f"cat >/dev/null; echo '{{\"env\": {env}}}'")
    with pytest.raises(SchedulerError, match="'env' must map strings to strings"):
        scheduler.place(spec, FAILURE)


@pytest.mark.parametrize("vd", ["[0, 2]", "0"])
def test_place_exec_bad_visible_devices_type(tmp_path, vd):
    spec = _hook(tmp_path, f"cat >/dev/null; echo '{{\"visible_devices\": {vd}}}'")
    with pytest.raises(SchedulerError, match="visible_devices"):
        scheduler.place(spec, FAILURE)


def test_place_exec_timeout(tmp_path):
    spec = _hook(tmp_path, "exec sleep 60")  # exec: the killed pid is the sleep itself
    with pytest.raises(SchedulerError, match="did not answer within"):
        scheduler.place(spec, FAILURE, timeout_s=0.3)


# --- events ---------------------------------------------------------------------------------


def test_eventlog_one_json_line_per_emit_private(tmp_path):
    path = tmp_path / "events.jsonl"
    log = events.EventLog(path)
    r1 = log.emit("job_start", job_id="j1")
    log.emit("failure_detected", rank=1, reason="sigkill", t=123.5)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    recs = [json.loads(x) for x in lines]
    assert recs[0] == r1 and recs[0]["event"] == "job_start" and recs[0]["job_id"] == "j1"
    assert isinstance(recs[0]["t"], float)
    assert recs[1] == {"event": "failure_detected", "rank": 1, "reason": "sigkill", "t": 123.5}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert log.events == recs


def test_eventlog_appends_across_instances(tmp_path):
    path = tmp_path / "events.jsonl"
    events.EventLog(path).emit("job_start")
    events.EventLog(path).emit("job_end")
    assert [json.loads(x)["event"] for x in path.read_text().splitlines()] == ["job_start", "job_end"]


def test_eventlog_without_path_keeps_memory_only(tmp_path):
    log = events.EventLog(None)
    log.emit("job_start")
    assert [e["event"] for e in log.events] == ["job_start"]
    assert list(tmp_path.iterdir()) == []


def test_summary_mentions_recovery_numbers():
    evs = [
        {"event": "job_start", "t": 100.0},
        {"event": "fault_injected", "t": 101.0, "rank": 1, "phase": "backward"},
        {"event": "checkpoint_saved", "t": 101.5, "rank": 0, "step": 6, "path": "/secret/x"},
        {"event": "save_started", "t": 101.2, "rank": 0},
        {"event": "recovery", "t": 104.0, "failure_to_resumed_s": 3.25, "detection_s": 0.5,
         "checkpoint_s": 0.75, "restart_to_resumed_s": 2.0, "restore_step": 6, "redone_minibatches": 1},
    ]
    s = events.summary(evs)
    assert s.startswith("jitrun timeline:")
    assert "failure->resumed 3.25s" in s
    assert "detect 0.50s" in s and "checkpoint 0.75s" in s and "restart->resumed 2.00s" in s
    assert "resumed at step 6" in s and "redone minibatches 1" in s
    assert "+   1.00s  fault_injected" in s
    assert "checkpoint_saved" in s and "/secret/x" not in s  # paths are left out
    assert "save_started" not in s


def test_summary_no_failures():
    assert events.summary([]) == "jitrun: no failures"
    assert events.summary([{"event": "job_start", "t": 1.0}, {"event": "job_end", "t": 2.0}]) != \
        "jitrun: no failures"  # job_end is listed
    assert events.summary([{"event": "job_start", "t": 1.0}]) == "jitrun: no failures"


def test_place_local_keeps_suspect_device_without_spares():
    f = {**FAILURE, "devices": "0,1,2,3", "failed_devices": ["1"], "nproc_per_node": 4}
    assert scheduler.place("local", f).visible_devices is None
    f = {**FAILURE, "devices": "0,1,2,3,4", "failed_devices": ["1"], "nproc_per_node": 4}
    assert scheduler.place("local", f).visible_devices == "0,2,3,4"
