"""jitckpt.ec: Reed-Solomon through ISA-L, checked against an independent GF(2^8) model."""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitckpt.ec import codec as ec
from jitckpt.ec.codec import Codec, IsalUnavailable, crc32c

ROOT = Path(__file__).resolve().parent.parent
CODES = [(2, 1), (4, 2), (3, 3), (8, 3)]


# -- an independent model of the code: GF(2^8) with ISA-L's polynomial x^8+x^4+x^3+x^2+1 ----------------

def _gf_mul(a: int, b: int) -> int:
    r = 0
    while b:
        if b & 1:
            r ^= a
        a <<= 1
        if a & 0x100:
            a ^= 0x11D
        b >>= 1
    return r


def _gf_inv(a: int) -> int:
    return next(x for x in range(1, 256) if _gf_mul(a, x) == 1)


def _reference_parity(data: bytes, k: int, m: int) -> list[bytes]:
    """Parity of a systematic Cauchy code with rows 1/(i xor j), i = k..k+m-1, j = 0..k-1."""
    cs = -(-len(data) // k)
    padded = data.ljust(k * cs, b"\0")
    cols = [padded[j * cs:(j + 1) * cs] for j in range(k)]
    out = []
    for i in range(k, k + m):
        coef = [_gf_inv(i ^ j) for j in range(k)]
        row = bytearray(cs)
        for j in range(k):
            for t in range(cs):
                row[t] ^= _gf_mul(coef[j], cols[j][t])
        out.append(bytes(row))
    return out


def _sizes(k: int) -> list[int]:
    return sorted({0, 1, k - 1, k, k + 1, 3 * k + 1, 1000, 4097})


# -- round trips ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("k,m", CODES)
def test_every_loss_pattern_up_to_m_decodes_byte_exact(k: int, m: int) -> None:
    codec = Codec(k, m)
    rng = random.Random(k * 100 + m)
    for size in _sizes(k):
        data = rng.randbytes(size)
        chunks = codec.encode(data)
        assert len(chunks) == k + m
        assert {len(c) for c in chunks} == {codec.chunk_size(size)}
        for lost_n in range(m + 1):
            for lost in itertools.combinations(range(k + m), lost_n):
                got = codec.decode({i: chunks[i] for i in range(k + m) if i not in lost}, size)
                assert got == data, (k, m, size, lost)


@pytest.mark.parametrize("k,m", [(2, 1), (4, 2), (3, 3)])
def test_parity_matches_independent_cauchy_model(k: int, m: int) -> None:
    codec = Codec(k, m)
    data = random.Random(7).randbytes(5 * k + 3)
    chunks = codec.encode(data)
    assert [bytes(c) for c in chunks[k:]] == _reference_parity(data, k, m)
    # identity on top: the code is systematic
    mat = codec.matrix()
    assert mat[:k * k] == bytes(1 if r == c else 0 for r in range(k) for c in range(k))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 12), m=st.integers(0, 5), size=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1))
def test_random_code_size_and_losses_round_trip(k: int, m: int, size: int, seed: int) -> None:
    rng = random.Random(seed)
    codec = Codec(k, m)
    data = rng.randbytes(size)
    chunks = codec.encode(data)
    lost = set(rng.sample(range(k + m), rng.randint(0, m)))
    avail = {i: bytes(chunks[i]) for i in range(k + m) if i not in lost}
    assert codec.decode(avail, size) == data


def test_data_chunks_are_views_of_the_input() -> None:
    codec = Codec(4, 2)
    data = bytearray(os.urandom(4 * 1000 + 3))
    chunks = codec.encode(data)
    for c in chunks[:3]:
        assert c.obj is data  # no copy of the full data chunks
    assert chunks[3].obj is not data  # the padded tail is a copy
    assert bytes(chunks[3]) == bytes(data[3 * 1001:]) + b"\0"


def test_decode_accepts_bytes_bytearray_memoryview_and_none_as_missing() -> None:
    codec = Codec(3, 2)
    data = os.urandom(999)
    ch = codec.encode(data)
    mixed = {0: bytes(ch[0]), 2: bytearray(ch[2]), 4: memoryview(bytes(ch[4])), 1: None}
    assert codec.decode(mixed, len(data)) == data


