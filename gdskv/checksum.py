"""Payload checksums, the chunk MAC, and the functions that write and check a chunk's trailer.

Pure functions (no file I/O). Who calls what:

- ``seal`` — ``PageTransfer._save``: the 128-byte trailer of a page about to be published, from
  the page's segments wherever they live (host or device memory).
- ``check`` — ``PageTransfer._verify``: after a load has read a chunk into a page's segments,
  whether it is exactly this key's page (None) or why not (a quarantine reason).
- ``check_host`` — the same over host bytes: ``gdskv verify`` and the remote tier (one buffer
  holding the whole payload); ``seal_host`` writes a trailer for such a buffer (tests and tools
  that make chunks by hand).
- ``poly_hash`` / ``poly_hash_host`` — the device payload checksum (``CHECKSUM_POLY``), with
  torch on the tensors' own device, and its numpy form; they always give the same value.

The device checksum (``CHECKSUM_POLY``): two polynomial hashes of the payload's bytes
``x_0 .. x_{n-1}`` modulo the Mersenne prime ``P = 2**31 - 1``,
``h_j = sum(x_i * R_j**i) mod P`` for ``R_1 = R1``, ``R_2 = R2``, stored as ``h_1 | h_2 << 32``.
R1 and R2 are primitive roots mod P (order ``P - 1``), derived reproducibly (see ``_derive_root``),
and chosen so that what FORMAT.md promises holds; ``tests/test_checksum.py`` proves each promise
(the exhaustive part by a meet-in-the-middle search):

- every change of 1 to 4 consecutive bytes is detected: no nonzero ``(e0, e1, e2, e3)`` with
  ``|e_k| <= 255`` makes ``e0 + e1 R + e2 R**2 + e3 R**3`` vanish mod P for both roots;
- every swap of two different bytes is detected (payloads shorter than ``P - 1`` bytes): the
  change ``(y - x)(R**a - R**b)`` is never 0 mod P because ``|y - x| < P`` and R's order is
  ``P - 1``;
- a random overwrite goes unnoticed with probability about ``P**-2`` (2**-62).

Evaluation is exact integer arithmetic in float64 and int64 tensors: the payload is viewed as rows
of ``ROW`` bytes; ``STEP_ROWS`` rows at a time (1 MiB of input, an 8 MiB float64 temporary) are
multiplied by the cached ``(ROW, 2)`` table of ``R_j**s mod P``. Every product is below 2**39 and
every row sum below ``255 * 2**31 * 4096 < 2**51``, so float64 is exact whatever the summation
order; row sums are folded with per-row factors ``R_j**(q*ROW)`` in int64, reduced mod P before
each multiplication so no product reaches 2**62. The constant tables (about 200 KiB) are cached
per device. One host synchronisation per call (the final ``.cpu()``).

The MAC (chunks sealed with a key from the config): HMAC-SHA256 over a fixed-size header — a
label, trailer version, flags, layer group, payload length, payload checksum, the full store key,
block key and parent key — followed by the payload bytes. It is stored where the store key was
(flag bit 4). Device pages are copied to the host for it (hashlib has no device form).
"""
from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from gdskv import format as fmt
from gdskv.format import Buffer

P = (1 << 31) - 1
"""The Mersenne prime modulus of ``CHECKSUM_POLY``."""
_P_MINUS_1_PRIMES = (2, 3, 7, 11, 31, 151, 331)  # P - 1 = 2 * 3**2 * 7 * 11 * 31 * 151 * 331
R1 = 2026322757
"""First root: ``_derive_root("r1")``."""
R2 = 687820144
"""Second root: ``_derive_root("r2")``."""
ROOTS = (R1, R2)
ROW = 4096
"""Bytes per row of the evaluation (the width of the cached power table)."""
STEP_ROWS = 256
"""Rows per step: 1 MiB of input, so the float64 temporary stays at 8 MiB."""
_MAX_STEPS = 4096
"""Steps covered by the cached step-factor table: offsets below ``4096 * 1 MiB = 4 GiB``."""
MAX_POLY_BYTES = ROW * STEP_ROWS * _MAX_STEPS
"""``poly_hash`` refuses payloads of this many bytes or more (trailers hold pages below 4 GiB)."""

MAC_LABEL = b"gdskv/chunk-mac/v2\0"
_MAC_HEAD = struct.Struct("<HHIIQ")  # trailer version, flags, layer group, payload length, payload checksum

