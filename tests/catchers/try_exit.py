"""The shared training (core.py) ended the way many scripts end: any
exception is logged and the process exits 1.

    jitrun --nproc-per-node 2 try_exit.py --out final.pt --epochs 3
"""

from __future__ import annotations

import argparse
import logging
import sys

from core import train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    train(args.out, args.epochs)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        logging.exception("training failed")
        sys.exit(1)
