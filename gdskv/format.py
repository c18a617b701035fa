"""The on-disk chunk format: pure functions, no I/O. FORMAT.md is the prose version.

A chunk file is ``payload || trailer``. The payload is the page's bytes (its regions
concatenated in region order) and starts at offset 0, so it can be read straight into page
memory with aligned offsets. The trailer is 128 bytes, little-endian. Writers write trailer
version 2; readers accept versions 1 and 2 (``unpack``).

Trailer version 2 (written since the two-residue device checksum):

====== ==== ===============================================================
offset size field
====== ==== ===============================================================
0      8    magic ``b"GDSKVPG1"``
8      2    trailer version (2)
10     2    flags: bit 0 has-parent; bits 1..3 payload checksum algorithm (``CHECKSUM_*``);
            bit 4 authenticated (the store key field holds a MAC); bits 5..7 zero;
            bits 8..15 block key length (8 or 32)
12     4    layer group id
16     4    payload length in bytes (pages are < 4 GiB)
20     4    CRC32C of the trailer with this field zeroed
24     8    payload checksum (CRC32C zero-extended, or ``CHECKSUM_POLY``'s 64-bit value)
32     32   store key (``gdskv.keys.store_key``), or the 32-byte MAC when authenticated
64     32   block key, zero-padded to 32 bytes
96     32   parent block key, zero-padded (all zero when there is none)
====== ==== ===============================================================

Trailer version 1 (read only): offsets 0..15 as above but with a u64 payload length at 16, a
u32 payload checksum at 24 (CRC32C, or the legacy ``CHECKSUM_WEIGHTED`` sum) and the u32 trailer
CRC32C at 28; no authenticated flag. The store/namespace ``FORMAT_VERSION`` (part of every
namespace id and of the store root's attribute) is unchanged by the trailer version.

The payload checksums, the MAC and the functions that write and check a chunk's trailer
(``seal`` / ``check``) are in ``gdskv.checksum``; this module only packs and parses.

A chunk's *index* in its Zarr array comes from the store key's leading 62 bits: ``hi`` (12 bits)
and ``lo`` (50 bits); the chunk of array coordinates ``(hi, :, lo)`` is the file
``c/<hi>/0/<lo>`` under the array (Zarr v3 default chunk key encoding).
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import google_crc32c

Buffer = Any
"""Host bytes: any object with the buffer protocol (bytes, bytearray, memoryview, a numpy array);
``collections.abc.Buffer`` from Python 3.12."""

MAGIC = b"GDSKVPG1"
FORMAT_VERSION = 1
"""The store's format version (namespace ids, the store root's attribute). Not the trailer's."""
TRAILER_VERSION = 2
"""The trailer version writers write."""
TRAILER_VERSIONS = (1, 2)
"""The trailer versions readers accept."""
TRAILER_BYTES = 128
HI_BITS = 12
LO_BITS = 50
_HEAD_V1 = struct.Struct("<8sHHIQII")  # 32 bytes: magic, version, flags, group, length u64, payload crc u32, own crc
_HEAD_V2 = struct.Struct("<8sHHIIIQ")  # 32 bytes: magic, version, flags, group, length u32, own crc, payload checksum u64
_PEEK = struct.Struct("<8sH")
FLAG_HAS_PARENT = 1
FLAG_AUTHENTICATED = 1 << 4
_FLAGS_RESERVED = 0b1110_0000
CHECKSUM_CRC32C = 0
"""CRC32C (Castagnoli) of the payload; in a v2 trailer zero-extended to 64 bits."""
CHECKSUM_WEIGHTED = 1
"""Legacy (v1 only, never written now): a position-weighted byte sum mod 65521 folded to 32 bits.
It misses e.g. a (+1, -2, +1) change of three consecutive bytes, so readers treat chunks that
carry it as unverifiable ("weak-checksum")."""
CHECKSUM_POLY = 2
"""Two polynomial hashes of the payload's bytes mod 2**31 - 1 (``gdskv.checksum.poly_hash``),
computed with torch on the page's own device: no page crosses to the host to be checksummed."""
_ALGO_SHIFT, _ALGO_MASK = 1, 0b111
_ALGOS = {1: (CHECKSUM_CRC32C, CHECKSUM_WEIGHTED), 2: (CHECKSUM_CRC32C, CHECKSUM_POLY)}
MAX_PAYLOAD_V2 = (1 << 32) - 1
WEIGHT_MODULUS = 65521
TMP_MARK = ".tmp."


