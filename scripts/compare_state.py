"""Bit-for-bit comparison of two saved training states (nested dicts of tensors).

    python scripts/compare_state.py A.pt B.pt   # exit 0 iff identical
"""

from __future__ import annotations

import sys

import torch


def _flatten(obj, prefix: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), obj


def diff_states(a_path: str, b_path: str) -> tuple[int, list[str]]:
    """(number of leaves compared, list of differences)."""
    a = dict(_flatten(torch.load(a_path, weights_only=True)))
    b = dict(_flatten(torch.load(b_path, weights_only=True)))
    diffs = [f"only in one state: {k}" for k in sorted(set(a) ^ set(b))]
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            # bitwise: compare raw bytes so -0.0/NaN payloads count too
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(
                x.reshape(-1).contiguous().view(torch.uint8), y.reshape(-1).contiguous().view(torch.uint8))
        else:
            same = x == y
        if not same:
            diffs.append(f"differs: {k}")
    return len(a), diffs


if __name__ == "__main__":
    n, diffs = diff_states(sys.argv[1], sys.argv[2])
    print("\n".join(diffs) if diffs else f"identical: {n} entries bit for bit")
    sys.exit(1 if diffs else 0)
