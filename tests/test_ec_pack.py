"""jitckpt.ec.pack: packing, chunk files and placement (with jitckpt.ec for the end-to-end paths)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import stat
import struct
from pathlib import Path

import pytest

from jitckpt.ec.codec import Codec
from jitckpt.ec.pack import (
    CHUNK_HEADER_SIZE,
    ChunkError,
    ChunkTag,
    PackError,
    chunk_name,
    default_code,
    job_key,
    max_node_losses,
    pack_dir,
    placement,
    read_chunk,
    unpack,
    write_chunk,
)


def _make_ckpt(root: Path) -> dict[str, bytes]:
    files = {
        "state.pt": os.urandom(10_001),
        "meta.json": b'{"step": 7}',
        "empty.bin": b"",
        "sub/shard_0.pt": os.urandom(3333),
        "sub/deeper/x": b"x",
    }
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "emptydir").mkdir()
    return files


def _read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# -- pack / unpack --------------------------------------------------------------------------------------

def test_pack_unpack_round_trip_with_modes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    files = _make_ckpt(src)
    buf, manifest = pack_dir(src)
    assert {e["name"]: e["size"] for e in manifest["files"]} == {n: len(d) for n, d in files.items()}
    for e in manifest["files"]:
        assert e["sha256"] == hashlib.sha256(files[e["name"]]).hexdigest()
    dest = tmp_path / "out" / "ckpt"
    got_manifest = unpack(buf, dest)
    assert got_manifest == manifest
    assert _read_tree(dest) == files
    assert (dest / "emptydir").is_dir()
    for p in [dest, *dest.rglob("*")]:
        assert _mode(p) == (0o700 if p.is_dir() else 0o600), p
    assert sorted(x.name for x in dest.parent.iterdir()) == ["ckpt"]  # no temp dir left behind


def test_pack_align_pads_and_still_unpacks(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    files = _make_ckpt(src)
    for align in (1, 3, 8, 11):
        buf, _ = pack_dir(src, align=align)
        assert len(buf) % align == 0
        unpack(buf, tmp_path / f"a{align}")
        assert _read_tree(tmp_path / f"a{align}") == files


def test_unpack_into_existing_empty_dir_but_not_a_full_one(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    files = _make_ckpt(src)
    buf, _ = pack_dir(src)
    (tmp_path / "empty").mkdir()
    unpack(buf, tmp_path / "empty")
    assert _read_tree(tmp_path / "empty") == files
    with pytest.raises(FileExistsError, match="is not an empty directory"):
        unpack(buf, tmp_path / "empty")


def test_empty_checkpoint_dir(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    buf, manifest = pack_dir(tmp_path / "src")
    assert manifest["files"] == [] and manifest["payload_size"] == 0
    unpack(buf, tmp_path / "dst")
    assert list((tmp_path / "dst").iterdir()) == []


@pytest.mark.parametrize("which", ["state.pt", "meta.json", "sub/deeper/x"])
def test_corrupt_payload_is_refused_and_nothing_written(tmp_path: Path, which: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _make_ckpt(src)
    buf, manifest = pack_dir(src)
    e = next(e for e in manifest["files"] if e["name"] == which)
    start = len(buf) - manifest["payload_size"]
    buf[start + e["offset"] + e["size"] // 2] ^= 0x01
    with pytest.raises(PackError, match=rf"sha256 mismatch for 1 file\(s\) \({which}\).*nothing was written"):
        unpack(buf, tmp_path / "out" / "ckpt")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_corrupt_header_manifest_or_truncation_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _make_ckpt(src)
    buf, manifest = pack_dir(src)
    dest = tmp_path / "d"
    cases = []
    b = bytearray(buf)
    b[0] ^= 0xFF
    cases.append((b, "not a packed checkpoint"))
    b = bytearray(buf)
    b[50] ^= 0x01  # inside the manifest JSON
    cases.append((b, "manifest checksum mismatch"))
    cases.append((buf[:-1], "truncated"))
    cases.append((buf[:20], "too short"))
    b = bytearray(buf)
    struct.pack_into("<Q", b, 8, 10**9)
    cases.append((b, "runs past the end"))
    for bad, msg in cases:
        with pytest.raises(PackError, match=msg):
            unpack(bad, dest)
        assert not dest.exists()


def _forge(manifest: dict, payload: bytes) -> bytes:
    mb = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return struct.pack("<8sQ32s", b"JITPACK1", len(mb), hashlib.sha256(mb).digest()) + mb + payload


@pytest.mark.parametrize("name", ["../evil", "/etc/evil", "a/../../evil", "", "a//b", "."])
def test_names_escaping_the_directory_are_refused(tmp_path: Path, name: str) -> None:
    payload = b"pwned"
    m = {"version": 1, "dirs": [], "payload_size": 5,
         "files": [{"name": name, "size": 5, "offset": 0, "sha256": hashlib.sha256(payload).hexdigest()}]}
    with pytest.raises(PackError, match="name"):
        unpack(_forge(m, payload), tmp_path / "d")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "d").exists()


def test_pack_refuses_symlinks(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "real").write_bytes(b"1")
    (src / "link").symlink_to(src / "real")
    with pytest.raises(PackError, match="regular file"):
        pack_dir(src)
    with pytest.raises(PackError, match="not a directory"):
        pack_dir(src / "real")


# -- chunks ---------------------------------------------------------------------------------------------

def _tag(**kw: object) -> ChunkTag:
    base = dict(job="job-1", step=120, rank=3, stripe=0, index=2, k=4, m=2, size=123_456)
    base.update(kw)
    return ChunkTag(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("checksum", ["crc32c", "sha256"])
def test_chunk_round_trip_atomic_and_private(tmp_path: Path, checksum: str) -> None:
    payload = os.urandom(30_000)
    d = tmp_path / "shm" / "chunks"
    p = write_chunk(d, _tag(), payload, checksum=checksum)
    assert p == d / chunk_name(_tag()) and p.name == "job-1.s120.r3.t0.c2.chunk"
    assert _mode(p) == 0o600 and _mode(d) == 0o700
    assert os.listdir(d) == [p.name]  # the temp file was renamed, not left behind
    assert p.stat().st_size == CHUNK_HEADER_SIZE + len(payload)
    tag, got = read_chunk(p, expect_job="job-1", expect=_tag())
    assert tag == _tag() and got == payload
    assert read_chunk(p, expect_job="job-1", step=120, index=2)[1] == payload


def test_chunk_of_another_job_is_rejected(tmp_path: Path) -> None:
    p = write_chunk(tmp_path, _tag(job="old-job"), b"abc")
    with pytest.raises(ChunkError, match="belongs to job 'old-job', not 'job-1'"):
        read_chunk(p, expect_job="job-1")


def test_long_job_ids_are_hashed_and_still_kept_apart(tmp_path: Path) -> None:
    long_a, long_b = "x" * 50 + "A", "x" * 50 + "B"
    assert job_key(long_a) != job_key(long_b) and len(job_key(long_a)) == 40
    assert job_key("slurm-12345") == "slurm-12345"
    assert job_key("a b/c") != "a b/c"  # not a safe file name
    p = write_chunk(tmp_path, _tag(job=long_a), b"abc")
    assert read_chunk(p, expect_job=long_a)[1] == b"abc"
    with pytest.raises(ChunkError, match="belongs to job"):
        read_chunk(p, expect_job=long_b)


@pytest.mark.parametrize("field,value", [("step", 121), ("rank", 0), ("stripe", 1), ("index", 3), ("k", 8),
                                         ("m", 3), ("size", 1)])
def test_wrong_tag_is_rejected(tmp_path: Path, field: str, value: int) -> None:
    p = write_chunk(tmp_path, _tag(), b"payload")
    with pytest.raises(ChunkError, match=rf"chunk tag {field}=.*expected {value}"):
        read_chunk(p, expect_job="job-1", **{field: value})
    with pytest.raises(ChunkError, match=rf"chunk tag {field}="):
        read_chunk(p, expect_job="job-1", expect=_tag(**{field: value}))


@pytest.mark.parametrize("checksum", ["crc32c", "sha256"])
def test_every_single_byte_corruption_of_the_payload_is_detected(tmp_path: Path, checksum: str) -> None:
    payload = os.urandom(257)
    p = write_chunk(tmp_path, _tag(), payload, checksum=checksum)
    raw = p.read_bytes()
    for pos in range(CHUNK_HEADER_SIZE, len(raw)):
        bad = bytearray(raw)
        bad[pos] ^= 1 << (pos % 8)
        p.write_bytes(bad)
        with pytest.raises(ChunkError, match="payload checksum mismatch.*treat it as lost"):
            read_chunk(p, expect_job="job-1")


def test_every_single_byte_corruption_of_the_header_is_detected(tmp_path: Path) -> None:
    p = write_chunk(tmp_path, _tag(), b"some payload")
    raw = p.read_bytes()
    for pos in range(CHUNK_HEADER_SIZE):
        bad = bytearray(raw)
        bad[pos] ^= 0x80
        p.write_bytes(bad)
        with pytest.raises(ChunkError):
            read_chunk(p, expect_job="job-1")


def test_truncated_or_extended_chunk_is_rejected(tmp_path: Path) -> None:
    p = write_chunk(tmp_path, _tag(), b"0123456789")
    raw = p.read_bytes()
    for bad, msg in [(raw[:-1], "truncated or extended"), (raw + b"!", "truncated or extended"),
                     (raw[:10], "too short"), (b"", "too short")]:
        p.write_bytes(bad)
        with pytest.raises(ChunkError, match=msg):
            read_chunk(p, expect_job="job-1")


def test_bad_tags_are_refused_at_write(tmp_path: Path) -> None:
    for kw, msg in [({"job": ""}, "job id"), ({"index": 6}, "index"), ({"k": 0}, "k >= 1"), ({"step": -1}, "step"),
                    ({"rank": 1 << 32}, "rank")]:
        with pytest.raises(ValueError, match=msg):
            write_chunk(tmp_path, _tag(**kw), b"x")
    with pytest.raises(ValueError, match="checksum must be one of"):
        write_chunk(tmp_path, _tag(), b"x", checksum="md5")
    assert list(tmp_path.iterdir()) == []


# -- end to end: directory -> chunks on "nodes" -> losses + corruption -> directory ------------------------

def _load_stripe(paths: list[Path], job: str, k: int, m: int) -> dict[int, bytearray]:
    """What recovery does: a chunk that fails any check is treated as lost."""
    got = {}
    for p in paths:
        if not p.exists():
            continue
        try:
            tag, payload = read_chunk(p, expect_job=job, rank=0, stripe=0, k=k, m=m)
        except ChunkError:
            continue
        got[tag.index] = payload
    return got


@pytest.mark.parametrize("k,m", [(2, 1), (4, 2), (3, 3)])
def test_snapshot_survives_losses_and_corruption(tmp_path: Path, k: int, m: int) -> None:
    src = tmp_path / "src"
    src.mkdir()
    files = _make_ckpt(src)
    buf, _ = pack_dir(src, align=k)
    codec = Codec(k, m)
    chunks = codec.encode(buf)
    nodes = [f"node{i}" for i in range(k + m)]
    where = placement(nodes, k, m)
    paths = [write_chunk(tmp_path / "shm" / where[i], _tag(step=5, rank=0, stripe=0, index=i, k=k, m=m,
                                                             size=len(buf)), chunks[i])
             for i in range(k + m)]
    n_ok = 0
    for lost_n in range(m + 1):
        for lost in itertools.combinations(range(k + m), lost_n):
            for i in lost:
                paths[i].rename(paths[i].with_suffix(".gone"))
            # and corrupt one surviving chunk: it must count as one more loss, never reach decode
            victim = next((i for i in range(k + m) if i not in lost), None)
            raw = paths[victim].read_bytes()
            paths[victim].write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
            have = _load_stripe(paths, "job-1", k, m)
            assert victim not in have
            dest = tmp_path / f"out-{lost_n}-{'_'.join(map(str, lost))}"
            if lost_n + 1 <= m:
                unpack(codec.decode(have, len(buf)), dest)
                assert _read_tree(dest) == files
                n_ok += 1
            else:
                with pytest.raises(ValueError, match="unrecoverable"):
                    codec.decode(have, len(buf))
            paths[victim].write_bytes(raw)
            for i in lost:
                paths[i].with_suffix(".gone").rename(paths[i])
    assert n_ok > 0


def test_a_corrupt_chunk_fed_to_decode_never_becomes_a_checkpoint(tmp_path: Path) -> None:
    """Even if a corrupt chunk got past the chunk checks (CRC-32C misses 1 in 2^32), the per-file sha256
    in unpack refuses the decoded stripe."""
    src = tmp_path / "src"
    src.mkdir()
    _make_ckpt(src)
    buf, _ = pack_dir(src, align=4)
    codec = Codec(4, 2)
    ch = [bytearray(c) for c in codec.encode(buf)]
    ch[4][len(ch[4]) - 7] ^= 0x10  # a parity chunk that rebuilds the lost data chunks 0 and 3
    decoded = codec.decode({i: ch[i] for i in (1, 2, 4, 5)}, len(buf))
    assert decoded != buf
    with pytest.raises(PackError):
        unpack(decoded, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


# -- placement ------------------------------------------------------------------------------------------

def _survives(loads: list[int], k: int, f: int) -> bool:
    total = sum(loads)
    return all(total - sum(loads[i] for i in lost) >= k for lost in itertools.combinations(range(len(loads)), f))


def _compositions(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


SMALL = [(n, k, m) for n in range(1, 7) for k in range(1, 6) for m in range(0, 5)]


@pytest.mark.parametrize("n,k,m", SMALL)
def test_placement_survives_every_loss_pattern_and_is_optimal(n: int, k: int, m: int) -> None:
    nodes = [f"n{i}" for i in range(n)]
    best = max_node_losses(n, k, m)
    cap = -(-(k + m) // n)
    for offset in range(n):
        where = placement(nodes, k, m, tolerate=best, offset=offset)
        assert len(where) == k + m
        loads = [where.count(x) for x in nodes]
        assert max(loads) <= cap
        # brute force: every set of up to `best` lost nodes leaves >= k chunks
        for f in range(best + 1):
            for lost in itertools.combinations(nodes, f):
                assert sum(1 for x in where if x not in lost) >= k, (n, k, m, offset, lost)
    # optimality: no way at all of spreading k+m chunks over n nodes survives best+1 node losses
    if best + 1 <= n:
        assert not any(_survives(list(c), k, best + 1) for c in _compositions(k + m, n)), (n, k, m, best)
        with pytest.raises(ValueError, match=rf"survives at most {best} node loss"):
            placement(nodes, k, m, tolerate=best + 1)


def test_exact_rule_beats_the_per_node_cap_rule() -> None:
    """2+3 on 4 nodes: loads 2,1,1,1 survive any 2 node losses, though 2 > floor(m / f) = 1."""
    assert max_node_losses(4, 2, 3) == 2
    where = placement(["a", "b", "c", "d"], 2, 3, tolerate=2)
    assert sorted(where.count(x) for x in "abcd") == [1, 1, 1, 2]


def test_placement_rotates_with_offset_and_validates() -> None:
    nodes = ["a", "b", "c"]
    assert placement(nodes, 2, 1) == ["a", "b", "c"]
    assert placement(nodes, 2, 1, offset=1) == ["b", "c", "a"]
    with pytest.raises(ValueError, match="duplicates"):
        placement(["a", "a"], 1, 1)
    with pytest.raises(ValueError, match="empty"):
        placement([], 1, 1)
    with pytest.raises(ValueError, match=r"4\+2 on 3 node\(s\) survives at most 1 node loss\(es\), not 2"):
        placement(nodes, 4, 2)


@pytest.mark.parametrize("n", range(1, 25))
def test_default_code_fits_the_node_count(n: int) -> None:
    k, m = default_code(n)
    assert k >= 1 and k + m <= max(n, 1) and k <= 8
    assert max_node_losses(n, k, m) >= min(m, n - 1)
    where = placement([f"n{i}" for i in range(n)], k, m)
    assert len(set(where)) == k + m  # one chunk per node
    if n >= 2:
        assert m >= 1


def test_default_code_examples() -> None:
    assert default_code(3) == (2, 1)
    assert default_code(2) == (1, 1)
    assert default_code(1) == (1, 0)
    assert default_code(16) == (8, 3)
    with pytest.raises(ValueError):
        default_code(0)
