"""Per-minibatch replay log (paper §4.1) and virtual handles (§4.2)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "shim_progs"))
import shimtest as st  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _build() -> None:
    st.build()


def _sums(out: str) -> dict[str, str]:
    m = re.search(r"SUMS before=(\w+) scribbled=(\w+) after=(\w+) rc=(-?\d+) records=(\d+) overflows=(\d+)", out)
    assert m, out
    return dict(zip(["before", "scribbled", "after", "rc", "records", "overflows"], m.groups(), strict=True))


def test_replay_reproduces_device_buffers_bit_for_bit(tmp_path: Path) -> None:
    """Two ranks log a minibatch (H2D, kernels by value through both launch
    paths, Fig. 3 all-reduce, D2H), scribble over every non-parameter buffer
    and the host input, replay together, and get the same checksums."""
    with st.Job(tmp_path) as job:
        ps = [
            # rank 0 with virtual handles for everything, rank 1 with the default
            job.spawn(
                [str(st.PROGS / "replay"), str(r), "2", str(tmp_path)],
                f"r{r}",
                DUMP=str(tmp_path / f"log{r}"),
                JITCKPT_VIRTUAL_HANDLES="all" if r == 0 else "none",
            )
            for r in range(2)
        ]
        for r, p in enumerate(ps):
            assert p.wait(timeout=30) == 0, job.output(f"r{r}")
        sums = [_sums(job.output(f"r{r}")) for r in range(2)]
    for s in sums:
        assert s["scribbled"] != s["before"]  # the reset really destroyed the state
        assert s["after"] == s["before"] and s["rc"] == "0"
        assert int(s["records"]) >= 12 and s["overflows"] == "0"
    assert sums[0]["before"] != sums[1]["before"]  # ranks had different inputs

    lines = [json.loads(x) for x in (tmp_path / "log0").read_text().splitlines()]
    head, recs = lines[0], lines[1:]
    assert head["records"] == len(recs) and head["overflows"] == 0 and not head["incomplete"]
    ops = [r["op"] for r in recs]
    for op in [
        "cudaMemcpyAsync",
        "cudaMemcpy",
        "cudaLaunchKernel",
        "__cudaLaunchKernel",
        "cudaEventRecord",
        "cudaStreamWaitEvent",
        "ncclGroupStart",
        "ncclAllReduce",
        "ncclGroupEnd",
    ]:
        assert op in ops, ops
    h2d = recs[ops.index("cudaMemcpyAsync")]
    assert h2d["blob_len"] == 4096 * 4  # H2D source captured by value
    launch = recs[ops.index("cudaLaunchKernel")]
    assert launch["blob_len"] == 5 * 8 + 3 * 8 + 8 + 8  # 5 sizes + 3 pointers + float + int, 8-aligned


def test_replay_refuses_after_overflow(tmp_path: Path) -> None:
    with st.Job(tmp_path) as job:
        p = job.spawn([str(st.PROGS / "replay"), "0", "1", str(tmp_path)], "r0", JITCKPT_REPLAY_CAP_MB="0.01")
        assert p.wait(timeout=30) == 0, job.output("r0")
        s = _sums(job.output("r0"))
    assert int(s["overflows"]) > 0 and s["rc"] == "-1"
    assert s["after"] == s["scribbled"]  # nothing was replayed


def test_virtual_handles_survive_recreation(tmp_path: Path) -> None:
    """Streams/events re-created with their flags and priority, then the
    communicator re-created with a new unique id; the application's handles
    keep working and a stale handle fails cleanly."""
    with st.Job(tmp_path) as job:
        ps = [
            job.spawn([str(st.PROGS / "vhandles"), str(r), "2", str(tmp_path)], f"r{r}", JITCKPT_VIRTUAL_HANDLES="all")
            for r in range(2)
        ]
        for r, p in enumerate(ps):
            assert p.wait(timeout=30) == 0, job.output(f"r{r}")
        for r in range(2):
            out = job.output(f"r{r}")
            assert "VH OK" in out
            phys = dict(re.findall(r"PHYS (\w+) stream=(\S+)", out))
            assert phys["initial"] != phys["streams"]  # a new physical stream