REASONS = ("bad-trailer", "foreign-key", "bad-size", "weak-checksum", "unauthenticated", "bad-checksum", "bad-mac")
"""Every reason ``check`` can give, in the order it checks."""


def is_primitive_root(r: int) -> bool:
    """Whether ``r`` generates the multiplicative group mod P (order ``P - 1``)."""
    return 1 < r < P and all(pow(r, (P - 1) // q, P) != 1 for q in _P_MINUS_1_PRIMES)


def _derive_root(label: str) -> int:
    """The first primitive root among ``SHA-256("gdskv/poly/<label>/<n>")[:8]`` (little-endian)
    mod P for n = 0, 1, ...: how R1 (label "r1") and R2 ("r2") were chosen, with nothing hand-picked."""
    n = 0
    while True:
        r = int.from_bytes(hashlib.sha256(f"gdskv/poly/{label}/{n}".encode()).digest()[:8], "little") % P
        if is_primitive_root(r):
            return r
        n += 1


def _powers(base: int, count: int, stride: int = 1) -> list[int]:
    """``[base**(k * stride) mod P for k in range(count)]``."""
    step = pow(base, stride, P)
    out, v = [], 1
    for _ in range(count):
        out.append(v)
        v = v * step % P
    return out


def _tables_py() -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    w = [list(col) for col in zip(*(_powers(r, ROW) for r in ROOTS))]
    f = [list(col) for col in zip(*(_powers(r, STEP_ROWS, ROW) for r in ROOTS))]
    g = [list(col) for col in zip(*(_powers(r, _MAX_STEPS, ROW * STEP_ROWS) for r in ROOTS))]
    return w, f, g


class _Tables:
    """The constant tables on one device: ``wt`` (2, ROW) float64 ``R**s`` (``w_int``: (ROW, 2)
    int64); ``ft`` (2, STEP_ROWS) int64 ``R**(q*ROW)``; ``g`` (_MAX_STEPS, 2) int64
    ``R**(k*ROW*STEP_ROWS)``."""

    def __init__(self, device: torch.device):
        w, f, g = _tables_py()
        self.w_int = torch.tensor(w, dtype=torch.int64, device=device)
        self.wt = self.w_int.t().to(torch.float64).contiguous()
        self.ft = torch.tensor(f, dtype=torch.int64, device=device).t().contiguous()
        self.g = torch.tensor(g, dtype=torch.int64, device=device)


_TABLES: dict[torch.device, _Tables] = {}
_TABLES_LOCK = threading.Lock()
_HOST_TABLES: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None


def _tables(device: torch.device) -> _Tables:
    t = _TABLES.get(device)
    if t is None:
        with _TABLES_LOCK:
            t = _TABLES.get(device)
            if t is None:
                t = _TABLES[device] = _Tables(device)
    return t


def _host_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    global _HOST_TABLES
    if _HOST_TABLES is None:
        w, f, g = _tables_py()
        _HOST_TABLES = (np.ascontiguousarray(np.array(w, dtype=np.float64).T), np.array(f, dtype=np.int64).T.copy(),
                        np.array(g, dtype=np.int64))
    return _HOST_TABLES


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a tensor's bytes (a copy only when the tensor is not contiguous)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _fold(h: Sequence[int]) -> int:
    return int(h[0]) | int(h[1]) << 32


def _segment_hash(flat: torch.Tensor, offset: int, t: _Tables) -> torch.Tensor:
    """``R**offset * sum(flat[i] * R**i) mod P`` for both roots: a (2,) int64 tensor on the
    segment's device, each entry below P."""
    n = flat.numel()
    q = n // ROW
    acc = torch.zeros(2, dtype=torch.int64, device=flat.device)
    if q:
        rows = flat[: q * ROW].view(q, ROW)
        scratch = torch.empty((min(q, STEP_ROWS), ROW), dtype=torch.float64, device=flat.device)
        for k, start in enumerate(range(0, q, STEP_ROWS)):
            blk = rows[start:start + STEP_ROWS]
            m = blk.shape[0]
            x = scratch[:m]
            x.copy_(blk)
            s = torch.mm(t.wt, x.t()).to(torch.int64)  # (2, m) exact row sums, each < 2**51
            s.remainder_(P).mul_(t.ft[:, :m]).remainder_(P)
            acc.add_(s.sum(1).remainder_(P).mul_(t.g[k]).remainder_(P))
    tail = n - q * ROW
    if tail:
        s = torch.mv(t.wt[:, :tail], flat[q * ROW:].to(torch.float64)).to(torch.int64).remainder_(P)
        factor = t.ft[:, q % STEP_ROWS].mul(t.g[q // STEP_ROWS]).remainder_(P)
        acc.add_(s.mul_(factor).remainder_(P))
    acc.remainder_(P)
    if offset:
        r_o = t.w_int[offset % ROW].mul(t.ft[:, (offset // ROW) % STEP_ROWS]).remainder_(P)
        r_o.mul_(t.g[offset // (ROW * STEP_ROWS)]).remainder_(P)
        acc.mul_(r_o).remainder_(P)
    return acc


def poly_hash(segments: Sequence[torch.Tensor]) -> int:
    """``CHECKSUM_POLY`` of the concatenated segments, computed with torch on their own device
    (CPU tensors too). Positions run on across segments, so any split of the same bytes gives the
    same value. Temporaries stay under ~10 MiB per call (an 8 MiB float64 scratch); the tables are cached per device."""
    flats = [_flat_bytes(s) for s in segments]
    if sum(f.numel() for f in flats) >= MAX_POLY_BYTES:
        raise ValueError("poly_hash: payloads must be smaller than 4 GiB")
    parts: list[torch.Tensor] = []
    off = 0
    for flat in flats:
        if flat.numel():
            parts.append(_segment_hash(flat, off, _tables(flat.device)))
        off += flat.numel()
    if not parts:
        return 0
    if all(p.device == parts[0].device for p in parts):
        total = torch.stack(parts).sum(0).cpu().tolist()  # the one host synchronisation
    else:
        total = [sum(v) for v in zip(*(p.cpu().tolist() for p in parts))]
    return _fold([v % P for v in total])


def poly_hash_host(data: Buffer) -> int:
    """``CHECKSUM_POLY`` of host bytes (any C-contiguous buffer), with numpy: the form ``gdskv
    verify`` uses; equal to ``poly_hash`` of the same bytes."""
    x = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    n = x.size
    if n >= MAX_POLY_BYTES:
        raise ValueError("poly_hash_host: payloads must be smaller than 4 GiB")
    wt, ft, g = _host_tables()
    q = n // ROW
    acc = np.zeros(2, dtype=np.int64)
    rows = x[: q * ROW].reshape(q, ROW)
    scratch = np.empty((min(q, STEP_ROWS), ROW), dtype=np.float64)
    for k, start in enumerate(range(0, q, STEP_ROWS)):
        blk = rows[start:start + STEP_ROWS]
        m = blk.shape[0]
        xf = scratch[:m]
        np.copyto(xf, blk)
        # two matrix-vector products with einsum's own loops: as fast as a single-threaded BLAS
        # call here, and no BLAS thread pool to contend with the caller's threads
        s = np.stack([np.einsum("ij,j->i", xf, wt[0]), np.einsum("ij,j->i", xf, wt[1])]).astype(np.int64) % P
        s = s * ft[:, :m] % P
        acc += s.sum(axis=1) % P * g[k] % P
    tail = n - q * ROW
    if tail:
        s = (wt[:, :tail] @ x[q * ROW:].astype(np.float64)).astype(np.int64) % P
        acc += s * (ft[:, q % STEP_ROWS] * g[q // STEP_ROWS] % P) % P
    return _fold(acc % P)


def crc32c_segments(segments: Sequence[torch.Tensor]) -> int:
    """CRC32C of the concatenated segments (device segments are copied to the host first)."""
    crc = 0
    for seg in segments:
        host = _flat_bytes(seg if seg.device.type == "cpu" else seg.to("cpu")).contiguous()
        crc = fmt.crc32c_at(host.data_ptr(), host.numel(), crc)
    return crc


def default_algo(segments: Sequence[torch.Tensor]) -> int:
    """CRC32C when every segment is in host memory, the device checksum otherwise."""
    return fmt.CHECKSUM_CRC32C if all(s.device.type == "cpu" for s in segments) else fmt.CHECKSUM_POLY


def payload_checksum(segments: Sequence[torch.Tensor], algo: int) -> int:
    """The payload checksum of the concatenated segments under ``algo`` (``CHECKSUM_CRC32C`` or
    ``CHECKSUM_POLY``; the legacy weighted sum is never computed: such chunks are "weak-checksum")."""
    if algo == fmt.CHECKSUM_CRC32C:
        return crc32c_segments(segments)
    if algo == fmt.CHECKSUM_POLY:
        return poly_hash(segments)
    raise ValueError(f"payload checksum algorithm {algo} is not computed by gdskv")


def _host_checksum(view: memoryview, algo: int) -> int:
    if algo == fmt.CHECKSUM_CRC32C:
        return fmt.crc32c(view)
    if algo == fmt.CHECKSUM_POLY:
        return poly_hash_host(view)
    raise ValueError(f"payload checksum algorithm {algo} is not computed by gdskv")


def _host_views(segments: Sequence[torch.Tensor]) -> Iterator[memoryview]:
    """Each segment's bytes as a host buffer: CPU tensors in place, device tensors copied."""
    for seg in segments:
        flat = _flat_bytes(seg)
        if flat.device.type != "cpu":
            flat = flat.to("cpu")
        yield memoryview(flat.contiguous().numpy())


def chunk_mac(auth_key: bytes, t: fmt.Trailer, store_key: bytes, payload: Iterable) -> bytes:
    """HMAC-SHA256 of a chunk: a fixed-size header of ``t``'s fields (its flags with the
    authenticated bit set, whatever ``t.mac`` holds) and the full ``store_key``, then the payload's
    host buffers in order. 32 bytes."""
    if len(store_key) != 32:
        raise ValueError("chunk_mac: store key must be 32 bytes")
    head = MAC_LABEL + _MAC_HEAD.pack(t.version, t.flags | fmt.FLAG_AUTHENTICATED, t.layer_group,
                                      t.payload_nbytes, t.payload_crc)
    head += bytes(store_key) + bytes(t.block_key).ljust(32, b"\0") + bytes(t.parent_key or b"").ljust(32, b"\0")
    h = hmac.new(bytes(auth_key), head, hashlib.sha256)
    for buf in payload:
        h.update(buf)
    return h.digest()


def _seal(value: int, algo: int, nbytes: int, group: int, store_key: bytes, block_key: bytes,
          parent_key: Optional[bytes], auth_key: Optional[bytes], payload: Callable[[], Iterable]) -> bytes:
    if nbytes > fmt.MAX_PAYLOAD_V2:
        raise ValueError(f"a page of {nbytes} bytes is too large (pages must be < 4 GiB)")
    t = fmt.Trailer(group, nbytes, value, bytes(store_key), bytes(block_key),
                    None if parent_key is None else bytes(parent_key), algo)
    if auth_key is not None:
        mac = chunk_mac(auth_key, t, store_key, payload())
        t = replace(t, store_key=None, mac=mac)
    return fmt.pack(t)


def seal(segments: Sequence[torch.Tensor], *, group: int, store_key: bytes, block_key: bytes,
         parent_key: Optional[bytes] = None, algo: Optional[int] = None, auth_key: Optional[bytes] = None) -> bytes:
    """The 128-byte (version 2) trailer for a page whose bytes are ``segments`` in order (uint8
    tensors on the CPU or a device). ``algo``: None picks CRC32C for host pages and the device
    checksum otherwise; ``CHECKSUM_POLY`` forces the device checksum (on CPU tensors too).
    ``auth_key``: the config's key (``GdsKvConfig.auth_key()``); with it the chunk carries an
    HMAC-SHA256 instead of the store key (device pages are copied to the host for it).
    Called by ``PageTransfer._save``. Raises ``ValueError`` for pages of 4 GiB or more, keys
    of a bad length, or the legacy algorithm."""
    flats = [_flat_bytes(s) for s in segments]
    if algo is None:
        algo = default_algo(flats)
    if algo not in (fmt.CHECKSUM_CRC32C, fmt.CHECKSUM_POLY):
        raise ValueError(f"seal: cannot write payload checksum algorithm {algo}")
    nbytes = sum(f.numel() for f in flats)
    if nbytes > fmt.MAX_PAYLOAD_V2:
        raise ValueError(f"a page of {nbytes} bytes is too large (pages must be < 4 GiB)")
    return _seal(payload_checksum(flats, algo), algo, nbytes, group, store_key, block_key, parent_key, auth_key,
                 lambda: _host_views(flats))


def seal_host(payload: Buffer, *, group: int, store_key: bytes, block_key: bytes, parent_key: Optional[bytes] = None,
              algo: int = fmt.CHECKSUM_CRC32C, auth_key: Optional[bytes] = None) -> bytes:
    """``seal`` for a payload held as one host buffer (benchmarks, tests, tools)."""
    view = memoryview(payload).cast("B")
    if algo not in (fmt.CHECKSUM_CRC32C, fmt.CHECKSUM_POLY):
        raise ValueError(f"seal_host: cannot write payload checksum algorithm {algo}")
    if view.nbytes > fmt.MAX_PAYLOAD_V2:
        raise ValueError(f"a page of {view.nbytes} bytes is too large (pages must be < 4 GiB)")
    return _seal(_host_checksum(view, algo), algo, view.nbytes, group, store_key, block_key, parent_key, auth_key,
                 lambda: [view])


def _check(raw, actual_nbytes: int, group: int, store_key: bytes, block_key: bytes, nbytes: int,
           auth_key: Optional[bytes], checksum: Callable[[int], int], payload: Callable[[], Iterable]) -> Optional[str]:
    try:
        t = fmt.unpack(raw)
    except fmt.ChunkFormatError:
        return "bad-trailer"
    if t.layer_group != group or t.block_key != bytes(block_key) or (t.mac is None and t.store_key != bytes(store_key)):
        return "foreign-key"
    if t.payload_nbytes != nbytes or actual_nbytes != nbytes:
        return "bad-size"
    if t.checksum_algo not in (fmt.CHECKSUM_CRC32C, fmt.CHECKSUM_POLY):
        return "weak-checksum"
    if (auth_key is None) != (t.mac is None):
        return "unauthenticated"
    if checksum(t.checksum_algo) != t.payload_crc:
        return "bad-checksum"
    if t.mac is not None and not hmac.compare_digest(chunk_mac(auth_key, t, store_key, payload()), t.mac):
        return "bad-mac"
    return None


def check(trailer: Buffer, segments: Sequence[torch.Tensor], *, group: int, store_key: bytes, block_key: bytes,
          nbytes: int, auth_key: Optional[bytes] = None) -> Optional[str]:
    """None when ``trailer`` and the payload read into ``segments`` are exactly the page of
    ``block_key`` in layer group ``group`` (whose store key is ``store_key``, as the reader
    computes it, and whose page is ``nbytes`` long); otherwise the reason, one of ``REASONS``:

    - "bad-trailer": the trailer does not parse or check itself;
    - "foreign-key": another group, block key or store key (a collision, or a chunk moved);
    - "bad-size": the trailer's payload length, or the segments', is not ``nbytes``;
    - "weak-checksum": a version 1 chunk with the legacy weighted sum (it lets corruption through);
    - "unauthenticated": with ``auth_key``, a chunk without a MAC; without one, a chunk with a MAC;
    - "bad-checksum": the payload does not match its checksum (corruption);
    - "bad-mac": the checksum matches but the MAC does not (forgery, replay, or another key).

    The payload checksum is computed with the trailer's algorithm where the segments live;
    the MAC needs the payload on the host (device segments are copied). Called by
    ``PageTransfer._verify`` after a load."""
    flats = [_flat_bytes(s) for s in segments]
    return _check(trailer, sum(f.numel() for f in flats), group, store_key, block_key, nbytes, auth_key,
                  lambda algo: payload_checksum(flats, algo), lambda: _host_views(flats))


def check_host(trailer: Buffer, payload: Buffer, *, group: int, store_key: bytes, block_key: bytes, nbytes: int,
               auth_key: Optional[bytes] = None) -> Optional[str]:
    """``check`` for a payload held as one host buffer (``gdskv verify``: a memoryview of the
    chunk file's payload)."""
    view = memoryview(payload).cast("B")
    return _check(trailer, view.nbytes, group, store_key, block_key, nbytes, auth_key,
                  lambda algo: _host_checksum(view, algo), lambda: [view])


def check_crc(trailer: Buffer, segments: Sequence[torch.Tensor], crc: int, *, group: int, store_key: bytes,
              block_key: bytes, nbytes: int, auth_key: Optional[bytes] = None) -> Optional[str]:
    """``check`` given the payload's CRC32C, computed while it was read (``gdskv.io.batch``);
    a chunk sealed with another algorithm is checked by computing that one. The segments' byte
    views are made only where a MAC or another algorithm needs them (per page, they cost more
    than the rest of the check)."""

    def flats() -> list[torch.Tensor]:
        return [_flat_bytes(s) for s in segments]

    return _check(trailer, sum(s.numel() * s.element_size() for s in segments), group, store_key, block_key, nbytes,
                  auth_key, lambda algo: crc if algo == fmt.CHECKSUM_CRC32C else payload_checksum(flats(), algo),
                  lambda: _host_views(flats()))
