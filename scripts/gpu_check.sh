#!/usr/bin/env bash
# gpu_check.sh - jitckpt on a real GPU in one command (a lent H100/H200: <= 8 min), or on the CPU
# stand-in anywhere else (CI runs it so: tests/test_gpu_check.py), skipping what needs the device.
#
#   scripts/gpu_check.sh [--standin | --device] [--out DIR]     # DIR default: $OUT, else build/gpu_check/out
#
# Phases (scripts/gpu_check/check.py): probe; build libintercept against the real CUDA/NCCL headers;
# torch under the shim; the shim's added ns per hooked call against the same calls without it; a 2-rank
# DDP job on one GPU under `jitrun --jit-intercept on`, a rank SIGKILLed and (another run) SIGSTOPped,
# each bit-identical to plain torchrun; steady-state step time jitrun vs torchrun, interleaved; the
# replica fingerprint's seconds per GiB. Results: DIR/gpu_check.json, DIR/gpu_check.md (a short
# table, also printed), DIR/gpu_check.log. Exit 0 iff no phase failed.
#
# Python: $GPU_CHECK_PYTHON, else the GPU image's /opt/torch/.venv, else this repo's .venv, else python3.
# jitckpt needs nothing installed: where it is not importable, the repo's packages go on PYTHONPATH and
# its few runtime dependencies come from .gpu-wheels/ (`make gpu-wheels`; carry it to a machine
# without a registry). --device: fail unless a GPU is usable; --standin: never use one.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODE=auto
DIR=${OUT:-$ROOT/build/gpu_check/out}
while [ $# -gt 0 ]; do
  case $1 in
    --standin) MODE=standin ;;
    --device) MODE=device ;;
    --out) DIR=$2; shift ;;
    *) echo "gpu_check.sh: unknown argument '$1' (usage: gpu_check.sh [--standin|--device] [--out DIR])" >&2
       exit 2 ;;
  esac
  shift
done
B=$ROOT/build/gpu_check
mkdir -p "$DIR" "$B" || exit 2
exec > >(tee "$DIR/gpu_check.log") 2>&1

has_torch() { [ -x "$1" ] && "$1" -c 'import torch' >/dev/null 2>&1; }
PY=
for c in "${GPU_CHECK_PYTHON:-}" /opt/torch/.venv/bin/python3 "$ROOT/.venv/bin/python" "$(command -v python3)"; do
  if [ -n "$c" ] && has_torch "$c"; then PY=$c; break; fi
done
[ -n "$PY" ] || { echo "gpu_check.sh: no Python with torch (set GPU_CHECK_PYTHON=/path/to/python)"; exit 2; }

if [ "$MODE" != standin ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 &&
   "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  MODE=device
elif [ "$MODE" = device ]; then
  echo "gpu_check.sh: --device, but no usable GPU (nvidia-smi -L, torch.cuda.is_available() with $PY)"; exit 2
else
  MODE=standin
fi

# jitckpt and jitrun from this checkout, and its runtime dependencies
DEPS='import cffi, setproctitle, psutil, pynvml'
MINE="import jitckpt, jitrun.cli, sys; sys.exit(not jitckpt.__file__.startswith('$ROOT/'))"
if ! "$PY" -c "$DEPS; $MINE" 2>/dev/null; then
  rm -rf "$B/pkgs" && mkdir -p "$B/pkgs" && ln -s "$ROOT/jitckpt" "$B/pkgs/jitckpt" &&
    ln -s "$ROOT/launcher" "$B/pkgs/jitrun" || exit 2
  export PYTHONPATH=$B/pkgs:$B/site${PYTHONPATH:+:$PYTHONPATH}
  if ! "$PY" -c "$DEPS" 2>/dev/null; then
    ls "$ROOT"/.gpu-wheels/*.whl >/dev/null 2>&1 ||
      { echo "gpu_check.sh: $PY lacks jitckpt's dependencies and there is no .gpu-wheels/ (make gpu-wheels, carry it)"; exit 2; }
    rm -rf "$B/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$B/site" "$ROOT"/.gpu-wheels/*.whl || exit 2
  fi
  "$PY" -c "$DEPS; $MINE" || { echo "gpu_check.sh: jitckpt still not importable with $PY"; exit 2; }
fi

echo "gpu_check.sh: $MODE, $PY ($("$PY" -c 'import torch; print(torch.__version__)')), results in $DIR"
ARGS=(--out "$DIR" --build "$B" --python "$PY")
[ "$MODE" = standin ] && ARGS+=(--standin)
"$PY" "$ROOT/scripts/gpu_check/check.py" "${ARGS[@]}"
