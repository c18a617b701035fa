"""The trailer: version 2 packing, version 1 still read, and ``unpack`` failing only one way."""
from __future__ import annotations

import struct

import google_crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdskv import format as fmt

SK = bytes(range(32))
BK8 = b"\x11" * 8
BK32 = bytes(range(100, 132))


def _v2(**kw) -> fmt.Trailer:
    base = dict(layer_group=3, payload_nbytes=5096, payload_crc=(1 << 63) + 12345, store_key=SK, block_key=BK32,
                parent_key=bytes(range(200, 232)), checksum_algo=fmt.CHECKSUM_POLY)
    base.update(kw)
    return fmt.Trailer(**base)


def test_the_store_format_version_stays_1_while_trailers_are_version_2():
    """The store's FORMAT_VERSION is part of every namespace id: changing it would orphan every chunk."""
    assert fmt.FORMAT_VERSION == 1 and fmt.TRAILER_VERSION == 2 and fmt.TRAILER_VERSIONS == (1, 2)


@pytest.mark.parametrize("t", [
    _v2(),
    _v2(block_key=BK8, parent_key=None, checksum_algo=fmt.CHECKSUM_CRC32C, payload_crc=0xDEADBEEF),
    _v2(store_key=None, mac=b"\x5a" * 32),
    _v2(payload_nbytes=(1 << 32) - 1, layer_group=(1 << 32) - 1),
])
def test_v2_round_trip(t):
    raw = fmt.pack(t)
    assert len(raw) == fmt.TRAILER_BYTES and raw[:8] == fmt.MAGIC
    assert struct.unpack_from("<H", raw, 8)[0] == 2
    back = fmt.unpack(raw)
    assert back == t
    assert back.authenticated == (t.mac is not None)


def test_v2_layout_is_as_documented():
    t = _v2()
    raw = fmt.pack(t)
    magic, version, flags, group, nbytes, own, pcs = struct.unpack_from("<8sHHIIIQ", raw)
    assert (magic, version, group, nbytes, pcs) == (fmt.MAGIC, 2, 3, 5096, t.payload_crc)
    assert flags == (32 << 8) | 1 | (fmt.CHECKSUM_POLY << 1)
    assert own == google_crc32c.value(raw[:20] + bytes(4) + raw[24:])
    assert raw[32:64] == SK and raw[64:96] == BK32 and raw[96:128] == t.parent_key
    mac = fmt.pack(_v2(store_key=None, mac=b"\x5a" * 32))
    assert struct.unpack_from("<H", mac, 10)[0] & fmt.FLAG_AUTHENTICATED and mac[32:64] == b"\x5a" * 32


def test_v1_chunks_still_read():
    t = fmt.Trailer(1, 4096, 0xCAFEBABE, SK, BK8, b"\x22" * 8, fmt.CHECKSUM_WEIGHTED, version=1)
    raw = fmt.pack(t)
    magic, version, flags, group, nbytes, pcrc, own = struct.unpack_from("<8sHHIQII", raw)
    assert (version, nbytes, pcrc) == (1, 4096, 0xCAFEBABE)
    assert fmt.unpack(raw) == t


@pytest.mark.parametrize("t, why", [
    (_v2(payload_nbytes=1 << 32), "too large"),
    (_v2(checksum_algo=fmt.CHECKSUM_WEIGHTED), "does not carry"),
    (_v2(payload_crc=1 << 64), "64 bits"),
    (_v2(block_key=b"x" * 16, parent_key=None), "8 or 32"),
    (_v2(parent_key=BK8), "parent"),
    (_v2(store_key=b"short"), "store key"),
    (_v2(version=1, checksum_algo=fmt.CHECKSUM_POLY), "does not carry"),
    (_v2(version=1, checksum_algo=fmt.CHECKSUM_CRC32C, payload_crc=1, store_key=None, mac=b"m" * 32), "version 1"),
    (_v2(version=3), "version 3"),
])
def test_pack_refuses_what_it_cannot_write(t, why):
    with pytest.raises(ValueError, match=why):
        fmt.pack(t)


