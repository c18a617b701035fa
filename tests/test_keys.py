"""Content keys: chained, salted, stable across processes and hash seeds."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gdskv.keys import block_key, canonical_key, chain_keys, store_key

TOKENS = list(range(100, 164))


def test_chain_covers_full_blocks_only():
    assert len(chain_keys(TOKENS[:63], 16)) == 3
    assert len(chain_keys(TOKENS, 16)) == 4


def test_same_block_after_different_prefix_gets_a_different_key():
    a = chain_keys([1] * 16 + [7] * 16, 16)
    b = chain_keys([2] * 16 + [7] * 16, 16)
    assert a[1] != b[1]
    assert block_key(None, [7] * 16) not in (a[1], b[1])


def test_salt_is_in_every_key():
    plain, salted, other = (chain_keys(TOKENS, 16, salt) for salt in (None, "tenant-a", "tenant-b"))
    assert not set(plain) & set(salted) and not set(salted) & set(other)
    assert chain_keys(TOKENS, 16, "tenant-a") == salted


def test_incremental_extension_matches_full_chain():
    full = chain_keys(TOKENS, 16, "s")
    assert chain_keys(TOKENS, 16, "s", start=2, parent=full[1]) == full[2:]
    with pytest.raises(ValueError):
        chain_keys(TOKENS, 16, start=1)


def test_store_key_separates_groups_and_namespaces():
    k = chain_keys(TOKENS, 16)[0]
    assert len({store_key("ns1", 0, k), store_key("ns1", 1, k), store_key("ns2", 0, k)}) == 3


def test_canonical_hashes_are_used_as_given():
    assert canonical_key(b"\x01" * 8) == b"\x01" * 8
    assert canonical_key(bytearray(32)) == bytes(32)
    with pytest.raises(ValueError, match="8 or 32"):
        canonical_key(b"x" * 16)
    with pytest.raises(TypeError):
        canonical_key(1234)  # type: ignore[arg-type]
    assert store_key("n", 0, b"\x01" * 8) != store_key("n", 0, b"\x01" * 8 + bytes(24))


def test_keys_are_stable_across_processes_and_hash_seeds():
    code = "from gdskv.keys import chain_keys; print(chain_keys(list(range(100, 164)), 16, 'salt')[-1].hex())"
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip())
    assert outs == {chain_keys(TOKENS, 16, "salt")[-1].hex()}
