"""jitckpt's runtime driven by libintercept (the GPU path, on the stand-in).

A worker's main thread holds the GIL inside cudaStreamSynchronize on a stream
stuck behind an all-reduce its peer never joins. The shim's watchdog must get
the GIL (signal-based release), call jitckpt's hang handler, whose JIT save
copies device memory out through cudaMemcpy (redirected off the blocked
stream) inside the user's save_fn, publishes a verified replica checkpoint
and exits with EXIT_SAVED.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "shim_progs"))
import shimtest as st  # noqa: E402

from jitckpt.wire import layout  # noqa: E402
from jitckpt.wire.config import EXIT_SAVED  # noqa: E402

CHILD = textwrap.dedent(
    """
    import ctypes, os, sys
    sys.path.insert(0, sys.argv[1])
    from jitckpt import api, intercept
    from jitckpt.wire import layout
    blk = ctypes.PyDLL(sys.argv[2])  # the GIL stays held during calls
    blk.blk_dev.restype = ctypes.c_void_p
    blk.blk_stream.restype = ctypes.c_void_p
    blk.blk_pattern.restype = ctypes.c_void_p
    assert intercept.loaded()
    assert blk.blk_setup(0, 2, sys.argv[3].encode()) == 0

    rt = api._get_runtime()
    assert rt.cfg.root is not None
    api._attach_intercept(rt)  # what install() does under jitrun with the shim preloaded

    def save_fn(d):
        n = blk.blk_nbytes()
        host = ctypes.create_string_buffer(n)
        rc = ctypes.CDLL(None).cudaMemcpy(host, ctypes.c_void_p(blk.blk_dev()), ctypes.c_size_t(n), 2)
        assert rc == 0, rc
        with open(os.path.join(d, "device.bin"), "wb") as f:
            f.write(host.raw)

    rt.save_fn = save_fn
    with open(sys.argv[4], "wb") as f:  # what the device buffer holds, for the test to compare
        f.write(ctypes.string_at(blk.blk_pattern(), blk.blk_nbytes()))
    rt.on_backward(None)  # in minibatch 0's backward: a consistent point
    assert blk.blk_enqueue_hung() == 0
    print("blocking", flush=True)
    ctypes.PyDLL(None).cudaStreamSynchronize(ctypes.c_void_p(blk.blk_stream()))  # never returns
    print("returned", flush=True)
    """
)


@pytest.fixture(scope="module", autouse=True)
def _build() -> None:
    st.build()


def test_hang_leads_to_verified_jit_checkpoint_with_gil_held(tmp_path: Path) -> None:
    root = tmp_path / "jit"
    layout.claim_root(root, "job-x")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    job = st.Job(tmp_path)
    with job:
        job.spawn([str(st.PROGS / "ranks"), "initonly", "1", "2", str(tmp_path)], "peer")
        p = job.spawn([sys.executable, str(script), str(st.REPO), str(st.PROGS / "blocker.so"),
                       str(tmp_path / "nccl.id"), str(tmp_path / "expected.bin")], "child",
                      JITCKPT_TIMEOUT="1", JITCKPT_DIR=str(root), JITCKPT_JOB_ID="job-x", RANK="0", WORLD_SIZE="2")
        assert p.wait(timeout=30) == EXIT_SAVED, job.output("child")
        assert "returned" not in job.output("child")
    replicas, rejected = layout.scan(root, "job-x")
    assert not rejected and [(r.step, r.rank) for r in replicas] == [(0, 0)]
    # the device buffer, copied out past the hung stream
    assert (replicas[0].path / "device.bin").read_bytes() == (tmp_path / "expected.bin").read_bytes()
