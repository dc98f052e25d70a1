"""Systematic Reed-Solomon erasure coding over GF(2^8) through Intel ISA-L.

A stripe of ``size`` bytes is cut into ``k`` data chunks of ``chunk_size(size)``
bytes (the last one zero-padded) and ``m`` parity chunks of the same size; any
``k`` of the ``k + m`` chunks give the stripe back. The generator matrix is ISA-L's
Cauchy matrix (identity on top), so every k x k submatrix is invertible: any
``m`` losses are decodable, whatever ``k`` and ``m`` (which is not true of ISA-L's
Vandermonde ``gf_gen_rs_matrix`` beyond small sizes).

ISA-L is bound with cffi in ABI mode (``dlopen`` of Debian's ``libisal.so.2``), so
nothing is compiled at install time. cffi drops the GIL around every C call, so an
encode of a large snapshot in a background thread does not stall training's Python
thread (``tests/test_ec_codec.py`` proves it).
"""

from __future__ import annotations

import ctypes.util
import mmap
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import cffi

__all__ = ["Codec", "IsalUnavailable", "crc32c", "MAX_CHUNKS"]

# GF(2^8) has 256 elements; ISA-L's Cauchy rows use 1/(i ^ j) with i < k + m, and
# row/column indices are bytes, so a stripe has at most 255 chunks.
MAX_CHUNKS = 255

# ec_encode_data and crc32_iscsi take an ``int`` length: larger buffers go in
# segments (byte positions are independent, so segmenting changes nothing).
_SEGMENT = 1 << 30

_CDEF = """
void gf_gen_cauchy1_matrix(unsigned char *a, int m, int k);
int gf_invert_matrix(unsigned char *in, unsigned char *out, const int n);
void ec_init_tables(int k, int rows, unsigned char *a, unsigned char *gftbls);
void ec_encode_data(int len, int k, int rows, unsigned char *gftbls, unsigned char **data,
                    unsigned char **coding);
unsigned int crc32_iscsi(unsigned char *buffer, int len, unsigned int init_crc);
"""

_INSTALL_HINT = ("install Intel ISA-L: `apt-get install -y libisal2` (or `libisal-dev`), "
                 "or run `make setup`, which installs it")


class IsalUnavailable(ImportError):
    """libisal.so.2 could not be loaded; the message says how to install it."""


_ffi = cffi.FFI()
_ffi.cdef(_CDEF)
_lib = None
_lib_lock = threading.Lock()


def _load_isal(names: Sequence[str] | None = None):
    """Open ISA-L (cached for the default names); raise IsalUnavailable with the fix."""
    global _lib
    if names is None and _lib is not None:
        return _lib
    candidates = list(names) if names is not None else ["libisal.so.2", ctypes.util.find_library("isal")]
    errors = []
    for name in candidates:
        if not name:
            continue
        try:
            lib = _ffi.dlopen(name)
            # Resolve every symbol now so a stale or foreign library fails here, clearly.
            for sym in ("gf_gen_cauchy1_matrix", "gf_invert_matrix", "ec_init_tables", "ec_encode_data",
                        "crc32_iscsi"):
                getattr(lib, sym)
        except (OSError, AttributeError) as e:
            errors.append(f"{name}: {e}")
            continue
        if names is None:
            with _lib_lock:
                _lib = lib
        return lib
    raise IsalUnavailable(f"jitckpt.ec: cannot load Intel ISA-L ({'; '.join(errors) or 'no candidate library'}); "
                          f"{_INSTALL_HINT}")


# Below this, a bytearray is cheaper than an mmap system call.
_POPULATE_MIN = 1 << 20


def _zeroed(n: int) -> memoryview:
    """A fresh zeroed buffer. Large ones are mmapped with MAP_POPULATE: on this VM faulting pages in one
    by one runs at ~1.2 GB/s, prefaulting them in one call at ~2 GB/s, and either costs more than the
    encode itself (reuse buffers through ``parity=`` in steady state)."""
    flags = getattr(mmap, "MAP_POPULATE", 0)
    if n >= _POPULATE_MIN and flags:
        return memoryview(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags))
    return memoryview(bytearray(n))


def _ptr(buf, writable: bool = False):
    """A ``unsigned char *`` on a bytes-like object without copying it."""
    return _ffi.cast("unsigned char *", _ffi.from_buffer(buf, require_writable=writable))


def _as_bytes_view(data, what: str) -> memoryview:
    """A flat unsigned-byte view of ``data``; refuses non-contiguous buffers rather than copying them."""
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(f"{what} must be a bytes-like object (bytes, bytearray, memoryview, numpy array), "
                        f"not {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous; pass a contiguous buffer (e.g. bytes(x) or x.copy())")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def crc32c(data, value: int = 0) -> int:
    """CRC-32C (Castagnoli, as iSCSI/ext4) of ``data`` through ISA-L (~9 GB/s here, vs ~1 GB/s for
    zlib.crc32 and ~0.8 GB/s for sha256); chain calls by passing the previous result as ``value``."""
    lib = _load_isal()
    mv = _as_bytes_view(data, "crc32c data")
    crc = (value ^ 0xFFFFFFFF) & 0xFFFFFFFF
    if len(mv) == 0:
        return value & 0xFFFFFFFF
    base = _ptr(mv)
    for off in range(0, len(mv), _SEGMENT):
        crc = lib.crc32_iscsi(base + off, min(_SEGMENT, len(mv) - off), crc)
    return crc ^ 0xFFFFFFFF