def test_buffer_reuse_parity_and_out() -> None:
    codec = Codec(4, 2)
    data = os.urandom(40_000)
    cs = codec.chunk_size(len(data))
    parity = [bytearray(cs + 10), bytearray(cs + 10)]
    chunks = codec.encode(data, parity=parity)
    assert chunks[4].obj is parity[0] and len(chunks[4]) == cs
    assert [bytes(c) for c in chunks] == [bytes(c) for c in codec.encode(data)]
    out = bytearray(4 * cs)
    got = codec.decode({i: chunks[i] for i in (1, 3, 4, 5)}, len(data), out=out)
    assert got == data and got.obj is out
    with pytest.raises(ValueError, match="parity buffer 1 must be writable and hold at least"):
        codec.encode(data, parity=[bytearray(cs), bytearray(cs - 1)])
    with pytest.raises(ValueError, match="parity buffer 0 .*read-only"):
        codec.encode(data, parity=[bytes(cs), bytearray(cs)])
    with pytest.raises(ValueError, match="takes m=2 buffers"):
        codec.encode(data, parity=[bytearray(cs)])
    with pytest.raises(ValueError, match="out= must be writable"):
        codec.decode({i: chunks[i] for i in range(4)}, len(data), out=bytearray(4 * cs - 1))


def test_segmented_calls_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers beyond ISA-L's int length go in segments; force tiny segments to exercise that path."""
    codec = Codec(4, 2)
    data = os.urandom(10_007)
    whole = [bytes(c) for c in codec.encode(data)]
    crc_whole = crc32c(data)
    monkeypatch.setattr(ec, "_SEGMENT", 96)
    seg = [bytes(c) for c in codec.encode(data)]
    assert seg == whole
    assert codec.decode({i: whole[i] for i in (2, 3, 4, 5)}, len(data)) == data
    assert crc32c(data) == crc_whole


