"""``jitrun plan``: compare periodic vs JIT checkpointing with the paper's cost model.

Example::

    jitrun plan --ckpt-seconds 5 --restore-seconds 9.9 --minibatch-seconds 0.418 \\
        --failures-per-gpu-day 2e-3 --gpus 4 1024 8192

``--from-events PATH`` takes o, r and m from a run's ``events.jsonl``; explicit
flags override them. Exit status: 0 on success, 2 on bad input.

The EC tier (formulas in ``jitrun.cost_model``): ``--correlated-fraction P``
(failures that take every replica of a shard, so no JIT checkpoint is possible) adds
"JIT + periodic backstop" (persistent checkpoints at their optimal rate for those
failures); ``--ec-every N`` with ``--ec-snapshot-seconds S`` (or ``--ec-overhead``)
adds "JIT + EC" and the EC interval that minimises its waste::

    jitrun plan --ckpt-seconds 60 --restore-seconds 30 --minibatch-seconds 1 \\
        --failures-per-gpu-day 2e-3 --gpus 1024 8192 --correlated-fraction 0.1 \\
        --ec-every 50 --ec-snapshot-seconds 0.5
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from typing import TextIO

from . import cost_model as model

PROG = "jitrun plan"

# (CostParams field, flag, meaning, events.jsonl source, positive-required)
_SECONDS_FLAGS = (
    (
        "ckpt_seconds",
        "--ckpt-seconds",
        "checkpoint cost o",
        "'seconds' of 'checkpoint_saved' events",
        True,
    ),
    (
        "restore_seconds",
        "--restore-seconds",
        "fixed recovery cost r",
        "'restart_to_resumed_s' of 'recovery' events",
        False,
    ),
    (
        "minibatch_seconds",
        "--minibatch-seconds",
        "minibatch time m",
        "'minibatch_s' of 'recovery' events",
        True,
    ),
)


class PlanError(Exception):
    """Bad user input; message is printed and the command exits with status 2."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Estimate wasted GPU time for periodic checkpointing at the optimal "
            "interval vs. user-level and transparent just-in-time checkpointing "
            "(JIT-checkpointing paper, EuroSys'24, eq. 3, 5-8)."
        ),
    )
    parser.add_argument(
        "--ckpt-seconds",
        type=float,
        metavar="O",
        help="seconds per periodic checkpoint (o)",
    )
    parser.add_argument(
        "--restore-seconds",
        type=float,
        metavar="R",
        help="fixed recovery cost per failure in seconds (r)",
    )
    parser.add_argument(
        "--minibatch-seconds",
        type=float,
        metavar="M",
        help="seconds per minibatch iteration (m)",
    )
    parser.add_argument(
        "--failures-per-gpu-day",
        type=float,
        metavar="F",
        required=True,
        help="failure rate, failures per GPU per day (paper: 2e-3)",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        nargs="+",
        metavar="N",
        required=True,
        help="one or more job sizes (number of GPUs)",
    )
    parser.add_argument(
        "--overhead-per-minibatch",
        type=float,
        default=0.0,
        metavar="S",
        help="steady-state JIT overhead in seconds per minibatch; "
        "o_jit = S / M (default 0)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print a JSON list instead of a table"
    )
    parser.add_argument(
        "--from-events",
        metavar="PATH",
        help="read O, R and M from a run's events.jsonl",
    )
    _add_ec_arguments(parser)
    return parser


# -- the EC tier: additive; without these flags the output is the paper's table as before ----------


def _add_ec_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "EC tier (jitrun --jit-ec-every): JIT + erasure-coded in-memory snapshots vs periodic checkpoints")
    g.add_argument("--correlated-fraction", type=float, metavar="P",
                   help="fraction of failures that take every replica of a shard (no JIT checkpoint possible: "
                        "job-wide crash, power domain, switch); default 0")
    g.add_argument("--ec-every", type=int, metavar="N",
                   help="EC snapshot interval in minibatches (jitrun --jit-ec-every N)")
    g.add_argument("--ec-snapshot-seconds", type=float, metavar="S",
                   help="training stall per EC snapshot in seconds (save_fn into tmpfs; the coding runs in the "
                        "background); o_ec = S / (N * M)")
    g.add_argument("--ec-overhead", type=float, metavar="FRACTION",
                   help="measured EC steady-state overhead at --ec-every (e.g. 0.01 for 1%%, "
                        "scripts/bench_ec.py --overhead); instead of --ec-snapshot-seconds")
    g.add_argument("--ec-undecodable-fraction", type=float, default=0.0, metavar="Q",
                   help="fraction of the correlated failures that also lose more than M nodes' memory, so the "
                        "EC snapshot cannot be decoded either (default 0)")


