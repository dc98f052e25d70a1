"""The benchmark scripts: their parsing and summaries on synthetic output, the
process handling on real (tiny) process trees, and one real end-to-end run of
bench_recovery (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_overhead as bo  # noqa: E402
import bench_recovery as br  # noqa: E402


def step_line(s: int) -> str:
    return f"[rank 0] step {s:4d} loss 1.2345 ppl 3.4"


def log_of(lines: list[tuple[float, str]]) -> bo.RunLog:
    return bo.RunLog(cmd=[], lines=lines, t_start=lines[0][0] - 5, t_end=lines[-1][0] + 1, returncode=0)


# -- bench_overhead ---------------------------------------------------------------


def test_steady_step_excludes_warmup_and_other_lines():
    lines = [(100.0, "W1122 some torchrun warning")]
    t = 100.0
    for s in range(40):
        t += 0.5 if s < 5 else 0.03  # slow warm-up, then 30 ms steps
        lines.append((t, step_line(s)))
        lines.append((t, "[rank 0] periodic checkpoint at step 9"))  # not a step line
    steps = bo.step_times(lines)
    assert [s for s, _ in steps] == list(range(40))
    assert bo.steady_step_s(steps, warmup=5) == pytest.approx(0.03)
    assert bo.median_step_s(steps, warmup=5) == pytest.approx(0.03)
    # the warm-up would dominate a naive mean
    assert bo.steady_step_s(steps, warmup=0) > 0.04


def test_steady_step_refuses_a_restarted_run():
    steps = [(s, float(i)) for i, s in enumerate([0, 1, 2, 3, 2, 3, 4, 5])]
    with pytest.raises(ValueError, match="restart"):
        bo.steady_step_s(steps, warmup=0)


def test_summarize_ratios_and_overhead():
    def run(x):
        return {"step_s": x, "step_median_s": x, "cpu_per_step_s": 2 * x}

    orders = (["torchrun", "jitrun"], ["jitrun", "torchrun"], ["torchrun", "jitrun"])
    pairs = [{"torchrun": run(0.100), "jitrun": run(v), "order": o}
             for v, o in zip((0.101, 0.099, 0.102), orders, strict=True)]
    s = bo.summarize(pairs)
    for metric in bo.METRICS:
        m = s[metric]
        assert m["ratio_min"] == pytest.approx(0.99)
        assert m["ratio_median"] == pytest.approx(1.01)
        assert m["ratio_max"] == pytest.approx(1.02)
        assert m["overhead_pct"] == pytest.approx(1.0)
        # median of the torchrun-first pairs 1.015, of the jitrun-first one 0.99
        assert m["ratio_order_balanced"] == pytest.approx((1.015 * 0.99) ** 0.5)


def test_order_balanced_needs_both_orders():
    pairs = [{"torchrun": {m: 1.0 for m in bo.METRICS}, "jitrun": {m: 1.1 for m in bo.METRICS},
              "order": ["torchrun", "jitrun"]}]
    assert bo.summarize(pairs)["step_s"]["ratio_order_balanced"] is None


FAKE_TRAINER = textwrap.dedent("""
    import sys, time
    step_s = float(sys.argv[1])
    for s in range(int(sys.argv[2])):
        t = time.process_time()
        while time.process_time() - t < step_s:  # a fixed amount of CPU work, like a training step
            pass
        print(f"[rank 0] step {s:4d} loss 1.0 ppl 2.7", flush=True)
""")


def test_overhead_main_on_fake_launchers(tmp_path, monkeypatch, capsys):
    """main() end to end with stand-ins whose 'jitrun' steps need 1.5x the CPU
    work: the reported ratios must see it (CPU exactly; wall time roughly,
    since other load on the machine stretches it)."""
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE_TRAINER)

    def commands(steps, jit_dir, train_args=None, jit_args=None):
        return {"torchrun": [sys.executable, str(fake), "0.010", str(steps)],
                "jitrun": [sys.executable, str(fake), "0.015", str(steps)]}

    monkeypatch.setattr(bo, "commands", commands)
    assert bo.main(["--pairs", "2", "--steps", "40", "--warmup", "5", "--probe-pairs", "0", "--settle", "0",
                    "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["pairs"] == 2 and [p["order"][0] for p in s["per_pair"]] == ["torchrun", "jitrun"], s
    assert 1.35 < s["cpu_per_step_s"]["ratio_median"] < 1.65, s
    assert 35 < s["cpu_per_step_s"]["overhead_pct"] < 65, s
    # wall time: only loosely, other load on the machine stretches either side
    assert 0.7 < s["step_s"]["ratio_median"] < 3.0, s
    assert 0.7 < s["step_median_s"]["ratio_median"] < 3.0, s
    # --threads: the launcher's own main thread (the stand-in trains in it) carries the 1.5x
    assert bo.main(["--pairs", "1", "--steps", "60", "--warmup", "5", "--probe-pairs", "0", "--settle", "0", "--json",
                    "--threads"]) == 0
    t = json.loads(capsys.readouterr().out)["threads"]["launcher/main"]
    assert 1.2 < t["jitrun"]["cpu_ms"] / t["torchrun"]["cpu_ms"] < 1.8, t


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_timeout_kills_descendants_in_their_own_session(tmp_path):
    """torchrun starts workers with start_new_session: a timeout must still
    kill them (by pid), or they would keep running and hold the pipe."""
    script = tmp_path / "tree.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time
        c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        print(f"child {c.pid}", flush=True)
        time.sleep(120)
    """))
    t0 = time.monotonic()
    log = bo.run_timestamped([sys.executable, str(script)], timeout_s=3)
    assert log.timed_out and time.monotonic() - t0 < 20
    child = int(next(line for _, line in log.lines if line.startswith("child")).split()[1])
    time.sleep(0.2)
    assert not _alive(child)


