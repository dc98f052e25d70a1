"""How the shim binds: one table, versioned symbols, RTLD_LOCAL runtimes,
NVIDIA's real libcudart, and the Python binding."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "shim_progs"))
import shimtest as st  # noqa: E402

TABLE = st.REPO / "libintercept" / "src" / "shim_table.h"
REAL_CUDART = Path("/usr/local/cuda/lib64/libcudart.so.13")


@pytest.fixture(scope="module", autouse=True)
def _build() -> None:
    st.build()


def _table() -> list[tuple[str, str]]:
    return re.findall(r"^\s*X\((\w+),.*\b(JI_CUDART|JI_NCCL)\b", TABLE.read_text(), re.M)


def _dynsyms(path: Path) -> list[str]:
    out = subprocess.run(["objdump", "-T", str(path)], capture_output=True, text=True, check=True).stdout
    return [x for x in out.splitlines() if len(x.split()) >= 3]


def test_table_exports_and_counters_agree() -> None:
    table = _table()
    assert len(table) >= 45
    names = [n for n, _ in table]
    nm = subprocess.run(["nm", "-D", "--defined-only", str(st.SHIM)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1].split("@")[0] for line in nm.stdout.splitlines()}
    assert not set(names) - exported
    # Queried in a child with the shim preloaded (an ASan build cannot be
    # dlopen'ed into this uninstrumented interpreter).
    code = (
        "import ctypes, json\n"
        "lib = ctypes.CDLL(None)\n"
        "lib.jitintercept_counter_name.restype = ctypes.c_char_p\n"
        "lib.jitintercept_counter.restype = ctypes.c_int64\n"
        "n = lib.jitintercept_counter_count()\n"
        "names = [lib.jitintercept_counter_name(i).decode() for i in range(n)]\n"
        "print(json.dumps({'names': names, 'unknown': lib.jitintercept_counter(b'nope')}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=st.env(leaks=False), capture_output=True, text=True, check=True
    )
    res = json.loads(out.stdout)
    assert res["names"] == names and res["unknown"] == -1


def test_cuda_hooks_carry_both_libcudart_version_nodes() -> None:
    lines = _dynsyms(st.SHIM)
    for name, lib in _table():
        mine = [x for x in lines if x.split()[-1] == name]
        vers = sorted(x.split()[-2] for x in mine)
        if lib == "JI_CUDART":
            assert vers == ["(libcudart.so.12)", "libcudart.so.13"], (name, vers)
        else:  # libnccl.so.2 has no symbol versions: unversioned refs bind
            assert vers == ["JITINTERCEPT_1"], (name, vers)


def test_versioned_13_references_are_interposed(tmp_path: Path) -> None:
    refs = [x for x in _dynsyms(st.PROGS / "ranks") if "cudaEventRecord" in x]
    assert refs and all("(libcudart.so.13)" in x for x in refs)  # the program's references are versioned
    with st.Job(tmp_path) as job:
        ps = [
            job.spawn([str(st.PROGS / "ranks"), "train", str(r), "2", str(tmp_path)], f"r{r}", ITERS="20")
            for r in range(2)
        ]
        for r, p in enumerate(ps):
            assert p.wait(timeout=20) == 0, job.output(f"r{r}")
        assert "record=20 wait=40 allreduce=25" in job.output("r0")


def test_versioned_12_references_are_interposed() -> None:
    refs = [x for x in _dynsyms(st.PROGS / "v12") if "cudaEventRecord" in x]
    assert refs and all("(libcudart.so.12)" in x for x in refs)
    out = subprocess.run([str(st.PROGS / "v12")], env=st.env(), capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert "V12 record=10 query=1 create=1" in out.stdout
    plain = subprocess.run([str(st.PROGS / "v12")], env=st.env(preload=False), capture_output=True, text=True)
    assert "V12 record=-1" in plain.stdout  # control: without the shim nothing counts


@pytest.mark.skipif(st.ASAN, reason="variants are built without sanitizers")
def test_version_node_analysis_holds() -> None:
    """Why the shim carries both nodes: a shim whose hooks are only
    `@@libcudart.so.13` does not interpose `@libcudart.so.12` references (glibc
    requires the version names to match once the object defines versions); an
    unversioned shim (no version definitions) interposes both, and so does
    ours, which also keeps the version information in its exports."""
    variants = st.PROGS / "variants"

    def records(prog: str, shim: Path) -> str:
        e = st.env(preload=False)
        e["LD_PRELOAD"] = str(shim)
        out = subprocess.run([str(st.PROGS / prog)], env=e, capture_output=True, text=True, timeout=20)
        assert out.returncode == 0, out.stderr
        return re.search(r"record=(-?\d+)", out.stdout).group(1)

    assert records("v12", st.SHIM) == records("v13", st.SHIM) == "10"
    assert records("v12", variants / "unversioned" / "libjitintercept.so") == "10"
    assert records("v13", variants / "unversioned" / "libjitintercept.so") == "10"
    assert records("v13", variants / "v13only" / "libjitintercept.so") == "10"
    assert records("v12", variants / "v13only" / "libjitintercept.so") == "0"  # bound to the real .12


def test_runtime_loaded_rtld_local_is_found_via_link_map() -> None:
    """liblocal.so (and its libcudart) dlopen'ed RTLD_LOCAL: RTLD_NEXT cannot
    see the runtime; the dl_iterate_phdr + RTLD_NOLOAD fallback must."""
    out = subprocess.run(
        [str(st.PROGS / "localload"), str(st.PROGS / "liblocal.so")],
        env=st.env(),
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "LOCAL rc=0 record=1 query=1 malloc=1 stream=1" in out.stdout


@pytest.mark.skipif(not REAL_CUDART.exists(), reason="CUDA toolkit runtime not installed")
def test_real_libcudart_calls_are_intercepted_and_errors_unchanged(tmp_path: Path) -> None:
    prog = st.PROGS / "realcudart"
    assert any("(libcudart.so.13)" in x for x in _dynsyms(prog))
    plain = subprocess.run([str(prog)], env=st.env(preload=False), capture_output=True, text=True, timeout=30)
    dump = tmp_path / "counters.json"
    shim = subprocess.run(
        [str(prog)], env=st.env(JITCKPT_COUNTERS_DUMP=str(dump)), capture_output=True, text=True, timeout=30
    )
    assert plain.returncode == shim.returncode == 0
    assert shim.stdout == plain.stdout  # same status codes, call by call
    codes = dict(line.split() for line in plain.stdout.splitlines())
    assert codes["cudaMalloc"] != "0"  # no device here: a real error came back
    assert "COUNTERS malloc=1 record=1 launch=1" in shim.stderr  # jitintercept_counter() via dlsym
    assert "COUNTERS malloc=-1" in plain.stderr
    counts = json.loads(dump.read_text())
    for name in codes:
        assert counts[name] == 1, name


def test_python_binding(tmp_path: Path) -> None:
    code = (
        "import importlib.util, json, sys\n"
        "spec = importlib.util.spec_from_file_location('intercept', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules\n"
        "m.minibatch_begin()\n"
        "c = m.counters()\n"
        "m.dump_replay_log(sys.argv[2])\n"
        "res = {'loaded': m.loaded(), 'n': len(c), 'keys': sorted(c)[:3], 'triggers': m.stat('triggers'),\n"
        "       'timeout': m.timeout_s()}\n"
        "print(json.dumps(res))\n"
    )
    args = [sys.executable, "-c", code, str(st.REPO / "jitckpt" / "intercept.py"), str(tmp_path / "log")]
    res = json.loads(subprocess.run(args, env=st.env(leaks=False), capture_output=True, text=True, check=True).stdout)
    assert res["loaded"] and res["n"] == len(_table()) and res["triggers"] == 0
    assert res["timeout"] == 30.0  # adaptive default floor before any collective
    head = json.loads((tmp_path / "log").read_text().splitlines()[0])
    assert head["records"] == 0 and head["minibatch"] >= 1
    # Without the shim: loaded() is False and counters() is empty.
    code2 = code.replace("m.dump_replay_log(sys.argv[2])\n", "")
    out = subprocess.run(
        [sys.executable, "-c", code2, args[3], args[4]],
        env=st.env(preload=False),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out) == {"loaded": False, "n": 0, "keys": [], "triggers": -1, "timeout": None}
