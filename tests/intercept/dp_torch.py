"""A Python worker whose device work runs on the stand-in: dp.c's steps
(tests/intercept/shim_progs/dp.c, built as dp.so) driven through ctypes, with
torch marking the phases the way a real script does (a backward, then an
optimizer step), so jitckpt's runtime, launched by jitrun without any jitckpt
code here, tells the shim where the optimizer phase is.

    dp_torch.py DP_SO STEPS DIR
"""

import ctypes
import os
import sys

import torch


class DeviceSGD(torch.optim.Optimizer):
    """The optimizer step is dp.c's (grad norm, its all-reduce, momentum SGD on
    the device); torch's global optimizer hooks fire around it."""

    def __init__(self, params, lib: ctypes.CDLL) -> None:
        super().__init__(params, {})
        self.lib = lib

    def step(self, closure=None):  # noqa: ARG002 - torch's signature
        if self.lib.dp_optimizer() != 0:
            raise RuntimeError("dp_optimizer failed")


def main() -> None:
    try:
        lib = ctypes.CDLL(sys.argv[1])
    except OSError as e:
        # torch's CUDA build brings its own libcudart.so.13; dp.so then binds to it, not to the stand-in
        raise SystemExit(f"dp_torch.py: {e}: the stand-in must be this process's CUDA runtime "
                         "(LD_PRELOAD build/sim/libcudart.so.13 and libnccl.so.2)") from e
    steps, out = int(sys.argv[2]), sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("DP_FAULTS_FIRST_ATTEMPT") and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        for k in ("JITSIM_HANG_AT", "JITSIM_NCCL_ERROR_AT", "JITSIM_STICKY_ERROR_AT"):
            os.environ.pop(k, None)  # the stand-in reads them lazily: the restarted job runs clean
    # One write(2): torchrun runs workers with `python -u`, where print() writes the text and its
    # newline in two calls, so three ranks starting together interleave ("PID 1PID 2\n\n").
    os.write(1, f"PID {os.getpid()}\n".encode())
    if lib.dp_setup(rank, world, out.encode()) != 0:
        raise SystemExit("dp_setup failed")
    marker = torch.zeros(1, requires_grad=True)  # host-side stand-in of the model's loss graph
    opt = DeviceSGD([marker], lib)
    for step in range(steps):
        (marker * 0).sum().backward()  # the minibatch starts (jitckpt: phase BWD)
        if lib.dp_compute(step, 0) != 0:
            raise SystemExit("dp_compute failed")
        opt.step()
    sys.exit(lib.dp_finish(out.encode()))


if __name__ == "__main__":
    main()
