"""Content keys for KV blocks.

A *block key* names the KV of one full block of tokens in the context of everything before it:
``SHA-256(domain, parent key, token ids, cache salt)``. Two prompts that share a block but not
the prefix before it never share a key, and a salted request never shares a key with another salt.
Keys are plain bytes, stable across processes, machines and ``PYTHONHASHSEED``.

MAX hands its own canonical hashes (8 big-endian bytes for ahash64, 32 for SHA-256); those are
block keys as given (``canonical_key``).

The *store key* is what a store file is named and verified by: it mixes the namespace and the
layer group into the block key, so the same tokens in two layer groups (or two models) never
collide (``store_key``).

Called by the planner (chained keys for a request's tokens) and by the store (store keys).
Where the compiled ``gdskv._keys`` built, long runs of keys are packed and hashed there (the
512 block keys of a 32k-token prompt: 1.3 against 2.0 ms, its 512 store keys 0.17 against 0.65
ms, measured on a busy 2-vCPU VM); the formulas are the arguments given to it here.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from typing import Optional, Sequence

try:
    from gdskv import _keys as _native
except ImportError:  # built without a C compiler: struct and hashlib do the same work
    _native = None

BLOCK_KEY_DOMAIN = b"gdskv/block/v1\0"
STORE_KEY_DOMAIN = b"gdskv/store/v1\0"
ROOT_PARENT = b"\0" * 32
CANONICAL_LENGTHS = (8, 32)


def _encode_salt(cache_salt: Optional[str | bytes | int]) -> bytes:
    if cache_salt is None:
        return b"\0"
    if isinstance(cache_salt, int):
        cache_salt = str(cache_salt)
    if isinstance(cache_salt, str):
        cache_salt = cache_salt.encode()
    return b"\1" + struct.pack("<I", len(cache_salt)) + cache_salt


def _digest(parent: Optional[bytes], count: bytes, ids: bytes | memoryview, salt: bytes) -> bytes:
    """The block key formula: the block's token count (``<I``) and ids (``<q`` each) already
    encoded, chained on ``parent``."""
    h = hashlib.sha256(BLOCK_KEY_DOMAIN)
    h.update(parent if parent is not None else ROOT_PARENT)
    h.update(count)
    h.update(ids)
    h.update(salt)
    return h.digest()


def block_key(parent: Optional[bytes], tokens: Sequence[int], cache_salt: Optional[str | bytes | int] = None) -> bytes:
    """The 32-byte key of one block, chained on ``parent`` (``None`` for the first block)."""
    return _digest(parent, struct.pack("<I", len(tokens)), struct.pack(f"<{len(tokens)}q", *map(int, tokens)),
                   _encode_salt(cache_salt))


def chain_keys(
    tokens: Sequence[int],
    tokens_per_block: int,
    cache_salt: Optional[str | bytes | int] = None,
    start: int = 0,
    parent: Optional[bytes] = None,
) -> list[bytes]:
    """Keys of every *full* block of ``tokens`` from block ordinal ``start`` on.

    ``parent`` is the key of block ``start - 1`` (required when ``start > 0`` to extend a chain
    incrementally without rehashing the prefix).
    """
    if start > 0 and parent is None:
        raise ValueError("extending a key chain from start > 0 needs the parent key")
    end = len(tokens) // tokens_per_block
    if end <= start:
        return []
    # block_key's bytes for every block at once: one conversion of the token ids, not one per block
    raw = memoryview(_packed(tokens[start * tokens_per_block:end * tokens_per_block]))
    count, salt, step = struct.pack("<I", tokens_per_block), _encode_salt(cache_salt), 8 * tokens_per_block
    if _native is not None and (parent is None or len(parent) == 32):
        run = _native.chain(BLOCK_KEY_DOMAIN, parent if parent is not None else ROOT_PARENT, count, raw, step, salt)
        return [run[at:at + 32] for at in range(0, len(run), 32)]
    keys = []
    for at in range(0, len(raw), step):
        parent = _digest(parent, count, raw[at:at + step], salt)
        keys.append(parent)
    return keys


def _packed(span: Sequence[int]) -> bytes:
    """Token ids as ``block_key`` encodes them (``<q`` each)."""
    if _native is not None and type(span) is list:
        raw = _native.pack_tokens(span)
        if raw is not None:
            return raw
    layout = f"<{len(span)}q"  # struct converts a list of ints 3x faster than array("q", ...)
    try:
        return struct.pack(layout, *span)
    except struct.error:  # ids that are not integers themselves (block_key takes int() of each)
        return struct.pack(layout, *map(int, span))


def plain_ints(tokens: list) -> bool:
    """Whether every item of ``tokens`` is a plain ``int`` (not a bool, not a numpy integer).
    Called by the planner before it keeps a request's tokens as they are."""
    if _native is not None:
        return _native.plain_ints(tokens)
    return set(map(type, tokens)) <= {int}  # faster than all(type(t) is int ...) (0.78 against 1.1 ms)


def canonical_key(h: bytes) -> bytes:
    """Validate a MAX canonical block hash (8 or 32 bytes) and return it unchanged."""
    if not isinstance(h, (bytes, bytearray, memoryview)):
        raise TypeError(f"block hash must be bytes, got {type(h).__name__}")
    h = bytes(h)
    if len(h) not in CANONICAL_LENGTHS:
        raise ValueError(f"block hash must be 8 or 32 bytes (canonical form), got {len(h)}")
    return h


def store_key(namespace_id: str, layer_group: int, key: bytes) -> bytes:
    """The 32-byte identity of (namespace, layer group, block key): what a chunk is named by."""
    return store_keys(namespace_id, layer_group, [key])[0]


def store_key_run(namespace_id: str, layer_group: int, keys: Sequence[bytes]) -> bytes:
    """``store_key`` of each key, concatenated: what a lookup hands the native stat path for the
    512 chunks of a 32k-token prompt. Hashed natively when every key is ``bytes`` of one
    canonical length."""
    if _native is not None and keys:
        n = len(keys[0])
        if n in CANONICAL_LENGTHS and all(type(k) is bytes and len(k) == n for k in keys):
            return _native.each(_store_key_head(namespace_id, layer_group, n), b"".join(keys), n)
    return b"".join(store_keys(namespace_id, layer_group, keys))


def store_keys(namespace_id: str, layer_group: int, keys: Sequence[bytes]) -> list[bytes]:
    """``store_key`` of each key, in order, through hashlib (one hash state per key length,
    copied per key)."""
    out = []
    prefixes: dict[int, "hashlib._Hash"] = {}
    for key in keys:
        if type(key) is not bytes or len(key) not in CANONICAL_LENGTHS:
            key = canonical_key(key)
        h = prefixes.get(len(key))
        if h is None:
            h = prefixes[len(key)] = _store_key_prefix(namespace_id, layer_group, len(key))
        h = h.copy()
        h.update(key)
        out.append(h.digest())
    return out


@functools.lru_cache(maxsize=256)
def _store_key_prefix(namespace_id: str, layer_group: int, key_length: int) -> "hashlib._Hash":
    """The hash state of ``store_key`` before the key (a copy of it costs a third of hashing
    the prefix again: a lookup names 512 chunks of a 32k-token prompt)."""
    return hashlib.sha256(_store_key_head(namespace_id, layer_group, key_length))


def _store_key_head(namespace_id: str, layer_group: int, key_length: int) -> bytes:
    """What ``store_key`` hashes before the key (the formula)."""
    return STORE_KEY_DOMAIN + namespace_id.encode() + struct.pack("<IB", layer_group, key_length)