def _check_int(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name}={v} is out of range [{lo}, {hi}]")
    return v


class Codec:
    """Reed-Solomon code with ``k`` data and ``m`` parity chunks (k >= 1, m >= 0, k + m <= 255).

    Thread-safe: encode and decode may run concurrently from several threads.
    """

    # Decode tables per erasure pattern; bounded because C(k+m, k) patterns can be huge.
    DECODE_CACHE_SIZE = 256

    def __init__(self, k: int, m: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"Codec(k, m) takes ints, got k={k!r}, m={m!r}")
        if k < 1 or m < 0 or k + m > MAX_CHUNKS:
            raise ValueError(f"Codec(k={k}, m={m}): need k >= 1, m >= 0 and k + m <= {MAX_CHUNKS} "
                             f"(Reed-Solomon over GF(2^8) has at most {MAX_CHUNKS} chunks per stripe); "
                             "pick e.g. k=4, m=2")
        self._lib = _load_isal()
        self.k, self.m = k, m
        n = k + m
        self._matrix = _ffi.new("unsigned char[]", n * k)
        self._lib.gf_gen_cauchy1_matrix(self._matrix, n, k)
        # Parity rows only: the top k x k is the identity (systematic code).
        self._enc_tables = _ffi.new("unsigned char[]", max(1, 32 * k * m))
        if m:
            self._lib.ec_init_tables(k, m, self._matrix + k * k, self._enc_tables)
        self._decode_cache: OrderedDict[tuple[int, ...], object] = OrderedDict()
        self._cache_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Codec(k={self.k}, m={self.m})"

    @property
    def n(self) -> int:
        """Chunks per stripe (k + m)."""
        return self.k + self.m

    def chunk_size(self, size: int) -> int:
        """Bytes per chunk for a stripe of ``size`` bytes: ceil(size / k)."""
        _check_int("size", size, 0, 1 << 62)
        return -(-size // self.k)

    def matrix(self) -> bytes:
        """The (k+m) x k generator matrix, row-major (for tests and tooling)."""
        return bytes(_ffi.buffer(self._matrix, self.n * self.k))

    # -- encode ----------------------------------------------------------------

    def encode(self, data, parity: Sequence | None = None) -> list[memoryview]:
        """Cut ``data`` into k data chunks and compute m parity chunks; returns k + m equal-size memoryviews.

        Data chunks are views into ``data`` (keep it unchanged while they are in use), except a zero-padded
        copy of the tail when ``len(data)`` is not a multiple of k (``ec_pack.pack_dir(align=k)`` avoids it).
        ``parity``: m writable buffers of at least ``chunk_size(len(data))`` bytes to reuse across calls;
        faulting in fresh memory costs more than the encode itself here (~1 GB/s vs ~10 GB/s).
        """
        src = _as_bytes_view(data, "encode data")
        size = len(src)
        k, m = self.k, self.m
        csize = -(-size // k)
        chunks: list[memoryview] = []
        for i in range(k):
            lo, hi = i * csize, (i + 1) * csize
            if hi <= size:
                chunks.append(src[lo:hi])
            else:
                pad = _zeroed(csize)
                if lo < size:
                    pad[: size - lo] = src[lo:size]
                chunks.append(pad)
        if parity is None:
            outs = [_zeroed(csize) for _ in range(m)]
        else:
            if len(parity) != m:
                raise ValueError(f"{self}: parity= takes m={m} buffers, got {len(parity)}")
            outs = []
            for j, buf in enumerate(parity):
                v = _as_bytes_view(buf, f"parity buffer {j}")
                if v.readonly or len(v) < csize:
                    raise ValueError(f"{self}: parity buffer {j} must be writable and hold at least {csize} bytes "
                                     f"(chunk_size({size})); it has {len(v)} bytes"
                                     + (" and is read-only" if v.readonly else ""))
                outs.append(v[:csize])
        chunks.extend(outs)
        if m and csize:
            self._run(self._enc_tables, chunks[:k], outs, csize)
        return chunks

    def _run(self, tables, srcs: Sequence, dests: Sequence, length: int) -> None:
        """dests[j] = sum_i table[j][i] * srcs[i] over GF(2^8), in segments of at most 1 GiB."""
        k, rows = len(srcs), len(dests)
        # Keep the from_buffer objects alive for the duration of the C calls.
        src_bufs = [_ffi.from_buffer(s) for s in srcs]
        dst_bufs = [_ffi.from_buffer(d, require_writable=True) for d in dests]
        src_base = [_ffi.cast("unsigned char *", b) for b in src_bufs]
        dst_base = [_ffi.cast("unsigned char *", b) for b in dst_bufs]
        sp = _ffi.new("unsigned char *[]", k)
        dp = _ffi.new("unsigned char *[]", rows)
        for off in range(0, length, _SEGMENT):
            seg = min(_SEGMENT, length - off)
            for i in range(k):
                sp[i] = src_base[i] + off
            for j in range(rows):
                dp[j] = dst_base[j] + off
            self._lib.ec_encode_data(seg, k, rows, tables, sp, dp)

    # -- decode ----------------------------------------------------------------

    def decode(self, chunks: Mapping[int, object], size: int, out=None) -> bytearray | memoryview:
        """Rebuild the ``size``-byte stripe from any k of its chunks (``{index: chunk}``, index 0..k+m-1).

        Returns a bytearray (bytes-like, equal to the original bytes) so the result is not copied once more;
        with ``out`` (a writable buffer of at least k * chunk_size(size) bytes, reused to avoid faulting in
        fresh memory) the stripe is written there and a memoryview of its first ``size`` bytes is returned.
        """
        k, n = self.k, self.n
        _check_int("size", size, 0, 1 << 62)
        csize = -(-size // k)
        if not isinstance(chunks, Mapping):
            raise TypeError(f"decode takes a mapping {{chunk index: chunk}}, not {type(chunks).__name__}")
        views: dict[int, memoryview] = {}
        for idx, c in chunks.items():
            if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
                raise ValueError(f"{self}: chunk index {idx!r} is invalid; indices run 0..{n - 1} "
                                 f"(0..{k - 1} data, {k}..{n - 1} parity)")
            if c is None:
                continue
            v = _as_bytes_view(c, f"chunk {idx}")
            if len(v) != csize:
                raise ValueError(f"{self}: chunk {idx} has {len(v)} bytes but a stripe of size={size} has "
                                 f"chunks of ceil({size}/{k}) = {csize} bytes; the chunks come from different "
                                 "stripes or the size argument is wrong")
            views[idx] = v
        if len(views) < k:
            raise ValueError(f"{self}: cannot decode: {len(views)} chunk(s) present (indices {sorted(views)}), "
                             f"at least k={k} of the {n} are needed; more than m={self.m} chunks of this stripe "
                             "are lost, so it is unrecoverable: fall back to an older snapshot or a persistent "
                             "checkpoint")
        if out is None:
            result = bytearray(k * csize)
            omv = memoryview(result)
        else:
            omv = _as_bytes_view(out, "decode out")
            if omv.readonly or len(omv) < k * csize:
                raise ValueError(f"{self}: out= must be writable and hold at least k * chunk_size = {k * csize} "
                                 f"bytes; it has {len(omv)} bytes" + (" and is read-only" if omv.readonly else ""))
        if csize == 0:
            return bytearray() if out is None else omv[:0]
        missing = [i for i in range(k) if i not in views]
        for i in range(k):
            if i in views:
                omv[i * csize:(i + 1) * csize] = views[i]
        if missing:
            # Every present data chunk plus the first parity chunks: only the missing rows need decoding.
            chosen = tuple([i for i in range(k) if i in views] + sorted(i for i in views if i >= k)[: len(missing)])
            tables = self._decode_tables(chosen)
            self._run(tables, [views[i] for i in chosen], [omv[i * csize:(i + 1) * csize] for i in missing], csize)
        if out is not None:
            return omv[:size]
        # Views on ``result`` pin its size; drop them before trimming the padding.
        omv.release()
        del result[size:]
        return result

    def _decode_tables(self, chosen: tuple[int, ...]):
        """ec_init_tables for rebuilding the missing data chunks from the chunks ``chosen`` (cached)."""
        with self._cache_lock:
            t = self._decode_cache.get(chosen)
            if t is not None:
                self._decode_cache.move_to_end(chosen)
                return t
        k = self.k
        sub = _ffi.new("unsigned char[]", k * k)
        for r, idx in enumerate(chosen):
            _ffi.memmove(sub + r * k, self._matrix + idx * k, k)
        inv = _ffi.new("unsigned char[]", k * k)
        if self._lib.gf_invert_matrix(sub, inv, k) != 0:
            # Cannot happen for a Cauchy code; kept so a broken library cannot produce silent garbage.
            raise RuntimeError(f"{self}: decode matrix for chunks {list(chosen)} is singular (ISA-L bug?)")
        missing = [i for i in range(k) if i not in chosen]
        # Row d of inv maps the chosen chunks back to data chunk d.
        rows = _ffi.new("unsigned char[]", len(missing) * k)
        for r, d in enumerate(missing):
            _ffi.memmove(rows + r * k, inv + d * k, k)
        tables = _ffi.new("unsigned char[]", 32 * k * len(missing))
        self._lib.ec_init_tables(k, len(missing), rows, tables)
        with self._cache_lock:
            self._decode_cache[chosen] = tables
            while len(self._decode_cache) > self.DECODE_CACHE_SIZE:
                self._decode_cache.popitem(last=False)
        return tables
