"""GIL-safe trigger (paper §3.2) and memcpy redirect during the trigger.

The Python test: the main thread calls cudaStreamSynchronize through
ctypes.PyDLL (which keeps the GIL held) on a stream stuck behind an
all-reduce the peer never joins. The Python hang handler must still run
(on the watchdog thread), copy device memory out while the trigger is active,
and exit. With the signal-based GIL release disabled it cannot run at all,
which shows the release is what makes it work.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "shim_progs"))
import shimtest as st  # noqa: E402

CHILD = textwrap.dedent(
    """
    import ctypes, importlib.util, json, os, sys, threading
    spec = importlib.util.spec_from_file_location("intercept", sys.argv[1])
    intercept = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(intercept)
    out_path, idpath = sys.argv[3], sys.argv[4]
    blk = ctypes.PyDLL(sys.argv[2])  # PyDLL: the GIL stays held during calls
    blk.blk_dev.restype = ctypes.c_void_p
    blk.blk_stream.restype = ctypes.c_void_p
    blk.blk_pattern.restype = ctypes.c_void_p
    assert intercept.loaded()
    assert blk.blk_setup(0, 2, idpath.encode()) == 0
    main_ident = threading.get_ident()

    def handler(ev):
        rt = ctypes.CDLL(None)  # global namespace: the shim's cudaMemcpy
        n = blk.blk_nbytes()
        want = ctypes.string_at(blk.blk_pattern(), n)
        a = ctypes.create_string_buffer(n)
        rc1 = rt.cudaMemcpy(a, ctypes.c_void_p(blk.blk_dev()), ctypes.c_size_t(n), 2)
        b = ctypes.create_string_buffer(n)
        rc2 = rt.cudaMemcpyAsync(b, ctypes.c_void_p(blk.blk_dev()), ctypes.c_size_t(n), 2,
                                 ctypes.c_void_p(blk.blk_stream()))
        rc3 = rt.cudaStreamSynchronize(ctypes.c_void_p(blk.blk_stream()))
        res = {"event": ev, "rc": [rc1, rc2, rc3], "copy_ok": [a.raw == want, b.raw == want],
               "other_thread": threading.get_ident() != main_ident,
               "gil_released": intercept.stat("gil_released"),
               "redirected": intercept.stat("redirected_memcpy")}
        with open(out_path + ".tmp", "w") as f:
            json.dump(res, f)
        os.rename(out_path + ".tmp", out_path)
        os._exit(0)

    intercept.set_hang_handler(handler)
    assert blk.blk_enqueue_hung() == 0
    rt = ctypes.PyDLL(None)  # global namespace (the shim's hook), GIL kept held
    print("blocking", flush=True)
    rc = rt.cudaStreamSynchronize(ctypes.c_void_p(blk.blk_stream()))  # never returns
    print("cudaStreamSynchronize returned", rc, flush=True)
    """
)


@pytest.fixture(scope="module", autouse=True)
def _build() -> None:
    st.build()


def _run(tmp: Path, **extra: str) -> tuple[st.Job, object, Path]:
    job = st.Job(tmp)
    script = tmp / "child.py"
    script.write_text(CHILD)
    out = tmp / "result.json"
    job.spawn([str(st.PROGS / "ranks"), "initonly", "1", "2", str(tmp)], "peer")
    p = job.spawn(
        [
            sys.executable,
            str(script),
            str(st.REPO / "jitckpt" / "intercept.py"),
            str(st.PROGS / "blocker.so"),
            str(out),
            str(tmp / "nccl.id"),
        ],
        "child",
        JITCKPT_TIMEOUT="1",
        **extra,
    )
    return job, p, out


def test_python_handler_runs_while_main_thread_holds_gil_in_blocking_call(tmp_path: Path) -> None:
    job, p, out = _run(tmp_path)
    with job:
        assert p.wait(timeout=20) == 0, job.output("child")
        res = json.loads(out.read_text())
    assert res["event"]["event"] == "hang" and res["event"]["collective"] == "ncclAllReduce"
    assert res["other_thread"]
    assert res["gil_released"] >= 1  # the parked main thread gave up the GIL on our signal
    # Memcpy redirect: both copies completed although the stream (and, through
    # it, the legacy default stream) is blocked behind the hung all-reduce.
    assert res["rc"] == [0, 0, 0] and res["copy_ok"] == [True, True]
    assert res["redirected"] >= 2


def test_without_signal_release_the_handler_cannot_run(tmp_path: Path) -> None:
    job, p, out = _run(tmp_path, JITCKPT_GIL_SIGNAL="0")
    with job:
        assert st.wait_for(lambda: "blocking" in job.output("child"), 10)
        # Timeout is 1 s: give the watchdog ample time to fire and get stuck.
        assert not st.wait_for(out.exists, 4)
        assert p.poll() is None


@pytest.mark.parametrize("redirect", ["1", "0"])
def test_memcpy_redirect_in_c_handler(tmp_path: Path, redirect: str) -> None:
    """A C handler copies device memory out with cudaMemcpy (legacy stream,
    which waits for the hung blocking stream) and cudaMemcpyAsync + sync on the
    hung stream itself. With JITCKPT_REDIRECT=0 (negative control) it hangs."""
    with st.Job(tmp_path) as job:
        job.spawn([str(st.PROGS / "ranks"), "initonly", "1", "2", str(tmp_path)], "peer")
        p = job.spawn(
            [str(st.PROGS / "ranks"), "redirect", "0", "2", str(tmp_path)],
            "r0",
            JITCKPT_TIMEOUT="1",
            JITCKPT_REDIRECT=redirect,
        )
        if redirect == "1":
            assert p.wait(timeout=15) == 0, job.output("r0")
            assert "REDIRECT ok1=1 ok2=1 redirected=2" in job.output("r0")
        else:
            assert st.wait_for(lambda: "HANDLER" in job.output("r0") or p.poll() is not None, 4) is False
            assert p.poll() is None