@pytest.mark.parametrize("block_key, parent_key", [(BK8, None), (BK8, b"p" * 8), (b"k" * 32, None), (b"k" * 32, b"p" * 32)])
def test_an_unsealed_trailer_is_the_packed_one_but_for_its_checksums(block_key, parent_key):
    """What the native writer seals (``pack_unsealed_into``) is ``pack``'s trailer but for its two
    checksums, and sealed as the writer seals it (payload CRC at 24, own CRC at 20) it is ``pack``'s."""
    buf = bytearray(b"\xee" * 3 * fmt.TRAILER_BYTES)
    fmt.pack_unsealed_into(buf, fmt.TRAILER_BYTES, 7, 262144, SK, block_key, parent_key)
    got = bytes(buf[fmt.TRAILER_BYTES:2 * fmt.TRAILER_BYTES])
    assert buf[:fmt.TRAILER_BYTES] == buf[2 * fmt.TRAILER_BYTES:] == b"\xee" * fmt.TRAILER_BYTES
    packed = fmt.pack(fmt.Trailer(7, 262144, 0, SK, block_key, parent_key, fmt.CHECKSUM_CRC32C))
    assert got == packed[:20] + bytes(4) + packed[24:]
    sealed = got[:24] + struct.pack("<Q", 0x1234ABCD) + got[32:]
    sealed = sealed[:20] + struct.pack("<I", google_crc32c.value(sealed)) + sealed[24:]
    assert sealed == fmt.pack(fmt.Trailer(7, 262144, 0x1234ABCD, SK, block_key, parent_key, fmt.CHECKSUM_CRC32C))


@pytest.mark.parametrize("fields", [
    (0, 1 << 32, SK, BK8, None), (1 << 32, 10, SK, BK8, None), (0, 10, SK, b"x" * 16, None),
    (0, 10, SK, BK8, b"p" * 32), (0, 10, b"short", BK8, None),
])
def test_pack_unsealed_refuses_what_pack_refuses(fields):
    with pytest.raises(ValueError, match="trailer"):
        fmt.pack_unsealed_into(bytearray(fmt.TRAILER_BYTES), 0, *fields)


def _refix(raw: bytes) -> bytes:
    """Recompute a mutated trailer's own CRC where its version says it lives, so mutations reach
    the checks behind the CRC."""
    version = struct.unpack_from("<H", raw, 8)[0]
    at = {1: 28, 2: 20}.get(version)
    if at is None:
        return raw
    zeroed = raw[:at] + bytes(4) + raw[at + 4:]
    return raw[:at] + struct.pack("<I", google_crc32c.value(zeroed)) + raw[at + 4:]


VALID = [fmt.pack(_v2()), fmt.pack(_v2(store_key=None, mac=b"\x01" * 32, parent_key=None, block_key=BK8)),
         fmt.pack(fmt.Trailer(0, 10, 5, SK, BK8, None, fmt.CHECKSUM_WEIGHTED, version=1))]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.binary(min_size=0, max_size=160),
    st.binary(min_size=120, max_size=120).map(lambda b: fmt.MAGIC + b),
    st.tuples(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 127), st.integers(0, 255)), max_size=6),
              st.booleans()).map(lambda a: (a[0], a[1], a[2])),
))
def test_unpack_raises_only_chunk_format_error(case):
    """Whatever the 128 bytes are — random, or a valid trailer with bytes changed (and its own CRC
    fixed up so the deeper checks run) — ``unpack`` returns a Trailer or raises ChunkFormatError."""
    if isinstance(case, tuple):
        base, edits, fix = case
        raw = bytearray(base)
        for pos, val in edits:
            raw[pos] = val
        raw = _refix(bytes(raw)) if fix else bytes(raw)
    else:
        raw = case
    try:
        t = fmt.unpack(raw)
    except fmt.ChunkFormatError:
        return
    assert isinstance(t, fmt.Trailer)
    assert fmt.unpack(fmt.pack(t)) == t  # whatever parses also packs back to something equal


def test_unpack_names_what_is_wrong():
    good = fmt.pack(_v2())
    with pytest.raises(fmt.ChunkFormatError, match="trailer version 9"):
        fmt.unpack(_refix(good[:8] + struct.pack("<H", 9) + good[10:]))
    with pytest.raises(fmt.ChunkFormatError, match="trailer checksum"):
        fmt.unpack(good[:40] + bytes([good[40] ^ 1]) + good[41:])
    flags = struct.unpack_from("<H", good, 10)[0]
    with pytest.raises(fmt.ChunkFormatError, match="reserved flag"):
        fmt.unpack(_refix(good[:10] + struct.pack("<H", flags | 0x20) + good[12:]))
    with pytest.raises(fmt.ChunkFormatError, match="algorithm 1"):  # v2 never carries the weak sum
        fmt.unpack(_refix(good[:10] + struct.pack("<H", (flags & ~0b1110) | (1 << 1)) + good[12:]))
    with pytest.raises(fmt.ChunkFormatError, match="padding"):
        short = fmt.pack(_v2(block_key=BK8, parent_key=None))
        fmt.unpack(_refix(short[:80] + b"\x01" + short[81:]))
    with pytest.raises(fmt.ChunkFormatError, match="127 bytes"):
        fmt.unpack(good[:127])
