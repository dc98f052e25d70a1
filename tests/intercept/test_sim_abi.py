"""SONAMEs, symbol versions and exports of the stand-in libraries, and `make check-abi`."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sim_progs"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import simharness as H  # noqa: E402
import torch_cuda_imports as TI  # noqa: E402

REAL13 = Path("/usr/local/cuda/lib64/libcudart.so.13")


@pytest.fixture(scope="module", autouse=True)
def _build():
    H.build()


def soname(lib: Path) -> str:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return re.search(r"\(SONAME\)\s+Library soname: \[(.+?)\]", out).group(1)


def dynsyms(lib: Path) -> dict[str, str]:
    """Defined dynamic symbols -> version (or 'Base'); `w` marks weak in a separate set."""
    out = subprocess.run(["objdump", "-T", str(lib)], capture_output=True, text=True, check=True).stdout
    syms = {}
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ (.{7}) (\S+)\s+[0-9a-f]+\s+(?:\((\S+)\)|(\S+))?\s+(\S+)$", line)
        if m and m.group(2) != "*UND*":
            syms[m.group(5)] = (m.group(3) or m.group(4) or "", m.group(1))
    return syms


@pytest.mark.parametrize("major", ["12", "13"])
def test_cudart_soname_and_versions(major):
    lib = H.SIM / f"libcudart.so.{major}"
    assert soname(lib) == f"libcudart.so.{major}"
    syms = dynsyms(lib)
    for name in [
        "cudaEventRecord",
        "cudaEventRecordWithFlags",
        "cudaStreamWaitEvent",
        "cudaEventQuery",
        "cudaLaunchKernel",
        "cudaLaunchKernel_ptsz",
        "cudaMemcpy",
        "cudaMemcpy_ptds",
        "cudaMemcpyAsync_ptsz",
        "cudaStreamSynchronize_ptsz",
        "jitsimRegisterKernel",
        "jitsimFuncGetParamInfo",
    ]:
        assert syms[name][0] == f"libcudart.so.{major}", name
    # CUDA 13's nvcc launch path exists only in the .13 runtime, as in NVIDIA's.
    assert ("__cudaLaunchKernel" in syms) == (major == "13")
    assert ("__cudaGetKernel" in syms) == (major == "13")
    # Nothing but the API leaks out.
    assert all(n.startswith(("cuda", "__cuda", "jitsim", f"libcudart.so.{major}")) for n in syms), syms


@pytest.mark.skipif(not REAL13.exists(), reason="no real libcudart.so.13")
def test_cudart13_matches_real_exports():
    """Every function the stand-in exports exists in NVIDIA's runtime with the same version
    node (except the stand-in's own jitsim* extensions)."""
    ours, real = dynsyms(H.SIM / "libcudart.so.13"), dynsyms(REAL13)
    for name, (ver, _) in ours.items():
        if name.startswith("jitsim") or name == "libcudart.so.13":
            continue
        assert name in real, name
        assert real[name][0] == ver == "libcudart.so.13", name


def _torch_cuda_dir() -> Path | None:
    spec = importlib.util.find_spec("torch")
    torch_dir = Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None
    return torch_dir if torch_dir and (torch_dir / "lib" / "libtorch_cuda.so").exists() else None


@pytest.mark.skipif(_torch_cuda_dir() is None, reason="torch here is not a CUDA build: nothing of it links libcudart")
def test_exports_cover_torch_cuda_build():
    """Every libcudart.so.13 and NCCL symbol the installed CUDA build of torch
    references is exported by the stand-in with that version: torch loads its
    libraries RTLD_NOW, so one missing name and `import torch` fails in a
    process whose CUDA runtime is the stand-in (the Python-worker tests).
    make test-compat runs this for each version of the range."""
    version, need = TI.read_source(_torch_cuda_dir())
    assert need[TI.CUDART] and need[TI.NCCL], "torch's CUDA build references neither libcudart.so.13 nor NCCL"
    cudart, nccl = dynsyms(H.SIM / "libcudart.so.13"), dynsyms(H.SIM / "libnccl.so.2")
    assert sorted(n for n in need[TI.CUDART] if cudart.get(n, ("",))[0] != "libcudart.so.13") == [], version
    assert sorted(need[TI.NCCL] - set(nccl)) == [], version
    # the checked-in list the stand-in is generated from is this build's, read afresh
    listed = TI.LISTS / f"torch-{TI.base_version(version)}.txt"
    if not listed.exists():
        pytest.skip(f"no {listed.name}: scripts/torch_cuda_imports.py generate {_torch_cuda_dir()}")
    assert TI.load_list(listed) == need, f"{listed.name} is stale: scripts/torch_cuda_imports.py generate"


def test_stand_in_covers_every_listed_version():
    """The stand-in exports what each supported version's CUDA wheel imports
    (the lists, generated from the wheels), whichever torch is installed here."""
    lists = sorted(TI.LISTS.glob("torch-*.txt"))
    assert lists
    assert TI.missing(H.SIM, lists) == []


STUB_PROBE = r"""
import ctypes, sys
cudart = ctypes.CDLL(sys.argv[1] + "/libcudart.so.13")
nccl = ctypes.CDLL(sys.argv[1] + "/libnccl.so.2")
nccl.ncclGetLastError.restype = ctypes.c_char_p
print(cudart.cudaUserObjectCreate(), cudart.cudaGetLastError(), nccl.ncclCommRevoke(),
      nccl.ncclGetLastError(None).decode())
"""


def test_generated_stubs_answer_as_the_libraries_would():
    """A stub generated from the lists (two of torch 2.14.1's) says "not supported"
    in the library's own terms: cudaErrorNotSupported (801) left out of the last
    error, ncclInvalidUsage (5) with ncclGetLastError naming the call."""
    p = subprocess.run([sys.executable, "-c", STUB_PROBE, str(H.SIM)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rec, last, nccl_rc, why = p.stdout.split(maxsplit=3)
    assert (rec, last, nccl_rc) == ("801", "0", "5"), p.stdout
    assert "ncclCommRevoke" in why, why


def _range_minors() -> list[tuple[int, int]]:
    text = (H.ROOT / "pyproject.toml").read_text()
    lo, hi = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    (lmaj, lmin), (hmaj, hmin) = (tuple(map(int, v.split("."))) for v in (lo, hi))
    assert lmaj == hmaj, "a range across torch majors: list its minors here"
    return [(lmaj, m) for m in range(lmin, hmin)]


def test_a_list_for_every_version_in_the_range():
    have = {tuple(map(int, p.stem.split("-")[1].split(".")[:2])) for p in TI.LISTS.glob("torch-*.txt")}
    assert [v for v in _range_minors() if v not in have] == [], "scripts/torch_cuda_imports.py generate WHEEL"


FAKE_LIB = r"""
#include <stddef.h>
typedef int cudaError_t; typedef int ncclResult_t; typedef struct ncclComm *ncclComm_t;
cudaError_t cudaMalloc(void **p, size_t n); cudaError_t cudaUserObjectCreate(void);
ncclResult_t ncclAllReduce(void); ncclResult_t pncclCommRevoke(void);
void *use[] = {(void *)cudaMalloc, (void *)cudaUserObjectCreate, (void *)ncclAllReduce, (void *)pncclCommRevoke};
"""


def test_imports_script_reads_a_wheel(tmp_path):
    """scripts/torch_cuda_imports.py on a made-up wheel whose one library
    imports two runtime and two NCCL functions (linked against the stand-in,
    so the runtime's carry its version node as NVIDIA's would)."""
    (tmp_path / "fake.c").write_text(FAKE_LIB)
    lib = tmp_path / "libtorch_fake.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", lib, tmp_path / "fake.c", f"-L{H.SIM}",
                    "-l:libcudart.so.13", "-l:libnccl.so.2"], check=True)
    wheel = tmp_path / "torch-2.99.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("torch/version.py", "__version__ = '2.99.0+cu130'\n")
        z.write(lib, "torch/lib/libtorch_fake.so")
        z.writestr("torch/__init__.py", "")
    out = tmp_path / "lists"
    p = subprocess.run([sys.executable, TI.__file__, "generate", wheel, "--out-dir", out],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert TI.load_list(out / "torch-2.99.0.txt") == {
        TI.CUDART: {"cudaMalloc", "cudaUserObjectCreate"}, TI.NCCL: {"ncclAllReduce", "pncclCommRevoke"}}
    # a file that is no wheel: one line saying what and how, exit 2
    p = subprocess.run([sys.executable, TI.__file__, "show", tmp_path / "fake.c"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert "fake.c" in p.stderr and "torch wheel" in p.stderr


def test_nccl_soname_and_weak_aliases():
    lib = H.SIM / "libnccl.so.2"
    assert soname(lib) == "libnccl.so.2"
    syms = dynsyms(lib)
    names = [
        "ncclAllReduce",
        "ncclBroadcast",
        "ncclReduce",
        "ncclAllGather",
        "ncclReduceScatter",
        "ncclSend",
        "ncclRecv",
        "ncclGroupStart",
        "ncclGroupEnd",
        "ncclCommInitRank",
        "ncclCommInitRankConfig",
        "ncclCommSplit",
        "ncclCommAbort",
        "ncclCommDestroy",
        "ncclCommGetAsyncError",
        "ncclGetUniqueId",
        "ncclGetErrorString",
        "ncclGetLastError",
        "ncclGetVersion",
        "ncclCommCount",
    ]
    for n in names:
        assert "w" in syms[n][1], f"{n} must be weak"
        assert "g" in syms["p" + n][1], f"p{n} must be global"
    addr = {}
    out = subprocess.run(["objdump", "-T", str(lib)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[-1].lstrip("p") in names:
            addr[parts[-1]] = parts[0]
    for n in names:
        assert addr[n] == addr["p" + n], f"{n} must alias p{n}"


def test_dev_symlinks():
    assert (H.SIM / "libcudart.so").resolve().name == "libcudart.so.13"
    assert (H.SIM / "libnccl.so").resolve().name == "libnccl.so.2"


def test_check_abi():
    p = subprocess.run(
        ["make", "-s", "-C", str(H.ROOT / "libintercept"), f"BUILD={H.BUILD}", "check-abi"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stdout + p.stderr