def test_orphaned_worker_is_killed_when_the_launcher_exits(tmp_path):
    """A worker left behind by a launcher that exited keeps the output pipe
    open; run_timestamped must not wait for it until the timeout."""
    script = tmp_path / "orphan.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time
        c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        print(f"child {c.pid}", flush=True)
        time.sleep(1.5)  # long enough to be seen by the once-a-second scan
    """))
    t0 = time.monotonic()
    log = bo.run_timestamped([sys.executable, str(script)], timeout_s=8)
    child = int(next(line for _, line in log.lines if line.startswith("child")).split()[1])
    time.sleep(0.2)
    assert not _alive(child)
    assert log.returncode == 0 or log.timed_out
    assert time.monotonic() - t0 < 20


def test_summarize_probe():
    def rec(plain, hooked):
        return {"plain": {"cpu_s": plain, "hook_s": float("nan")}, "hooked": {"cpu_s": hooked, "hook_s": 5e-6}}

    p = bo.summarize_probe([rec(0.010, 0.0101), rec(0.010, 0.0099)], step_s=0.025)
    assert p["ratio_min"] == pytest.approx(0.99) and p["ratio_max"] == pytest.approx(1.01)
    assert p["hook_us"] == pytest.approx(5.0)
    assert p["hook_pct_of_step"] == pytest.approx(0.02)


@pytest.mark.slow
def test_probe_runs_with_and_without_the_runtime():
    """The probe really installs jitrun's worker runtime (it asserts that the
    reporter is connected) and times its hook calls."""
    r = bo.probe("hooked", 25, 5, timeout_s=120)
    assert 0 < r["hook_s"] < 1e-3 and 0 < r["cpu_s"] < 1.0


# -- bench_recovery -----------------------------------------------------------------


def test_fault_step_is_seeded_and_in_range():
    assert br.fault_step(0, 120) == br.fault_step(0, 120)
    for seed in range(50):
        F = br.fault_step(seed, 120)
        assert 30 <= F <= 110
    assert len({br.fault_step(seed, 120) for seed in range(50)}) > 10


def synthetic_periodic(F=27, K=10, m=0.1, save=0.04, t_detect=0.1, restart=4.0):
    """Output of a periodic-checkpoint run: fault in step F, checkpoint every K."""
    lines, t = [(0.0, "W torchrun banner")], 1.0
    for s in range(F):
        t += m
        if (s + 1) % K == 0:
            t += save
            lines.append((t, f"[rank 0] periodic checkpoint at step {s + 1}"))
        lines.append((t, step_line(s)))
    t_fault_est = t
    lines.append((t + 0.05, "[rank0]: RuntimeError: ... Connection reset by peer"))
    lines.append((t + t_detect, "W1122 ... api.py:1028] Sending process 1 closing signal SIGTERM"))
    lines.append((t + t_detect + 0.01, "E1122 ... api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 2)"))
    t += t_detect + restart
    restore = (F // K) * K
    lines.append((t, f"[rank 0] resumed from /x/periodic.pt at step {restore}"))
    lines.append((t + 0.01, f"[rank 1] resumed from /x/periodic.pt at step {restore}"))
    t += 0.01
    for s in range(restore, 40):
        t += m
        if (s + 1) % K == 0:
            t += save
            lines.append((t, f"[rank 0] periodic checkpoint at step {s + 1}"))
        lines.append((t, step_line(s)))
    return lines, t_fault_est, restore


def test_parse_periodic_run():
    lines, t_fault, restore = synthetic_periodic()
    res = br.Result(name="ckpt-10", kind="periodic", fault_step=27, interval=10)
    br.parse_run(res, log_of(lines))
    assert res.restore_step == restore == 20
    assert res.redone_minibatches == 27 + 1 - 20
    assert res.fault_t == pytest.approx(t_fault)
    assert res.detect_s() == pytest.approx(0.1)
    assert res.minibatch_s == pytest.approx(0.1)
    assert res.save_s == pytest.approx(0.04)
    assert len(res.saves) == 4  # steps 10, 20 before; 30, 40 after (20 is saved once)
    assert res.ckpt_s() == pytest.approx(4 * 0.04)
    assert res.restart_s() == pytest.approx(4.0 + 0.01)
    assert res.redone_s() == pytest.approx(8 * 0.1)  # steps 20..27, no save among them
    assert res.fail_to_resumed_s() == pytest.approx(0.1 + 4.01 + 0.1)


def test_parse_jit_run_with_events_and_the_same_step_again():
    """jitrun restores step F itself, so the step index never goes back:
    the split into before/after must come from the detection time."""
    F, m = 15, 0.1
    lines, t = [], 1.0
    for s in range(F):
        t += m
        lines.append((t, step_line(s)))
    fault_t = t + 0.03
    events = [{"event": "fault_injected", "t": fault_t}, {"event": "failure_detected", "t": fault_t + 0.02},
              {"event": "checkpoint_saved", "t": fault_t + 0.06},
              {"event": "recovery", "t": fault_t + 6, "failure_to_resumed_s": 6.0, "detection_s": 0.02,
               "checkpoint_s": 0.04, "restart_to_resumed_s": 5.9, "redone_minibatches": 1}]
    t = fault_t + 5.0
    lines += [(t, f"[rank 1] resumed from /j/ckpt/step-{F}/state.pt at step {F}"),
              (t + 0.02, f"[rank 0] resumed from /j/ckpt/step-{F}/state.pt at step {F}")]
    t += 0.02
    for s in range(F, 30):
        t += m
        lines.append((t, step_line(s)))
    res = br.Result(name="jit", kind="jit", fault_step=F)
    br.parse_run(res, log_of(lines), events)
    assert (res.restore_step, res.redone_minibatches) == (F, 1)
    assert res.fault_t == fault_t and res.fault_t - res.fault_t_estimate == pytest.approx(0.03)
    assert res.detect_s() == pytest.approx(0.02)
    assert res.ckpt_s() == pytest.approx(0.04)
    assert res.restart_s() == pytest.approx(5.0 + 0.02 - 0.06)
    assert res.redone_s() == pytest.approx(m)
    assert res.recovery["failure_to_resumed_s"] == 6.0
    assert "OK" in br.jit_records([res], 10.0)


def test_parse_restart_from_scratch():
    """A failure before the first periodic save: no 'resumed from' line."""
    lines, t = [], 1.0
    for s in range(5):
        t += 0.1
        lines.append((t, step_line(s)))
    lines.append((t + 0.1, "E ... failed (exitcode: -9) local_rank: 1"))
    t += 4.0
    for s in range(0, 10):
        t += 0.1
        lines.append((t, step_line(s)))
    res = br.Result(name="ckpt-50", kind="periodic", fault_step=5, interval=50)
    br.parse_run(res, log_of(lines))
    assert (res.restore_step, res.redone_minibatches) == (0, 6)
    assert res.ckpt_s() == 0


def test_table_and_plot(tmp_path):
    lines, _, _ = synthetic_periodic()
    per = br.parse_run(br.Result(name="ckpt-10", kind="periodic", fault_step=27, interval=10), log_of(lines))
    per.identical = True
    ref_lines = [(1.0 + 0.1 * s, step_line(s)) for s in range(40)]
    ref = br.parse_run(br.Result(name="ref", kind="ref"), log_of(ref_lines))
    bad = br.Result(name="jit-kill1", kind="jit", fault_step=27, error="rc=1")
    text = br.table([per, bad], ref)
    rows = text.splitlines()
    assert rows[0].count("|") == rows[1].count("|") == rows[2].count("|")
    assert "| ckpt-10 | 27 | 20 | 8 |" in rows[2] and rows[2].endswith("| yes |")
    assert "FAILED: rc=1" in rows[3]
    pytest.importorskip("matplotlib")
    out = tmp_path / "p" / "recovery.png"
    br.plot([per, bad], ref, out, "synthetic")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_recovery_end_to_end(tmp_path):
    """Real runs, tiny: the reference and one periodic-checkpoint run with a
    killed rank (the jitrun side is exercised by the recovery e2e tests, and
    its parsing above). Checks the parsing of real torchrun output and that
    the run recovered to the reference state bit for bit."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.json"
    png = tmp_path / "r.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_recovery.py"), "--steps", "20", "--step-sleep", "0.02",
         "--intervals", "8", "--repeats", "0", "--no-stop", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=170, cwd=tmp_path, env={**os.environ, "JITCKPT_FAULT": ""})
    assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    F = data["fault_step"]
    (run,) = data["runs"]
    assert run["name"] == "ckpt-8" and run["identical"] is True
    assert run["restore_step"] == (F // 8) * 8
    assert run["redone_minibatches"] == F + 1 - (F // 8) * 8
    # torchrun's agent line about the dead worker was found, after the fault
    assert run["detect_t"] is not None and 0 <= run["detect_t"] - run["fault_t"] < 5
    assert run["fault_t"] < run["resume_t"] < run["first_done_t"] <= run["caught_up_t"]
    assert len(run["saves"]) >= 20 // 8
    assert "| ckpt-8 |" in proc.stdout
    assert png.stat().st_size > 1000


# -- bench_multinode (synthetic: no namespaces, no jobs) -------------------------------------

import argparse  # noqa: E402

import bench_multinode as bm  # noqa: E402


def mn_lines(upto: int, t0: float = 100.0, m: float = 0.1, src: str = "agent0", start: int = 0):
    """rank 0's step lines start..upto, one every m seconds from t0."""
    return [(t0 + m * (s - start + 1), src, step_line(s)) for s in range(start, upto + 1)]


def mn_jitrun_a():
    F = 47
    lines = mn_lines(F - 1)
    fault_t = lines[-1][0] + 0.03
    resumed = fault_t + 5.0
    lines += [(resumed, "agent1", f"[rank 1] resumed from /j/ckpt/step-{F}/state.pt at step {F}"),
              (resumed + 0.01, "agent0", f"[rank 0] resumed from /j/ckpt/step-{F}/state.pt at step {F}")]
    lines += mn_lines(119, t0=resumed + 0.01, start=F)
    events = [{"event": "fault_injected", "t": fault_t, "rank": 1},
              {"event": "recovery", "t": resumed + 0.2, "failure_to_resumed_s": 5.1, "detection_s": 0.04,
               "checkpoint_s": 0.01, "restart_to_resumed_s": 5.0, "restore_step": F, "redone_minibatches": 1}]
    run = bm.MNRun(case="a", launcher="jitrun", fault_step=F, exit_codes={"agent0": 0, "agent1": 0},
                   t_start=95.0, t_end=resumed + 10)
    return bm.analyse(run, lines, events), fault_t


def mn_torchrun_a():
    F = 47
    lines = mn_lines(F - 1)
    lines += [(lines[-1][0] + 0.2, "agent1", "E1123 ... api.py:1002] failed (exitcode: -9) local_rank: 0"),
              (lines[-1][0] + 1.2, "agent0", "[rank0]: RuntimeError: Connection reset by peer")]
    resumed = lines[-1][0] + 6.0
    lines += [(resumed, "agent1", "[rank 1] resumed from /s/ckpt/periodic.pt at step 40"),
              (resumed + 0.02, "agent0", "[rank 0] resumed from /s/ckpt/periodic.pt at step 40")]
    lines += mn_lines(119, t0=resumed + 0.02, start=40)
    run = bm.MNRun(case="a", launcher="torchrun", fault_step=F, exit_codes={"agent0": 0, "agent1": 0},
                   t_start=95.0, t_end=resumed + 10)
    return bm.analyse(run, lines, []), lines[F - 1][0], resumed + 0.02


def mn_torchrun_c_failed():
    lines = mn_lines(47)
    kill_t = lines[-1][0] + 0.01
    lines += [(kill_t + 0.05, "agent0", "[rank0]: RuntimeError: [gloo] Read error: Connection reset by peer"),
              (kill_t + 70, "agent0", "Traceback (most recent call last):"),
              (kill_t + 70, "agent0", "torch.distributed.DistStoreError: wait timeout after 60000ms, keys: "
                                      "/torch.rendezvous.x.1/torchelastic/role_info/0"),
              (kill_t + 71, "replacement", "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes.")]
    run = bm.MNRun(case="c", launcher="torchrun", fault_step=47, fault_t=kill_t, lost=["agent1"], cap_s=150,
                   exit_codes={"agent0": 1, "agent1": -9, "replacement": 1}, t_start=95.0, t_end=kill_t + 72)
    return bm.analyse(run, lines, [])


def mn_jitrun_c():
    lines = mn_lines(47)
    kill_t = lines[-1][0] + 0.01
    resumed = kill_t + 9.0
    lines += [(resumed, "agent0", "[rank 0] resumed from /j/ckpt/step-48/state.pt at step 48"),
              (resumed + 0.03, "replacement", "[rank 1] resumed from /j/ckpt/step-48/state.pt at step 48")]
    lines += mn_lines(119, t0=resumed + 0.03, start=48)
    run = bm.MNRun(case="c", launcher="jitrun", fault_step=47, fault_t=kill_t, lost=["agent1"],
                   exit_codes={"agent0": 0, "agent1": -9, "replacement": 0}, t_start=95.0, t_end=resumed + 10,
                   replacement_started_t=kill_t + 3)
    return bm.analyse(run, lines, []), kill_t, resumed


def test_multinode_analyse_rank_kill():
    j, fault_t = mn_jitrun_a()
    assert j.recovered() and j.error is None
    assert (j.progress_step, j.restore_step, j.redone_minibatches) == (47, 47, 1)
    assert j.fault_t == fault_t and j.fault_source == "fault_injected event"
    assert j.fault_t - j.fault_t_estimate == pytest.approx(0.03)
    assert j.fail_to_resumed_s() == pytest.approx(5.0 + 0.01 + 0.1)
    assert j.fail_to_caught_up_s() == pytest.approx(j.fail_to_resumed_s())  # step 47 is the first one again
    t, est, resumed = mn_torchrun_a()
    assert t.recovered() and t.fault_t == est
    assert (t.restore_step, t.redone_minibatches) == (40, 8)
    assert t.resume_t == pytest.approx(resumed)
    assert t.fail_to_resumed_s() == pytest.approx(resumed + 0.1 - est)
    assert t.fail_to_caught_up_s() == pytest.approx(resumed + 0.8 - est)  # steps 40..47 again


def test_multinode_analyse_lost_node():
    j, kill_t, resumed = mn_jitrun_c()
    assert j.recovered() and (j.progress_step, j.restore_step, j.redone_minibatches) == (48, 48, 1)
    assert j.fail_to_resumed_s() == pytest.approx(resumed + 0.03 + 0.1 - kill_t)
    t = mn_torchrun_c_failed()
    assert not t.recovered() and t.first_done_t is None and t.progress_step == 48
    # the first uncaught exception of a surviving agent, not the workers' own "[rank0]:" errors
    assert "exit agent0=1 replacement=1" in t.error and "agent0: DistStoreError: wait timeout" in t.error
    capped = bm.MNRun(case="b", launcher="torchrun", exit_codes={"agent0": None, "spare": None}, timed_out=True,
                      cap_s=150, lost=["agent1"])
    assert bm.failure_reason(capped, []) == "no exit within 150s, killed"
    ok = bm.MNRun(case="b", launcher="jitrun", exit_codes={"agent0": 0, "agent1": -9, "spare": 0}, lost=["agent1"])
    assert bm.failure_reason(ok, []) is None


def test_multinode_table_ratios_and_json(tmp_path, capsys):
    ja, _ = mn_jitrun_a()
    ta, _, _ = mn_torchrun_a()
    jc, _, _ = mn_jitrun_c()
    tc = mn_torchrun_c_failed()
    for r in (ja, ta, jc):
        r.identical = True
    runs = [ja, ta, jc, tc]
    rat = bm.ratios(runs)
    assert rat["a"]["both_recovered"]
    assert rat["a"]["fail_to_resumed"]["ratio"] == pytest.approx(ja.fail_to_resumed_s() / ta.fail_to_resumed_s())
    assert rat["c"]["fail_to_resumed"]["ratio"] is None and rat["c"]["not_recovered"] == ["torchrun"]
    rows = bm.table(runs).splitlines()
    assert len({row.count("|") for row in rows}) == 1 and len(rows) == 2 + len(runs)
    assert rows[2].startswith("| a: rank 1 killed") and "| jitrun | agent0=0 agent1=0 | 47 | 47 | 1 |" in rows[2]
    assert rows[2].endswith("| yes |")
    assert "agent1=-9 (lost)" in rows[5] and "failed: exit agent0=1" in rows[5] and rows[5].endswith("| - |")
    rrows = bm.ratio_table(runs).splitlines()
    assert len({row.count("|") for row in rrows}) == 1
    assert f"{rat['a']['fail_to_resumed']['ratio']:.3f}" in rrows[2] and "torchrun did not recover" in rrows[3]
    ref = bm.MNRun(case="ref", launcher="torchrun", exit_codes={"agent0": 0, "agent1": 0}, t_start=0, t_end=20,
                   last_step=119)
    out = tmp_path / "mn" / "multinode.json"
    args = argparse.Namespace(replace_delay=3.0, fault_step=47, ckpt_every=10, cap=150.0, json=str(out))
    assert bm.report(args, [ref], runs, 321.0) == 0
    printed = capsys.readouterr().out
    assert "| c: node 1 lost, replacement +3s | torchrun |" in printed and "total 321s" in printed
    data = json.loads(out.read_text())
    assert data["total_s"] == 321.0 and data["reference"]["name"] == "ref"
    assert [r["name"] for r in data["runs"]] == ["a-jitrun", "a-torchrun", "c-jitrun", "c-torchrun"]
    assert data["runs"][0]["redone_minibatches"] == 1 and data["runs"][3]["recovered"] is False
    assert data["ratios"]["a"]["fail_to_resumed"]["ratio"] == pytest.approx(rat["a"]["fail_to_resumed"]["ratio"])
    # the replacement column against the cold-start floor measured in the same session
    args.cold_start_floor = {"code": bm.FLOOR_CODE, "median": 1.5, "min": 1.4, "max": 1.7, "n": 3}
    assert bm.report(args, [ref], runs, None) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("cold-start floor"))
    rep = jc.replacement_to_resumed_s()
    assert "took 1.50 s (median of 3, 1.40-1.70)" in line and f"resumed {rep:.2f} s (median of 1)" in line, line
    assert f"{rep - 1.5:.2f} s above that floor" in line, line
    assert json.loads(out.read_text())["args"]["cold_start_floor"]["median"] == 1.5
    # a jitrun case that did not recover bit-identically fails the run
    jc.identical = False
    assert bm.report(args, [ref], runs, None) == 1


def mn_jitrun_d(extra_events: tuple[dict, ...] = (), kill_first: bool = False):
    """d: rank 0 prints step 10, ranks 0 and 1 report their fault (step 11's forward) 2 ms later, node 2
    is killed 8 ms after that (``kill_first``: 5 ms before it); the survivors and the replacement
    resume from the EC snapshot of step 8."""
    lines = mn_lines(10, m=0.3)
    injected = lines[-1][0] + 0.002
    kill_t = injected + (-0.005 if kill_first else 0.008)
    resumed = kill_t + 7.0
    lines += [(resumed, "agent0", "[rank 0] resumed from /j/ckpt/step-8/state.pt at step 8"),
              (resumed + 0.02, "agent1", "[rank 1] resumed from /j/ckpt/step-8/state.pt at step 8"),
              (resumed + 0.04, "replacement", "[rank 2] resumed from /j/ckpt/step-8/state.pt at step 8")]
    lines += mn_lines(23, t0=resumed + 0.04, m=0.3, start=8)
    ec = {"k": 2, "m": 1, "stripes": 3}
    events = [{"event": "fault_injected", "t": injected, "rank": 0},
              {"event": "fault_injected", "t": injected + 0.001, "rank": 1},
              {"event": "restore_decision", "t": kill_t + 1.5, "step": None, "lost": ["n2"]},
              {"event": "restore_source", "t": kill_t + 1.5, "source": "ec", "step": 8, "ec": ec},
              {"event": "restore_source", "t": kill_t + 1.6, "source": "ec", "step": 8, "ec": ec},
              {"event": "ec_restored", "t": resumed - 0.5, "step": 8},
              {"event": "recovery", "t": resumed + 0.5, "failure_to_resumed_s": 7.2, "detection_s": 0.05,
               "checkpoint_s": 0.0, "restart_to_resumed_s": 6.0, "restore_step": 8, "redone_minibatches": 4,
               "fingerprint": {"0": "0" * 32}}, *extra_events]
    run = bm.MNRun(case="d", launcher="jitrun", fault_step=bm.EC_KILL_AT, fault_t=kill_t,
                   fault_source="node 2 killed", lost=["agent2"],
                   exit_codes={"agent0": 0, "agent1": 0, "agent2": -9, "replacement": 0}, t_start=95.0,
                   t_end=resumed + 8, replacement_started_t=kill_t + bm.EC_REPLACE_DELAY)
    return bm.analyse(run, lines, sorted(events, key=lambda e: e["t"])), (kill_t if kill_first else injected), resumed


def test_multinode_analyse_ec_node_lost(tmp_path, capsys):
    """d: the fault is the first of the ranks' fault_injected and node 2's kill; minibatch 11 was in
    progress, 8 is restored (4 redone); the EC test's assertions are checked from the events, and one
    that fails (a replica saved: the restore did not need EC) fails the run like a state difference."""
    d, injected, resumed = mn_jitrun_d()
    assert d.recovered() and d.fault_t == injected and d.fault_source.startswith("fault_injected")
    assert (d.progress_step, d.restore_step, d.redone_minibatches) == (11, 8, 4)
    assert d.fail_to_resumed_s() == pytest.approx(resumed + 0.04 + 0.3 - injected)
    assert d.fail_to_caught_up_s() == pytest.approx(resumed + 0.04 + 4 * 0.3 - injected)
    assert d.ec == {"source": "ec", "step": 8, "k_m": (2, 1), "lost": ["n2"], "problems": []}
    bad, _, _ = mn_jitrun_d(({"event": "checkpoint_saved", "t": 0.0, "rank": 2},))
    assert bad.recovered() and bad.ec["problems"] == ["1 checkpoint_saved (no replica should have saved)"]
    kill, kill_t, _ = mn_jitrun_d(kill_first=True)  # the kill came first: it stays the fault
    assert kill.fault_t == kill_t and kill.fault_source == "node 2 killed" and kill.progress_step == 11
    assert len(bm.ec_checks([])["problems"]) == 5  # no events: every check fails but "no checkpoint_saved"
    d.identical = bad.identical = True
    (row,) = bm.table([d], 3.0).splitlines()[2:]
    assert row.startswith("| d: 3 nodes + EC 2+1, node 2 lost")
    assert "agent2=-9 (lost) replacement=0 | 11 | 8 | 4 |" in row
    ja, _ = mn_jitrun_a()
    ta, _, _ = mn_torchrun_a()
    ja.identical = ta.identical = True
    assert "| d: 3 nodes + EC 2+1" in bm.ratio_table([ja, ta, d]).splitlines()[3]
    assert "- (torchrun not run)" in bm.ratio_table([ja, ta, d]).splitlines()[3]
    refs = [bm.MNRun(case=c, launcher="torchrun", t_start=0, t_end=20, last_step=s) for c, s in (("ref", 119),
                                                                                                ("ref-d", 23))]
    out = tmp_path / "mn.json"
    args = argparse.Namespace(replace_delay=3.0, fault_step=47, ckpt_every=10, cap=150.0, json=str(out))
    assert bm.report(args, refs, [d], None) == 0
    printed = capsys.readouterr().out
    assert "reference ref-d (plain torchrun, no failure, 3 nodes)" in printed
    assert "the test's assertions: all hold" in printed
    data = json.loads(out.read_text())
    assert data["reference"]["name"] == "ref" and set(data["references"]) == {"ref", "ref-d"}
    assert data["runs"][0]["ec"]["problems"] == [] and data["runs"][0]["redone_minibatches"] == 4
    assert bm.report(args, refs, [bad], None) == 1
    assert "FAILED: 1 checkpoint_saved" in capsys.readouterr().out


def test_bench_recovery_dispatches_multinode(monkeypatch):
    seen = []
    monkeypatch.setattr(bm, "main", lambda argv: seen.append(argv) or 0)
    assert br.main(["--multinode", "--quick", "--json", ""]) == 0
    assert seen == [["--quick", "--json", ""]]


# -- bench_scale (real: the coordination code over real TCPStores, tiny N) -------------------------


def test_bench_scale_tiny(tmp_path):
    """Two and five simulated nodes, one failed, a spare admitted, and a small replica
    fetched both ways. The bench itself raises (exit 1) unless every survivor reads the
    same decision (the failure's step, the failed node lost) and every node is re-admitted;
    here: every store call counted, the decision's messages grow linearly with the nodes
    (16 calls for the survivor that decides, 9 for each other one, 3 for the spare; a round
    trip per peer record made them grow as N^2), so do the reports (each agent reads its own
    node's stream), and both fetches delivered a verified copy,
    the stream's without its bytes passing the store."""
    out = tmp_path / "scale"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_scale.py"), "--nodes", "2,5", "--xfer-mib", "8",
         "--timeout", "60", "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["nodes"] for r in data["rows"]] == [2, 5]
    for r in data["rows"]:
        n, t = r["nodes"], r["to_restart"]
        assert 0 < r["published_s"] <= r["decision_s"] < r["restarted_s"] and r["barrier"] is True
        assert t["rdzv"]["msgs"] > 0 and t["reports"]["msgs"] > 0 and t["rdzv"]["bytes"] > 0
        assert 0 < t["decide"]["msgs"] <= 16 + 9 * (n - 2) + 3, t
        assert t["reports"]["msgs"] <= 30 * n, t
    xfer = data["transfer"]
    st, so = xfer["stream"], xfer["store"]
    assert xfer["mib"] == 8 and st["verified"] and so["verified"]
    assert st["via"] == "stream" and so["via"] == "store" and not st["fallbacks"] and not so["fallbacks"]
    assert so["store_msgs"] >= 2 * 3  # two chunks, each set, waited for, read, deleted, acknowledged
    assert so["store_MB"] > 8 > st["store_MB"], xfer  # the stream's bytes never pass the store
    assert "replica fetch of 8 MiB" in proc.stdout


def test_bench_scale_medians_per_node_count():
    """--repeats: one median (min-max) per node count; a run whose spare was never
    re-admitted has no restarted_s and is left out of that column's median only."""
    import bench_scale as bs

    # importing it changes nothing this process hands its children (it once set torch's
    # store-sharing opt-out, and every jitrun this test worker started later failed)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ

    def row(n: int, pub: float, dec: float, rst: float | None) -> dict:
        return {"nodes": n, "published_s": pub, "decision_s": dec, "restarted_s": rst}

    rows = [row(8, 0.1, 0.3, 2.0), row(8, 0.2, 0.5, None), row(8, 0.3, 0.4, 3.0),
            row(256, 0.3, 0.9, 20.0), row(256, 0.4, 0.8, 25.0), row(256, 0.2, 1.2, 30.0)]
    m8, m256 = bs.medians(rows)
    assert (m8["nodes"], m8["runs"], m256["runs"]) == (8, 3, 3)
    assert m8["decision_s"] == {"median": 0.4, "min": 0.3, "max": 0.5, "n": 3}
    assert m8["restarted_s"] == {"median": 2.5, "min": 2.0, "max": 3.0, "n": 2}
    assert m256["decision_s"]["median"] == 0.9 and m256["published_s"]["median"] == 0.3
    assert bs._median_run(rows[3:])["decision_s"] == 0.9
    assert "0.900 (0.800-1.200, n=3)" in bs.medians_table([m8, m256])


# -- bench_detection ----------------------------------------------------------------


def test_detection_table_medians_and_ratio():
    import bench_detection as bd

    def row(mode: str, detect: float, resumed: float) -> dict:
        return {"fault": "sigstop", "minibatch_s": 0.1, "mode": mode, "exit": 0, "detect_s": detect,
                "resumed_s": resumed, "redone": 1, "bound_s": 1.0, "identical": True}

    rows = [row("learned", d, d + 0.5) for d in (1.1, 1.0, 1.3)] + [row("fixed:120", 120.2, 121.0)]
    text = bd.table(rows)
    learned = next(line.split() for line in text.splitlines() if " learned " in line and "->" not in line)
    assert learned[:6] == ["sigstop", "0.1", "learned", "3", "1.1", "1.6"], text  # medians of the three
    assert "fault -> resumed 121.0 s fixed vs 1.6 s learned (76x)" in text, text


def test_bench_verify_measures_the_checks_inside_a_run() -> None:
    """A check at the start of every 10th minibatch (between the lines for steps s-1 and s,
    s % 10 == 0) that adds 20 ms to 25 ms steps: 20 ms per check, 8 % over 10 steps; the
    intervals before the warmup and N < 2 (no interval without a check) are left out."""
    import bench_verify as bv

    t, seen = 0.0, []
    for s in range(100):
        t += 0.025 + (0.020 if s % 10 == 0 else 0.0) + (1.0 if s == 5 else 0.0)
        seen.append((s, t))
    got = bv.in_run_cost(seen, every=10, warmup=10)
    assert abs(got["check_extra_s"] - 0.020) < 1e-9 and abs(got["in_run_overhead_pct"] - 8.0) < 1e-6, got
    assert bv.in_run_cost(seen, every=1, warmup=10) == {}


def test_multinode_medians_over_repetitions():
    """--repeats: per case and launcher, how many recovered bit-identically and the median
    (min-max) of each duration, the replacement's start->resumed for c; the runs' names and
    the ratios keep to the first repetition."""
    runs = []
    for rep, shift in enumerate((0.0, 2.0, 1.0)):
        j, kill_t, resumed = mn_jitrun_c()
        j.rep, j.identical = rep, rep != 1
        j.first_done_t += shift  # 9.1 s, 11.1 s, 10.1 s after the kill; 6.1, 8.1, 7.1 s after the replacement
        runs.append(j)
    assert [r.name for r in runs] == ["c-jitrun", "c-jitrun-2", "c-jitrun-3"]
    (m,) = bm.medians(runs)
    assert (m["case"], m["launcher"], m["runs"], m["recovered_identical"]) == ("c", "jitrun", 3, 2)
    base = resumed + 0.03 + 0.1 - kill_t
    assert m["fail_to_resumed"]["median"] == pytest.approx(base + 1.0)
    assert (m["fail_to_resumed"]["min"], m["fail_to_resumed"]["max"]) == (pytest.approx(base), pytest.approx(base + 2))
    assert m["replacement_to_resumed"]["median"] == pytest.approx(base + 1.0 - 3.0)
    rows = bm.median_table(runs).splitlines()
    assert len(rows) == 3 and "| jitrun | 2/3 |" in rows[2], rows
    assert bm.ratios(runs)["c"]["fail_to_resumed"]["jitrun_s"] == pytest.approx(base)


def test_bench_intercept_holds_the_workers_unless_asked(tmp_path) -> None:
    """The A/B path on one library against itself, held and live: held, every
    stand-in worker sits out every timed batch (so a call only appends to a queue);
    live, none does; the JSON says which mode ran."""
    shim = ROOT / "build" / "libjitintercept.so"
    out = {}
    for mode in ("held", "live"):
        cmd = [sys.executable, str(ROOT / "scripts" / "bench_intercept.py"), "--reps", "20", "--runs", "1",
               "--baseline", str(shim), "--json"] + (["--live-workers"] if mode == "live" else [])
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        out[mode] = json.loads(p.stdout)
        assert out[mode]["workers"] == mode
        for side in ("shim", "baseline"):
            assert set(out[mode][side]["added_ns"]) == {"cudaEventRecord", "cudaEventQuery", "cudaStreamWaitEvent"}
            held, batches = out[mode][side]["held_through"]
            assert batches == 20 * 4 and held == (batches if mode == "held" else 0), out[mode][side]


def test_bench_buffers_copies_every_buffer_and_reports_both_clocks() -> None:
    """The capture it times is the real one: after take() the mirror holds every
    buffer, and a training forward (which moves the BatchNorm statistics) leaves
    the mirror behind until the next take(); then one tiny real run of the script."""
    import bench_buffers as bb
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    cap = bb.Capture(model)
    cap.take()
    assert cap.matches() and len(cap.buffers) == 3 and cap.nbytes() == 6 * 4 * 2 + 8
    model.train()(torch.randn(5, 4))
    assert not cap.matches()
    cap.take()
    assert cap.matches()
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_buffers.py"), "--blocks", "1", "--steps", "1",
                        "--batch", "2", "--image-size", "32", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["buffers"] == 60 and r["copy_alone_us"] > 0, r  # ResNet-18: 20 BatchNorm layers x 3 buffers
    for clock in ("cpu", "wall"):
        assert r[clock]["block_ratio_median"] > 0 and r[clock]["step_ms_with"] > 0, r


# -- bench_attribution (synthetic rounds) ------------------------------------------------------

import bench_attribution as ba  # noqa: E402


def test_attribution_charges_each_feature_its_own_difference():
    """Each variant against its own round's torchrun; a feature's cost is jitrun minus the
    variant without it (here the EC snapshots cost 300 us a step, the rest nothing)."""
    base = 0.010

    def figures(added_us: float) -> dict:
        s = base + added_us * 1e-6
        return {"step_s": s, "step_median_s": s, "cpu_per_step_s": s}

    rounds = []
    for drift in (1.0, 1.1, 0.95):  # the machine's load moves every figure of a round alike
        r = {"torchrun": figures(0.0), "jitrun": figures(400.0), "no-ec": figures(100.0),
             "no-verify": figures(400.0), "fixed-timeout": figures(400.0), "no-warm": figures(400.0),
             "all-off": figures(100.0)}
        rounds.append({v: {m: x * drift for m, x in f.items()} for v, f in r.items()})
    s = ba.summarize(rounds)
    assert abs(s["jitrun"]["step_median_s"]["ratio_median"] - 1.04) < 1e-9
    assert abs(s["no-ec"]["step_median_s"]["added_us_median"] - 100.0) < 1e-6
    lines = ba.table(s, base * 1e3)
    assert "ec 300" in lines[-1] and "verify 0" in lines[-1] and "warm 0" in lines[-1], lines[-1]
    cmd = ba.command("no-ec", 100, Path("/tmp/j"), ["--d-model", "32"])
    assert cmd[cmd.index("--jit-ec-every") + 1] == "0" and cmd[-2:] == ["--d-model", "32"], cmd
