"""``jitrun plan``: compare periodic vs JIT checkpointing with the paper's cost model.

Example::

    jitrun plan --ckpt-seconds 5 --restore-seconds 9.9 --minibatch-seconds 0.418 \\
        --failures-per-gpu-day 2e-3 --gpus 4 1024 8192

``--from-events PATH`` takes o, r and m from a run's ``events.jsonl``; explicit
flags override them. Exit status: 0 on success, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from typing import TextIO

from jitckpt import model

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
    return parser


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
    params: model.CostParams, gpus: Sequence[int]
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
        )
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
    except PlanError as exc:
        print(f"{PROG}: error: {exc}", file=err)
        return 2
    rows = plan_rows(params, args.gpus)
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
