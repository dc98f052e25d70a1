"""Tests for `jitrun plan` (jitrun.plan.main), run in-process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from jitrun import plan

REPO = Path(__file__).resolve().parent.parent
F = 2e-3 / 86400.0  # 2e-3 failures per GPU per day, per second

# BERT-L-PT (paper Table 4): o=5.0 s, r=9.9 s, m=0.418 s
BERT = [
    "--ckpt-seconds",
    "5",
    "--restore-seconds",
    "9.9",
    "--minibatch-seconds",
    "0.418",
    "--failures-per-gpu-day",
    "2e-3",
]
KEYS = {
    "gpus",
    "periodic_optimal_per_hour",
    "periodic_wasted_fraction",
    "jit_user_wasted_fraction",
    "jit_transparent_wasted_fraction",
}


def run_json(capsys, argv):
    assert plan.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys, argv) -> str:
    rc = plan.main(argv)
    captured = capsys.readouterr()
    assert rc == 2, captured
    assert captured.out == ""
    return captured.err


def test_table_output(capsys):
    assert plan.main([*BERT, "--gpus", "4", "1024", "8192"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("GPUs"))
    table = lines[header:]
    assert len(table) == 5  # header, rule, 3 rows
    assert "ckpt/hour" in table[0] and "min between ckpts" in table[0]
    assert len({len(line) for line in table}) == 1  # aligned columns
    row_1024 = table[3].split()
    # c* = sqrt(0.03 * 1024) = 5.543 /hr -> 60 / 5.543 = 10.8 minutes between checkpoints
    # w_f = 1.5390% (see test_model: 2 sqrt(1024 f 5/2) + 1024 f 9.9 = 0.015631 -> /1.015631)
    assert row_1024[:4] == ["1024", "5.543", "10.8", "1.5390%"]
    # provenance lines above the table
    assert "checkpoint cost o = 5 s  [--ckpt-seconds]" in out


def test_json_output(capsys):
    rows = run_json(capsys, [*BERT, "--gpus", "4", "1024"])
    assert [r["gpus"] for r in rows] == [4, 1024]
    for row in rows:
        assert set(row) == KEYS
    r4 = rows[0]
    # c* per hour = sqrt(4 * 0.03) = 0.34641
    assert r4["periodic_optimal_per_hour"] == pytest.approx(math.sqrt(0.12), rel=1e-9)
    # w* = 2 sqrt(4 f 5 / 2) + 4 f 9.9 = 9.6314e-4, as a fraction (not percent)
    assert r4["periodic_wasted_fraction"] == pytest.approx(
        9.6314e-4 / (1 + 9.6314e-4), rel=1e-4
    )
    # user JIT, o_jit = 0: f 5 + 4 f 9.9 + 4 f 0.418 / 2 = f * (5 + 39.6 + 0.836) = f * 45.436
    w_user = F * 45.436
    assert r4["jit_user_wasted_fraction"] == pytest.approx(
        w_user / (1 + w_user), rel=1e-9
    )
    # transparent JIT, o_jit = 0: 4 f 0.418 / 2 = f * 0.836
    assert r4["jit_transparent_wasted_fraction"] == pytest.approx(F * 0.836, rel=1e-6)


def test_overhead_per_minibatch(capsys):
    # S = 0.1 s per minibatch, M = 0.5 s -> o_jit = 0.2; transparent w = 0.2 + 4 f 0.5 / 2
    argv = [
        "--ckpt-seconds",
        "5",
        "--restore-seconds",
        "9.9",
        "--minibatch-seconds",
        "0.5",
        "--failures-per-gpu-day",
        "2e-3",
        "--overhead-per-minibatch",
        "0.1",
        "--gpus",
        "4",
    ]
    (row,) = run_json(capsys, argv)
    w = 0.2 + F
    assert row["jit_transparent_wasted_fraction"] == pytest.approx(
        w / (1 + w), rel=1e-9
    )
    w_user = 0.2 + F * 5 + 4 * F * 9.9 + F
    assert row["jit_user_wasted_fraction"] == pytest.approx(
        w_user / (1 + w_user), rel=1e-9
    )


def write_events(path: Path, events: list[dict]) -> Path:
    lines = [json.dumps(ev) for ev in events]
    lines.insert(1, "")  # blank lines are ignored
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


EVENTS = [
    {"event": "run_started", "t": 0.0},
    {"event": "checkpoint_saved", "t": 10.0, "seconds": 4.0},
    {"event": "checkpoint_saved", "t": 20.0, "seconds": 100.0},
    {"event": "checkpoint_saved", "t": 30.0, "seconds": 5.0},
    {"event": "checkpoint_saved", "t": 31.0},  # no "seconds": ignored
    {"event": "recovery", "t": 40.0, "restart_to_resumed_s": 12.0, "minibatch_s": 0.5},
    {"event": "recovery", "t": 50.0, "restart_to_resumed_s": 9.9, "minibatch_s": 0.418},
    {"event": "recovery", "t": 60.0, "restart_to_resumed_s": 8.0, "minibatch_s": 0.4},
    {"event": "minibatch", "t": 61.0, "seconds": 1000.0},  # other event kinds ignored
]


def test_from_events_matches_explicit_flags(capsys, tmp_path):
    # medians: seconds {4, 100, 5} -> 5; restart {12, 9.9, 8} -> 9.9; minibatch -> 0.418
    path = write_events(tmp_path / "events.jsonl", EVENTS)
    from_file = run_json(
        capsys,
        [
            "--from-events",
            str(path),
            "--failures-per-gpu-day",
            "2e-3",
            "--gpus",
            "4",
            "1024",
        ],
    )
    explicit = run_json(capsys, [*BERT, "--gpus", "4", "1024"])
    assert from_file == explicit


def test_from_events_table_shows_provenance(capsys, tmp_path):
    path = write_events(tmp_path / "events.jsonl", EVENTS)
    assert (
        plan.main(
            [
                "--from-events",
                str(path),
                "--failures-per-gpu-day",
                "2e-3",
                "--gpus",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "checkpoint cost o = 5 s" in out and "checkpoint_saved" in out
    assert "fixed recovery cost r = 9.9 s" in out


def test_from_events_flag_overrides(capsys, tmp_path):
    path = write_events(tmp_path / "events.jsonl", EVENTS)
    (row,) = run_json(
        capsys,
        [
            "--from-events",
            str(path),
            "--ckpt-seconds",
            "20",
            "--failures-per-gpu-day",
            "2e-3",
            "--gpus",
            "4",
        ],
    )
    # o = 20 from the flag, not 5 from the file: c* = 3600 sqrt(4 f / 40)
    assert row["periodic_optimal_per_hour"] == pytest.approx(
        3600 * math.sqrt(4 * F / 40)
    )


def test_from_events_missing_values(capsys, tmp_path):
    path = write_events(tmp_path / "events.jsonl", EVENTS[:4])  # no recovery events
    err = run_error(
        capsys,
        ["--from-events", str(path), "--failures-per-gpu-day", "2e-3", "--gpus", "4"],
    )
    assert "missing" in err
    assert "fixed recovery cost r" in err and "--restore-seconds" in err
    assert "minibatch time m" in err and "--minibatch-seconds" in err
    assert "'recovery' events" in err
    assert "--ckpt-seconds" not in err  # o was found in the file
    # supplying the missing ones by flag works
    rows = run_json(
        capsys,
        [
            "--from-events",
            str(path),
            "--restore-seconds",
            "9.9",
            "--minibatch-seconds",
            "0.418",
            "--failures-per-gpu-day",
            "2e-3",
            "--gpus",
            "4",
        ],
    )
    assert rows == run_json(capsys, [*BERT, "--gpus", "4"])


def test_from_events_bad_file(capsys, tmp_path):
    err = run_error(
        capsys,
        [
            "--from-events",
            str(tmp_path / "nope.jsonl"),
            "--failures-per-gpu-day",
            "2e-3",
            "--gpus",
            "4",
        ],
    )
    assert "cannot read --from-events file" in err and "nope.jsonl" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "recovery", "t": 1}\n{not json\n', encoding="utf-8")
    err = run_error(
        capsys,
        ["--from-events", str(bad), "--failures-per-gpu-day", "2e-3", "--gpus", "4"],
    )
    assert "bad.jsonl:2: not valid JSON" in err


def test_from_events_negative_value(capsys, tmp_path):
    path = write_events(
        tmp_path / "events.jsonl",
        [{"event": "checkpoint_saved", "t": 1.0, "seconds": -3.0}],
    )
    err = run_error(
        capsys,
        [
            "--from-events",
            str(path),
            "--restore-seconds",
            "1",
            "--minibatch-seconds",
            "1",
            "--failures-per-gpu-day",
            "2e-3",
            "--gpus",
            "4",
        ],
    )
    assert "--ckpt-seconds" in err and "-3.0" in err and "events.jsonl" in err


@pytest.mark.parametrize(
    "flag,value,expected",
    [
        (
            "--ckpt-seconds",
            "-5",
            "--ckpt-seconds (checkpoint cost o) must be > 0 seconds, got -5.0",
        ),
        (
            "--ckpt-seconds",
            "0",
            "--ckpt-seconds (checkpoint cost o) must be > 0 seconds, got 0.0",
        ),
        (
            "--restore-seconds",
            "-1",
            "--restore-seconds (fixed recovery cost r) must be >= 0",
        ),
        (
            "--minibatch-seconds",
            "-0.4",
            "--minibatch-seconds (minibatch time m) must be > 0",
        ),
        ("--failures-per-gpu-day", "0", "--failures-per-gpu-day must be > 0"),
        ("--failures-per-gpu-day", "-2e-3", "--failures-per-gpu-day must be > 0"),
        ("--overhead-per-minibatch", "-1", "--overhead-per-minibatch must be >= 0"),
        ("--ckpt-seconds", "nan", "--ckpt-seconds (checkpoint cost o) must be > 0"),
    ],
)
def test_bad_values(capsys, flag, value, expected):
    argv = [*BERT, "--gpus", "4"]
    i = argv.index(flag) if flag in argv else None
    if i is None:
        argv += [flag, value]
    else:
        argv[i + 1] = value
    err = run_error(capsys, argv)
    assert err.startswith("jitrun plan: error: ")
    assert expected in err


def test_bad_gpus(capsys):
    err = run_error(capsys, [*BERT, "--gpus", "4", "0"])
    assert "--gpus values must be integers >= 1, got 0" in err


def test_missing_values_without_events(capsys):
    err = run_error(
        capsys, ["--ckpt-seconds", "5", "--failures-per-gpu-day", "2e-3", "--gpus", "4"]
    )
    assert "missing fixed recovery cost r (pass --restore-seconds)" in err
    assert "minibatch time m (pass --minibatch-seconds)" in err


def test_argparse_errors_return_2(capsys):
    # required flags / non-numeric values are rejected by argparse (exit status 2)
    assert plan.main([*BERT]) == 2
    assert "--gpus" in capsys.readouterr().err
    assert plan.main([*BERT, "--gpus", "four"]) == 2
    assert "invalid int value" in capsys.readouterr().err


def test_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "jitrun.plan", *BERT, "--gpus", "4", "--json"],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["gpus"] == 4
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jitrun.plan",
            "--ckpt-seconds",
            "-1",
            "--restore-seconds",
            "1",
            "--minibatch-seconds",
            "1",
            "--failures-per-gpu-day",
            "2e-3",
            "--gpus",
            "4",
        ],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--ckpt-seconds" in proc.stderr