class ChunkFormatError(ValueError):
    """A trailer that does not describe the chunk it was asked about (the reason is the message)."""


@dataclass(frozen=True)
class Trailer:
    """A parsed trailer. ``payload_crc`` is the payload checksum under ``checksum_algo`` (32 bits
    in v1, up to 64 in v2). An authenticated trailer (``mac`` set) stores the MAC where the store
    key was, so ``store_key`` is None after ``unpack``: every reader recomputes the store key
    from its namespace, the group and the block key, and the MAC covers it."""

    layer_group: int
    payload_nbytes: int
    payload_crc: int
    store_key: Optional[bytes]
    block_key: bytes
    parent_key: Optional[bytes] = None
    checksum_algo: int = CHECKSUM_CRC32C
    mac: Optional[bytes] = None
    version: int = TRAILER_VERSION

    @property
    def authenticated(self) -> bool:
        return self.mac is not None

    @property
    def flags(self) -> int:
        """The flags field this trailer is packed with."""
        return ((len(self.block_key) << 8) | (FLAG_HAS_PARENT if self.parent_key is not None else 0)
                | (self.checksum_algo << _ALGO_SHIFT) | (FLAG_AUTHENTICATED if self.mac is not None else 0))


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


def _load_fast() -> Optional[ModuleType]:
    """``gdskv._crc32c`` where it built and this CPU runs one of its kernels, else None."""
    try:
        from gdskv import _crc32c
    except ImportError:
        return None
    return _crc32c if _crc32c.address() else None


_LIB = _load_libcrc32c()
_FAST = _load_fast()


def crc32c_address() -> int:
    """The address of a C function ``uint32_t (uint32_t value, const void *, size_t)`` computing
    what ``crc32c_at`` does (``gdskv._crc32c``'s kernel, else google-crc32c's
    ``crc32c_extend``), 0 where neither loaded: ``gdskv.io.batch`` hands it to the compiled batch
    path."""
    if _FAST is not None:
        return _FAST.address()
    return 0 if _LIB is None else ctypes.cast(_LIB.crc32c_extend, ctypes.c_void_p).value or 0