def _ec_options(args: argparse.Namespace, minibatch_seconds: float) -> tuple[dict | None, list[str]]:
    """The EC inputs as a dict for :func:`ec_columns` (None: no EC flag given), and notes."""
    given = [args.correlated_fraction, args.ec_every, args.ec_snapshot_seconds, args.ec_overhead]
    if all(v is None for v in given) and args.ec_undecodable_fraction == 0:
        return None, []
    for flag, v in (("--correlated-fraction", args.correlated_fraction),
                    ("--ec-undecodable-fraction", args.ec_undecodable_fraction)):
        if v is not None and not (math.isfinite(v) and 0 <= v <= 1):
            raise PlanError(f"{flag} must be a fraction in [0, 1], got {v!r}")
    if args.ec_every is not None and args.ec_every < 1:
        raise PlanError(f"--ec-every must be a number of minibatches >= 1, got {args.ec_every}")
    if args.ec_snapshot_seconds is not None and args.ec_overhead is not None:
        raise PlanError("--ec-snapshot-seconds and --ec-overhead say the same thing; pass one of them")
    for flag, v in (("--ec-snapshot-seconds", args.ec_snapshot_seconds), ("--ec-overhead", args.ec_overhead)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise PlanError(f"{flag} must be >= 0, got {v!r}")
    if args.ec_overhead is not None and args.ec_every is None:
        raise PlanError("--ec-overhead is the overhead measured at an interval: pass --ec-every N too")
    p = args.correlated_fraction if args.correlated_fraction is not None else 0.0
    q = args.ec_undecodable_fraction
    notes = [f"correlated failures (every replica of a shard lost) p = {p:g}; of those undecodable q = {q:g}"]
    snap = args.ec_snapshot_seconds
    if args.ec_overhead is not None:
        snap = args.ec_overhead * args.ec_every * minibatch_seconds
        notes.append(f"EC stall per snapshot s = {args.ec_overhead:g} x {args.ec_every} x "
                     f"{minibatch_seconds:g} s = {snap:.3g} s  [--ec-overhead]")
    elif snap is not None:
        notes.append(f"EC stall per snapshot s = {snap:g} s  [--ec-snapshot-seconds]")
    elif args.ec_every is not None:
        snap = 0.0
        notes.append("EC stall per snapshot not given: s = 0 (pass --ec-snapshot-seconds or --ec-overhead)")
    if args.ec_every is not None:
        t = args.ec_every * minibatch_seconds
        notes.append(f"EC snapshot every {args.ec_every} minibatches = {t:g} s; o_ec = {snap / t:.3g}")
    if p == 0 and args.ec_every is not None:
        notes.append("with no correlated failures EC snapshots are pure overhead (pass --correlated-fraction)")
    return {"p": p, "q": q, "every": args.ec_every, "snap": snap}, notes


def ec_columns(params: model.CostParams, n: int, ec: dict) -> dict[str, float | int | None]:
    """The EC tier's entries of one row (fractions; see jitrun.cost_model for the formulas)."""
    p, q, every, snap = ec["p"], ec["q"], ec["every"], ec["snap"]
    nf = n * params.failure_rate
    row: dict[str, float | int | None] = {
        "correlated_fraction": p,
        "jit_backstop_wasted_fraction": model.wasted_fraction(model.jit_backstop_waste(params, n, p)),
        "backstop_per_hour": math.sqrt(nf * p / (2 * params.ckpt_seconds)) * model.SECONDS_PER_HOUR,
    }
    if every is not None:
        t = every * params.minibatch_seconds
        row["ec_every"] = every
        row["ec_overhead"] = model.ec_overhead(snap, t)
        row["jit_ec_wasted_fraction"] = model.wasted_fraction(model.jit_ec_waste(params, n, p, t, snap, q))
        row["ec_backstop_per_hour"] = math.sqrt(nf * p * q / (2 * params.ckpt_seconds)) * model.SECONDS_PER_HOUR
    if snap:
        t_opt = model.optimal_ec_interval(params, n, p, snap, q)
        best = None if math.isinf(t_opt) else max(1, round(t_opt / params.minibatch_seconds))
        row["ec_every_optimal"] = best
        row["jit_ec_optimal_wasted_fraction"] = (
            None if best is None else model.wasted_fraction(
                model.jit_ec_waste(params, n, p, best * params.minibatch_seconds, snap, q)))
    return row


_EC_TABLE = (  # (row key, header, format)
    ("jit_backstop_wasted_fraction", "JIT+periodic backstop", "pct"),
    ("jit_ec_wasted_fraction", "JIT+EC waste", "pct"),
    ("ec_every_optimal", "best --jit-ec-every", "int"),
    ("jit_ec_optimal_wasted_fraction", "JIT+EC at best", "pct"),
)


def _ec_cells(row: dict) -> list[tuple[str, str]]:
    cells = []
    for key, head, kind in _EC_TABLE:
        if key not in row:
            continue
        v = row[key]
        cells.append((head, "off" if v is None else f"{100 * float(v):.4f}%" if kind == "pct" else str(v)))
    return cells


def _median_field(events: list[dict], event_name: str, key: str) -> float | None:
    values = []
    for ev in events:
        if ev.get("event") != event_name:
            continue
        v = ev.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            values.append(float(v))
    return statistics.median(values) if values else None


def read_events(path: str) -> dict[str, float | None]:
    """Derive ``ckpt_seconds``, ``restore_seconds``, ``minibatch_seconds`` from events.jsonl.

    Each value is the median over matching events, or None when no event has it.
    """
    events: list[dict] = []
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PlanError(
                        f"{path}:{lineno}: not valid JSON: {exc.msg}"
                    ) from exc
                if isinstance(ev, dict):
                    events.append(ev)
    except OSError as exc:
        raise PlanError(
            f"cannot read --from-events file {path!r}: {exc.strerror or exc}"
        ) from exc
    return {
        "ckpt_seconds": _median_field(events, "checkpoint_saved", "seconds"),
        "restore_seconds": _median_field(events, "recovery", "restart_to_resumed_s"),
        "minibatch_seconds": _median_field(events, "recovery", "minibatch_s"),
    }


def _resolve_params(args: argparse.Namespace) -> tuple[model.CostParams, list[str]]:
    """Merge flags and events file into CostParams; also return provenance notes."""
    from_file: dict[str, float | None] = {}
    if args.from_events:
        from_file = read_events(args.from_events)

    values: dict[str, float] = {}
    notes: list[str] = []
    missing: list[str] = []
    for field, flag, meaning, source, positive in _SECONDS_FLAGS:
        explicit = getattr(args, field)
        if explicit is not None:
            value, origin = explicit, flag
        elif from_file.get(field) is not None:
            value, origin = from_file[field], f"{args.from_events}: median {source}"
        else:
            hint = f"; {args.from_events} has no {source}" if args.from_events else ""
            missing.append(f"{meaning} (pass {flag}{hint})")
            continue
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            expected = "> 0" if positive else ">= 0"
            where = "" if origin == flag else f" (from {origin})"
            raise PlanError(
                f"{flag} ({meaning}) must be {expected} seconds, got {value!r}{where}"
            )
        values[field] = value
        notes.append(f"{meaning} = {value:g} s  [{origin}]")
    if missing:
        raise PlanError("missing " + "; ".join(missing))

    f_day = args.failures_per_gpu_day
    if not math.isfinite(f_day) or f_day <= 0:
        raise PlanError(
            f"--failures-per-gpu-day must be > 0 failures per GPU per day, got {f_day!r}"
        )
    s = args.overhead_per_minibatch
    if not math.isfinite(s) or s < 0:
        raise PlanError(f"--overhead-per-minibatch must be >= 0 seconds, got {s!r}")
    bad = [n for n in args.gpus if n < 1]
    if bad:
        raise PlanError(f"--gpus values must be integers >= 1, got {bad[0]}")

    jit_overhead = s / values["minibatch_seconds"]
    notes.append(f"failure rate f = {f_day:g} per GPU per day")
    notes.append(
        f"JIT overhead o_jit = {s:g} s / {values['minibatch_seconds']:g} s = {jit_overhead:.3g}"
    )
    try:
        params = model.CostParams(
            failure_rate=model.failures_per_gpu_second(f_day),
            jit_overhead=jit_overhead,
            **values,
        )
    except ValueError as exc:  # defensive: the checks above should catch everything
        raise PlanError(str(exc)) from exc
    return params, notes


def plan_rows(
    params: model.CostParams, gpus: Sequence[int], ec: dict | None = None
) -> list[dict[str, float | int]]:
    """One dict per job size with the keys emitted by ``--json`` (fractions, not percent)."""
    rows: list[dict[str, float | int]] = []
    for n in gpus:
        c_star = model.optimal_checkpoint_frequency(params, n)
        rows.append(
            {
                "gpus": n,
                "periodic_optimal_per_hour": c_star * model.SECONDS_PER_HOUR,
                "periodic_wasted_fraction": model.wasted_fraction(
                    model.periodic_optimal_waste(params, n)
                ),
                "jit_user_wasted_fraction": model.wasted_fraction(
                    model.jit_user_waste(params, n)
                ),
                "jit_transparent_wasted_fraction": model.wasted_fraction(
                    model.jit_transparent_waste(params, n)
                ),
                **(ec_columns(params, n, ec) if ec is not None else {}),
            }
        )
    return rows


def format_table(rows: list[dict[str, float | int]]) -> str:
    """Render rows as an aligned text table (waste shown in percent)."""
    header = (
        "GPUs",
        "ckpt/hour",
        "min between ckpts",
        "periodic waste",
        "user JIT waste",
        "transparent JIT waste",
    )
    body = []
    for row in rows:
        per_hour = float(row["periodic_optimal_per_hour"])
        body.append(
            (
                str(row["gpus"]),
                f"{per_hour:.3f}",
                f"{60.0 / per_hour:.1f}",
                f"{100 * float(row['periodic_wasted_fraction']):.4f}%",
                f"{100 * float(row['jit_user_wasted_fraction']):.4f}%",
                f"{100 * float(row['jit_transparent_wasted_fraction']):.4f}%",
            )
            + tuple(cell for _h, cell in _ec_cells(row))
        )
    if rows and _ec_cells(rows[0]):
        header = header + tuple(h for h, _c in _ec_cells(rows[0]))
    widths = [max(len(r[i]) for r in (header, *body)) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in (header, *body)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


_VALUE_FLAGS = frozenset(
    {
        "--ckpt-seconds",
        "--restore-seconds",
        "--minibatch-seconds",
        "--failures-per-gpu-day",
        "--overhead-per-minibatch",
        "--correlated-fraction",
        "--ec-every",
        "--ec-snapshot-seconds",
        "--ec-overhead",
        "--ec-undecodable-fraction",
    }
)


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """Rewrite ``--flag -2e-3`` as ``--flag=-2e-3``.

    argparse only recognises plain negative numbers like ``-5`` or ``-0.5`` as
    values; ``-2e-3`` would be taken for an option and the user would get
    "expected one argument" instead of our range error.
    """
    result: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if tok in _VALUE_FLAGS and nxt is not None and nxt.startswith("-"):
            try:
                float(nxt)
            except ValueError:
                pass
            else:
                result.append(f"{tok}={nxt}")
                i += 2
                continue
        result.append(tok)
        i += 1
    return result


def main(
    argv: list[str], stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Run ``jitrun plan`` with ``argv`` (without the program/subcommand name)."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    parser = _build_parser()
    try:
        args = parser.parse_args(_join_negative_values(argv))
    except SystemExit as exc:  # argparse already printed usage/error (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        params, notes = _resolve_params(args)
        ec, ec_notes = _ec_options(args, params.minibatch_seconds)
    except PlanError as exc:
        print(f"{PROG}: error: {exc}", file=err)
        return 2
    notes += ec_notes
    rows = plan_rows(params, args.gpus, ec)
    if args.json:
        print(json.dumps(rows, indent=2), file=out)
    else:
        for note in notes:
            print(note, file=out)
        print(file=out)
        print(format_table(rows), file=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
