"""The on-disk chunk format: pure functions, no I/O. FORMAT.md is the prose version.

A chunk file is ``payload || trailer``. The payload is the page's bytes (its regions
concatenated in region order) and starts at offset 0, so it can be read straight into page
memory with aligned offsets. The 128-byte little-endian trailer is:

====== ==== ===============================================================
offset size field
====== ==== ===============================================================
0      8    magic ``b"GDSKVPG1"``
8      2    format version (``FORMAT_VERSION``)
10     2    flags: bit 0 has-parent; bits 1..3 payload checksum algorithm; bits 8..15 block key length (8 or 32)
12     4    layer group id
16     8    payload length in bytes
24     4    checksum of the payload (CRC32C, or for pages saved from device memory the
            position-weighted sum of ``weighted_checksum``)
28     4    CRC32C of the trailer with this field zeroed
32     32   store key (namespace + group + block key, ``gdskv.keys.store_key``)
64     32   block key, zero-padded to 32 bytes
96     32   parent block key, zero-padded (all zero when there is none)
====== ==== ===============================================================

A chunk's *index* in its Zarr array comes from the store key's leading 62 bits: ``hi`` (12 bits)
and ``lo`` (50 bits); the chunk of array coordinates ``(hi, :, lo)`` is the file
``c/<hi>/0/<lo>`` under the array (Zarr v3 default chunk key encoding).
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import google_crc32c

MAGIC = b"GDSKVPG1"
FORMAT_VERSION = 1
TRAILER_BYTES = 128
HI_BITS = 12
LO_BITS = 50
_HEAD = struct.Struct("<8sHHIQII")  # 32 bytes
FLAG_HAS_PARENT = 1
CHECKSUM_CRC32C = 0
CHECKSUM_WEIGHTED = 1
"""Computed where the page is (on the GPU for device pages), so no page crosses to the host to be checksummed."""
_ALGO_SHIFT, _ALGO_MASK = 1, 0b111
WEIGHT_MODULUS = 65521
TMP_MARK = ".tmp."


class ChunkFormatError(ValueError):
    """A trailer that does not describe the chunk it was asked about (the reason is the message)."""


@dataclass(frozen=True)
class Trailer:
    layer_group: int
    payload_nbytes: int
    payload_crc: int
    store_key: bytes
    block_key: bytes
    parent_key: Optional[bytes] = None
    checksum_algo: int = CHECKSUM_CRC32C


def _load_libcrc32c() -> Optional[ctypes.CDLL]:
    """google-crc32c's bundled C library, called directly: zero-copy on any buffer, and ctypes
    drops the GIL for the call, so several transfer threads checksum in parallel. (The Python
    binding only takes ``bytes``, which would cost a copy of every page.)"""
    libs = Path(google_crc32c.__file__).parent.parent / "google_crc32c.libs"
    for cand in sorted(libs.glob("libcrc32c*.so*")) if libs.is_dir() else []:
        try:
            lib = ctypes.CDLL(str(cand))
            lib.crc32c_extend.restype = ctypes.c_uint32
            lib.crc32c_extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
            return lib
        except OSError:
            continue
    return None


_LIB = _load_libcrc32c()


def crc32c_at(address: int, nbytes: int, value: int = 0) -> int:
    """CRC32C of ``nbytes`` of host memory at ``address``, continuing from ``value``."""
    if _LIB is not None:
        return _LIB.crc32c_extend(value, address, nbytes)
    return google_crc32c.extend(value, ctypes.string_at(address, nbytes))


def crc32c(data, value: int = 0) -> int:
    """CRC32C of a buffer-protocol object, continuing from ``value``."""
    view = memoryview(data).cast("B")
    if _LIB is None or view.readonly:
        return google_crc32c.extend(value, bytes(view))
    buf = (ctypes.c_char * view.nbytes).from_buffer(view)
    return _LIB.crc32c_extend(value, ctypes.addressof(buf), view.nbytes)


def pack(t: Trailer) -> bytes:
    key_len = len(t.block_key)
    flags = (key_len << 8) | (FLAG_HAS_PARENT if t.parent_key is not None else 0) | (t.checksum_algo << _ALGO_SHIFT)
    body = (
        t.store_key
        + t.block_key.ljust(32, b"\0")
        + (t.parent_key or b"").ljust(32, b"\0")
    )
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, flags, t.layer_group, t.payload_nbytes, t.payload_crc, 0)
    own = google_crc32c.value(head + body)
    return _HEAD.pack(MAGIC, FORMAT_VERSION, flags, t.layer_group, t.payload_nbytes, t.payload_crc, own) + body


def unpack(raw: bytes) -> Trailer:
    """Parse and self-check a trailer; raises ``ChunkFormatError`` saying what is wrong."""
    if len(raw) != TRAILER_BYTES:
        raise ChunkFormatError(f"trailer is {len(raw)} bytes, expected {TRAILER_BYTES}")
    magic, version, flags, group, nbytes, pcrc, own = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise ChunkFormatError("bad magic (not a gdskv chunk, or torn)")
    if version != FORMAT_VERSION:
        raise ChunkFormatError(f"format version {version}, this gdskv reads {FORMAT_VERSION}")
    zeroed = _HEAD.pack(magic, version, flags, group, nbytes, pcrc, 0) + raw[_HEAD.size:]
    if google_crc32c.value(zeroed) != own:
        raise ChunkFormatError("trailer checksum mismatch")
    key_len = flags >> 8
    if key_len not in (8, 32):
        raise ChunkFormatError(f"bad block key length {key_len}")
    parent_len = key_len if flags & FLAG_HAS_PARENT else 0
    algo = (flags >> _ALGO_SHIFT) & _ALGO_MASK
    if algo not in (CHECKSUM_CRC32C, CHECKSUM_WEIGHTED):
        raise ChunkFormatError(f"unknown payload checksum algorithm {algo}")
    return Trailer(
        layer_group=group,
        payload_nbytes=nbytes,
        payload_crc=pcrc,
        store_key=raw[32:64],
        block_key=raw[64:64 + key_len],
        parent_key=raw[96:96 + parent_len] if parent_len else None,
        checksum_algo=algo,
    )


def fold_weighted(byte_sum: int, weighted_sum: int, nbytes: int) -> int:
    """The 32-bit ``CHECKSUM_WEIGHTED`` value from its two sums (see ``weighted_checksum``)."""
    return (byte_sum * 0x9E3779B1 + weighted_sum * 0x85EBCA77 + nbytes) & 0xFFFFFFFF


def weighted_checksum(data) -> int:
    """``CHECKSUM_WEIGHTED`` of host bytes: ``a = Σ x_i``, ``b = Σ (i mod 65521 + 1)·x_i`` over the
    payload's bytes, folded to 32 bits. ``gdskv.transfer`` computes the same with torch on the
    page's own device; this is the host form (verify, tests)."""
    import numpy as np

    x = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    a = b = 0
    step = 1 << 22
    for off in range(0, x.size, step):
        part = x[off:off + step].astype(np.int64)
        pos = np.arange(off, off + part.size, dtype=np.int64) % WEIGHT_MODULUS + 1
        a += int(part.sum())
        b += int((part * pos).sum())
    return fold_weighted(a, b, x.size)


def payload_checksum(algo: int, data) -> int:
    """The payload checksum of host bytes under the trailer's algorithm."""
    return crc32c(data) if algo == CHECKSUM_CRC32C else weighted_checksum(data)


def chunk_index(store_key: bytes) -> tuple[int, int]:
    """``(hi, lo)``: the chunk's coordinates in its array (``arr[hi, :, lo]``)."""
    lead = int.from_bytes(store_key[:8], "big") >> (64 - HI_BITS - LO_BITS)
    return lead >> LO_BITS, lead & ((1 << LO_BITS) - 1)


def chunk_relpath(store_key: bytes) -> str:
    """Path of the chunk file relative to its array directory."""
    return index_relpath(*chunk_index(store_key))


def index_relpath(hi: int, lo: int) -> str:
    """Path, relative to its array directory, of the chunk at ``(hi, :, lo)``."""
    return f"c/{hi}/0/{lo}"


def array_shape(bytes_per_page: int) -> tuple[int, int, int]:
    return (1 << HI_BITS, bytes_per_page + TRAILER_BYTES, 1 << LO_BITS)


def is_temp_name(name: str) -> bool:
    return TMP_MARK in name