def test_decode_tables_are_cached_per_erasure_pattern(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = Codec(4, 2)
    data = os.urandom(1000)
    ch = codec.encode(data)
    for _ in range(3):
        codec.decode({i: ch[i] for i in (0, 2, 4, 5)}, 1000)
    codec.decode({i: ch[i] for i in (1, 2, 3, 4)}, 1000)
    codec.decode({i: ch[i] for i in range(4)}, 1000)  # no loss: no tables at all
    assert list(codec._decode_cache) == [(0, 2, 4, 5), (1, 2, 3, 4)]
    monkeypatch.setattr(codec, "DECODE_CACHE_SIZE", 2)
    codec.decode({i: ch[i] for i in (0, 1, 4, 5)}, 1000)
    assert list(codec._decode_cache) == [(1, 2, 3, 4), (0, 1, 4, 5)]


# -- errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k,m", [(2, 1), (4, 2), (3, 3)])
def test_more_than_m_losses_fail_clearly(k: int, m: int) -> None:
    codec = Codec(k, m)
    data = os.urandom(777)
    ch = codec.encode(data)
    for lost in itertools.combinations(range(k + m), m + 1):
        with pytest.raises(ValueError, match=rf"at least k={k} of the {k + m} are needed.*unrecoverable"):
            codec.decode({i: ch[i] for i in range(k + m) if i not in lost}, len(data))


def test_mismatched_chunk_sizes_and_wrong_size_are_refused() -> None:
    codec = Codec(4, 2)
    data = os.urandom(4000)
    ch = {i: bytes(c) for i, c in enumerate(codec.encode(data))}
    bad = dict(ch)
    bad[5] = bad[5][:-1]
    with pytest.raises(ValueError, match=r"chunk 5 has 999 bytes but .* 1000 bytes; the chunks come from different"):
        codec.decode(bad, 4000)
    with pytest.raises(ValueError, match=r"chunks of ceil\(4100/4\) = 1025 bytes"):
        codec.decode(ch, 4100)


@pytest.mark.parametrize("idx", [-1, 6, 255, "1", 1.0, True])
def test_bad_chunk_indices_are_refused(idx: object) -> None:
    codec = Codec(4, 2)
    enc = [bytes(c) for c in codec.encode(b"x" * 40)]
    # idx first, and no key 1 or 0: True and 1.0 would otherwise merge with an int key of the dict
    ch = {idx: enc[0], **{i: enc[i] for i in range(2, 6)}}
    with pytest.raises(ValueError, match=r"chunk index .* is invalid; indices run 0\.\.5"):
        codec.decode(ch, 40)


@pytest.mark.parametrize("k,m", [(0, 1), (-1, 2), (1, -1), (200, 56), (255, 1), (256, 0)])
def test_k_m_out_of_range(k: int, m: int) -> None:
    with pytest.raises(ValueError, match=r"need k >= 1, m >= 0 and k \+ m <= 255"):
        Codec(k, m)


@pytest.mark.parametrize("k,m", [(2.0, 1), (2, "1"), (True, 1)])
def test_k_m_must_be_ints(k: object, m: object) -> None:
    with pytest.raises(TypeError, match="takes ints"):
        Codec(k, m)  # type: ignore[arg-type]


def test_extreme_codes_work() -> None:
    for k, m in [(1, 0), (1, 1), (254, 1), (128, 127)]:
        codec = Codec(k, m)
        data = os.urandom(3 * k + 1)
        ch = codec.encode(data)
        lost = set(random.Random(k).sample(range(k + m), m))
        assert codec.decode({i: ch[i] for i in range(k + m) if i not in lost}, len(data)) == data


def test_encode_rejects_non_buffers_and_non_contiguous() -> None:
    codec = Codec(2, 1)
    with pytest.raises(TypeError, match="bytes-like"):
        codec.encode("text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not C-contiguous"):
        codec.encode(memoryview(bytes(100))[::2])


def test_missing_library_says_how_to_install() -> None:
    with pytest.raises(IsalUnavailable, match=r"apt-get install -y libisal2.*make setup"):
        ec._load_isal(["libisal-does-not-exist.so.9"])
    assert issubclass(IsalUnavailable, ImportError)


def test_crc32c_known_vector_and_chaining() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283
    assert crc32c(b"123456788") != 0xE3069283


# -- the GIL --------------------------------------------------------------------------------------------

def _seen_mid_call(call, parity: list[bytearray]) -> int:
    """Run ``call`` (an encode into ``parity``) while another Python thread watches
    the output: how often it saw the call under way, the first parity chunk's head
    written and the last chunk's tail not yet (ISA-L writes the parity rows in order,
    each from start to end). A call that holds the GIL never lets it look then; one
    that releases it does, however busy the machine (it needs only to be scheduled
    once during the call), which wall-clock stall ratios could not tell apart."""
    mark = b"\xa5" * 64
    for b in parity:
        b[:64] = mark
        b[-64:] = mark
    seen = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal seen
        while not stop.is_set():
            if parity[0][:64] != mark and parity[-1][-64:] == mark:
                seen += 1

    th = threading.Thread(target=watch)
    th.start()
    time.sleep(0.05)
    call()
    stop.set()
    th.join()
    assert parity[0][:64] != mark and parity[-1][-64:] != mark, "the call did not write the parity"
    return seen


def test_encode_runs_without_the_gil() -> None:
    """A Python thread runs during one long ec_encode_data call made through Codec.encode;
    the same C call made with the GIL held (ctypes.PyDLL) never lets it run mid-call."""
    k, m = 16, 48  # many parity rows: one C call of ~0.1 s on 32 MiB
    codec = Codec(k, m)
    data = os.urandom(32 << 20)
    cs = codec.chunk_size(len(data))
    parity = [bytearray(cs) for _ in range(m)]
    codec.encode(data, parity=parity)

    # Control: the very same call through a GIL-holding binding must never be seen mid-call, or the
    # test proves nothing.
    held = ctypes.PyDLL("libisal.so.2").ec_encode_data
    held.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    held.restype = None
    ffi = ec._ffi
    keep = [ffi.from_buffer(b) for b in [data, *parity]]
    srcs = ffi.new("unsigned char *[]", [ffi.cast("unsigned char *", keep[0]) + i * cs for i in range(k)])
    dsts = ffi.new("unsigned char *[]", [ffi.cast("unsigned char *", b) for b in keep[1:]])
    addr = lambda p: int(ffi.cast("uintptr_t", p))
    seen = _seen_mid_call(lambda: held(cs, k, m, addr(codec._enc_tables), addr(srcs), addr(dsts)), parity)
    assert seen == 0, f"control: a Python thread ran {seen} times inside a GIL-holding call"

    results = []
    for _ in range(3):  # the machine is shared: allow a scheduler hiccup, not a held GIL
        results.append(_seen_mid_call(lambda: codec.encode(data, parity=parity), parity))
        if results[-1] > 0:
            break
    else:
        pytest.fail(f"no Python thread ran during encode (looks in 3 calls: {results})")


# -- the benchmark script -------------------------------------------------------------------------------

def test_bench_quick_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ec.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ec.py"), "--quick", "--size-mib", "4",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["size_mib"] == 4
    codes = {(c["k"], c["m"]) for c in res["codes"]}
    assert codes == {(4, 2), (8, 3)}
    for c in res["codes"]:
        assert c["ours"]["encode_gbps"] > 0 and c["ours"]["decode_gbps"] > 0
        assert c["ours"]["verified"] is True
    assert "ours/zfec" in r.stdout or "zfec: unavailable" in r.stdout