def crc32c_at(address: int, nbytes: int, value: int = 0) -> int:
    """CRC32C of ``nbytes`` of host memory at ``address``, continuing from ``value``."""
    if _FAST is not None:
        return _FAST.crc32c_at(address, nbytes, value)
    if _LIB is not None:
        return _LIB.crc32c_extend(value, address, nbytes)
    return google_crc32c.extend(value, ctypes.string_at(address, nbytes))


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of a buffer-protocol object, continuing from ``value``."""
    view = memoryview(data).cast("B")
    if _FAST is not None:
        return _FAST.crc32c(view, value)
    if _LIB is None or view.readonly:
        return google_crc32c.extend(value, bytes(view))
    buf = (ctypes.c_char * view.nbytes).from_buffer(view)
    return _LIB.crc32c_extend(value, ctypes.addressof(buf), view.nbytes)


def _fixed(name: str, value: Optional[bytes], size: int) -> bytes:
    if not isinstance(value, (bytes, bytearray)) or len(value) != size:
        raise ValueError(f"trailer: {name} must be {size} bytes")
    return bytes(value)


def _key_len(block_key: bytes, parent_key: Optional[bytes]) -> int:
    """The block key's length, 8 or 32, its parent's the same: ``ValueError`` otherwise (``pack``,
    ``pack_unsealed_into``)."""
    key_len = len(block_key)
    if key_len not in (8, 32):
        raise ValueError(f"trailer: block key must be 8 or 32 bytes, got {key_len}")
    if parent_key is not None and len(parent_key) != key_len:
        raise ValueError(f"trailer: parent key is {len(parent_key)} bytes, block key {key_len}")
    return key_len


def pack(t: Trailer) -> bytes:
    """The 128-byte trailer of ``t`` (version ``t.version``; writers leave the default, 2; version
    1 exists so tests can make legacy chunks). Raises ``ValueError`` for a trailer that cannot be
    written: a block key that is not 8 or 32 bytes, a parent of another length, a payload of
    4 GiB or more, a checksum that does not fit, an algorithm the version does not carry."""
    _key_len(t.block_key, t.parent_key)
    if t.version not in _ALGOS:
        raise ValueError(f"trailer: cannot write trailer version {t.version}")
    if t.checksum_algo not in _ALGOS[t.version]:
        raise ValueError(f"trailer: version {t.version} does not carry payload checksum algorithm {t.checksum_algo}")
    if not 0 <= t.layer_group < 1 << 32:
        raise ValueError(f"trailer: layer group {t.layer_group} out of range")
    key_field = _fixed("MAC", t.mac, 32) if t.mac is not None else _fixed("store key", t.store_key, 32)
    body = key_field + bytes(t.block_key).ljust(32, b"\0") + bytes(t.parent_key or b"").ljust(32, b"\0")
    if t.version == 1:
        if t.mac is not None:
            raise ValueError("trailer: version 1 has no authenticated chunks")
        if not 0 <= t.payload_crc < 1 << 32 or not 0 <= t.payload_nbytes < 1 << 64:
            raise ValueError("trailer: checksum or length out of range for version 1")
        head = _HEAD_V1.pack(MAGIC, 1, t.flags, t.layer_group, t.payload_nbytes, t.payload_crc, 0)
        own = google_crc32c.value(head + body)
        return _HEAD_V1.pack(MAGIC, 1, t.flags, t.layer_group, t.payload_nbytes, t.payload_crc, own) + body
    if not 0 <= t.payload_nbytes <= MAX_PAYLOAD_V2:
        raise ValueError(f"trailer: a page of {t.payload_nbytes} bytes is too large (pages must be < 4 GiB)")
    if not 0 <= t.payload_crc < 1 << 64:
        raise ValueError("trailer: payload checksum does not fit 64 bits")
    head = _HEAD_V2.pack(MAGIC, 2, t.flags, t.layer_group, t.payload_nbytes, 0, t.payload_crc)
    own = google_crc32c.value(head + body)
    return _HEAD_V2.pack(MAGIC, 2, t.flags, t.layer_group, t.payload_nbytes, own, t.payload_crc) + body


_UNSEALED_V2 = struct.Struct("<8sHHIIIQ32s32s32s")  # _HEAD_V2, then store key, block key, parent key


def pack_unsealed_into(buf: bytearray, offset: int, layer_group: int, payload_nbytes: int, store_key: bytes,
                       block_key: bytes, parent_key: Optional[bytes]) -> None:
    """``pack`` of a version 2 CRC32C trailer with both checksums zero, written at ``offset`` of
    ``buf``: what the native writer seals (``gdskv.io.batch.write_chunks`` fills in the payload's
    CRC32C and the trailer's own). Called by ``PageTransfer`` for each page of a step's saves, on
    the serving loop's thread: no ``Trailer`` and no checksum of its own. Raises ``ValueError``
    where ``pack`` would."""
    key_len = _key_len(block_key, parent_key)
    _fixed("store key", store_key, 32)
    if not 0 <= layer_group < 1 << 32:
        raise ValueError(f"trailer: layer group {layer_group} out of range")
    if not 0 <= payload_nbytes <= MAX_PAYLOAD_V2:
        raise ValueError(f"trailer: a page of {payload_nbytes} bytes is too large (pages must be < 4 GiB)")
    flags = (key_len << 8) | (FLAG_HAS_PARENT if parent_key is not None else 0) | (CHECKSUM_CRC32C << _ALGO_SHIFT)
    _UNSEALED_V2.pack_into(buf, offset, MAGIC, 2, flags, layer_group, payload_nbytes, 0, 0, store_key, block_key,
                           parent_key or b"")


def unpack(raw: Buffer) -> Trailer:
    """Parse and self-check a trailer (version 1 or 2); raises ``ChunkFormatError`` saying what is
    wrong, and no other exception, whatever the 128 bytes are."""
    try:
        raw = bytes(raw)
    except Exception:
        raise ChunkFormatError("trailer is not bytes") from None
    if len(raw) != TRAILER_BYTES:
        raise ChunkFormatError(f"trailer is {len(raw)} bytes, expected {TRAILER_BYTES}")
    magic, version = _PEEK.unpack_from(raw)
    if magic != MAGIC:
        raise ChunkFormatError("bad magic (not a gdskv chunk, or torn)")
    if version == 1:
        _, _, flags, group, nbytes, pcrc, own = _HEAD_V1.unpack_from(raw)
        zeroed = raw[:28] + bytes(4) + raw[32:]
    elif version == 2:
        _, _, flags, group, nbytes, own, pcrc = _HEAD_V2.unpack_from(raw)
        zeroed = raw[:20] + bytes(4) + raw[24:]
    else:
        raise ChunkFormatError(f"trailer version {version}, this gdskv reads {', '.join(map(str, TRAILER_VERSIONS))}")
    if google_crc32c.value(zeroed) != own:
        raise ChunkFormatError("trailer checksum mismatch")
    key_len = flags >> 8
    if key_len not in (8, 32):
        raise ChunkFormatError(f"bad block key length {key_len}")
    parent_len = key_len if flags & FLAG_HAS_PARENT else 0
    algo = (flags >> _ALGO_SHIFT) & _ALGO_MASK
    if algo not in _ALGOS[version]:
        raise ChunkFormatError(f"unknown payload checksum algorithm {algo} in a version {version} trailer")
    authenticated = False
    if version == 2:
        if flags & _FLAGS_RESERVED:
            raise ChunkFormatError(f"reserved flag bits set ({flags:#06x})")
        authenticated = bool(flags & FLAG_AUTHENTICATED)
        if any(raw[64 + key_len:96]) or any(raw[96 + parent_len:128]):
            raise ChunkFormatError("key padding is not zero")
    elif flags & ~(0xFF00 | FLAG_HAS_PARENT | (_ALGO_MASK << _ALGO_SHIFT)):
        raise ChunkFormatError(f"unknown flag bits in a version 1 trailer ({flags:#06x})")
    return Trailer(
        layer_group=group,
        payload_nbytes=nbytes,
        payload_crc=pcrc,
        store_key=None if authenticated else raw[32:64],
        block_key=raw[64:64 + key_len],
        parent_key=raw[96:96 + parent_len] if parent_len else None,
        checksum_algo=algo,
        mac=raw[32:64] if authenticated else None,
        version=version,
    )


def fold_weighted(byte_sum: int, weighted_sum: int, nbytes: int) -> int:
    """The 32-bit legacy ``CHECKSUM_WEIGHTED`` value from its two sums (see ``weighted_checksum``).
    Nothing writes it any more; kept only until every caller has moved to ``gdskv.checksum``."""
    return (byte_sum * 0x9E3779B1 + weighted_sum * 0x85EBCA77 + nbytes) & 0xFFFFFFFF


def weighted_checksum(data: Buffer) -> int:
    """``CHECKSUM_WEIGHTED`` of host bytes: ``a = Σ x_i``, ``b = Σ (i mod 65521 + 1)·x_i`` over the
    payload's bytes, folded to 32 bits. Legacy: readers treat chunks carrying it as unverifiable
    (``gdskv.checksum.check`` says "weak-checksum"), so nothing needs to compute it any more."""
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
