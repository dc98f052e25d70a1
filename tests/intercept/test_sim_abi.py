"""SONAMEs, symbol versions and exports of the stand-in libraries, and `make check-abi`."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sim_progs"))
import simharness as H  # noqa: E402

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


def _torch_cuda_libs() -> list[Path]:
    spec = importlib.util.find_spec("torch")
    lib = Path(spec.submodule_search_locations[0]) / "lib" if spec and spec.submodule_search_locations else None
    return sorted(lib.glob("lib*.so*")) if lib and (lib / "libtorch_cuda.so").exists() else []


@pytest.mark.skipif(not _torch_cuda_libs(), reason="torch here is not a CUDA build: nothing of it links libcudart")
def test_exports_cover_torch_cuda_build():
    """Every libcudart.so.13 and NCCL symbol the installed CUDA build of torch
    references is exported by the stand-in with that version: torch loads its
    libraries RTLD_NOW, so one missing name and `import torch` fails in a
    process whose CUDA runtime is the stand-in (the Python-worker tests)."""
    need_cudart, need_nccl = set(), set()
    for lib in _torch_cuda_libs():
        out = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True).stdout
        for name in (line.split()[-1] for line in out.splitlines() if line.strip()):
            if name.endswith("@libcudart.so.13"):
                need_cudart.add(name.split("@")[0])
            elif re.fullmatch(r"p?nccl\w+", name):
                need_nccl.add(name)
    assert need_cudart and need_nccl, "torch's CUDA build references neither libcudart.so.13 nor NCCL"
    cudart, nccl = dynsyms(H.SIM / "libcudart.so.13"), dynsyms(H.SIM / "libnccl.so.2")
    assert sorted(n for n in need_cudart if cudart.get(n, ("",))[0] != "libcudart.so.13") == []
    assert sorted(need_nccl - set(nccl)) == []


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
