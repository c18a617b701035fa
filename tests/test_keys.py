"""Content keys: chained, salted, stable across processes and hash seeds."""
from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys

import pytest

from gdskv import keys as keys_module
from gdskv.keys import block_key, canonical_key, chain_keys, store_key, store_key_run, store_keys

TOKENS = list(range(100, 164))


@pytest.fixture(params=["native", "python"])
def key_path(request, monkeypatch):
    """Keys through the compiled ``gdskv._keys`` and through struct and hashlib: both must give
    the same bytes (chunk files are named by them)."""
    if request.param == "native":
        if keys_module._native is None:
            pytest.skip("gdskv._keys is not built in this environment")
    else:
        monkeypatch.setattr(keys_module, "_native", None)
    return request.param


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


def test_store_keys_are_the_documented_digest_whatever_was_named_before():
    # chunk files are named by these bytes: the formula is the on-disk format
    k = chain_keys(TOKENS, 16)[0]
    for ns, group, key in [("ns1", 0, k), ("ns2", 0, k), ("ns1", 3, k), ("ns1", 3, b"\x07" * 8), ("ns1", 0, k)]:
        want = hashlib.sha256(b"gdskv/store/v1\0" + ns.encode() + struct.pack("<IB", group, len(key)) + key).digest()
        assert store_key(ns, group, key) == want
    assert store_key("ns1", 0, k).hex() == store_key("ns1", 0, bytearray(k)).hex()


def test_store_keys_of_many_are_each_store_key(key_path):
    keys = chain_keys(TOKENS, 16) + [b"\x07" * 8, bytearray(b"\x09" * 32), memoryview(b"\x03" * 8)]
    for ns, group in [("ns1", 0), ("ns2", 5)]:
        assert store_keys(ns, group, keys) == [store_key(ns, group, k) for k in keys]
        for run in (keys[:4], [b"\x07" * 8] * 3, keys):  # one length (hashed natively), mixed
            assert store_key_run(ns, group, run) == b"".join(store_key(ns, group, k) for k in run)
    assert store_keys("ns1", 0, []) == [] and store_key_run("ns1", 0, []) == b""
    for bad in ([keys[0], b"x" * 16], [b"x" * 16, b"y" * 16]):
        with pytest.raises(ValueError, match="8 or 32"):
            store_keys("ns1", 0, bad)
        with pytest.raises(ValueError, match="8 or 32"):
            store_key_run("ns1", 0, bad)


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


def test_chain_keys_are_the_chained_block_keys_for_any_token_ids_block_size_salt_and_start(key_path):
    """``chain_keys`` converts a prompt's token ids once, not per block: its keys must stay exactly
    ``block_key`` chained (large and negative ids, numpy and torch integers, every salt kind)."""
    import numpy as np
    import torch

    rng = random.Random(5)
    for tpb in (1, 16, 64):
        tokens = [rng.choice([0, 1, 2 ** 40 + 3, -7, 151_935, 2 ** 63 - 1, -2 ** 63]) for _ in range(tpb * 5 + 3)]
        for salt in (None, "tenant", b"\0raw", 12):
            expected, parent = [], None
            for b in range(len(tokens) // tpb):
                parent = block_key(parent, tokens[b * tpb:(b + 1) * tpb], salt)
                expected.append(parent)
            assert chain_keys(tokens, tpb, salt) == expected
            assert chain_keys(tokens, tpb, salt, start=2, parent=expected[1]) == expected[2:]
            assert chain_keys(tokens, tpb, salt, start=len(expected), parent=expected[-1]) == []
        assert chain_keys(np.array(tokens, dtype=np.int64), tpb) == chain_keys(tokens, tpb)
        assert chain_keys(torch.tensor(tokens), tpb) == chain_keys(tokens, tpb)
        assert chain_keys([float(t) for t in range(tpb * 2)], tpb) == chain_keys(list(range(tpb * 2)), tpb)
        assert chain_keys([True] * tpb, tpb) == chain_keys([1] * tpb, tpb)
    with pytest.raises(struct.error):  # an id that does not fit the encoding is refused, natively or not
        chain_keys([2 ** 63] * 16, 16)


def test_keys_are_the_ones_existing_stores_hold(key_path):
    """Known answers (computed by the per-block code stores were written with): a change to how
    keys are computed must not change a single one, or every stored chunk becomes a miss."""
    tokens = list(range(100, 164))
    assert chain_keys(tokens, 16)[0].hex() == "0afb1fedc57ea1de3c9e97bc2624285c87d4b63d5747e396daa22369f5363438"
    assert chain_keys(tokens, 16, "salt")[-1].hex() == "ed06dfbf8533ce13ea57cf9a0c809dd7cf03288c89684534ea6c75d8c306ef25"
    assert block_key(None, tokens[:16]).hex() == chain_keys(tokens, 16)[0].hex()


@pytest.fixture(params=["shani", "portable"])
def sha_kernel(request):
    native = pytest.importorskip("gdskv._keys", reason="gdskv._keys is not built in this environment")
    if native.each(b"", b"x", 1, request.param) is None:
        pytest.skip(f"this CPU cannot run the {request.param} SHA-256 kernel")
    return native, request.param


def test_every_message_length_around_the_block_and_padding_boundaries_matches_hashlib(sha_kernel):
    native, kernel = sha_kernel
    rng = random.Random(3)
    for step in list(range(1, 140)) + [255, 256, 257, 512, 513, 1000]:
        for head in (b"", b"gdskv/store/v1\0", bytes(63)):
            data = rng.randbytes(step * 3)
            want = b"".join(hashlib.sha256(head + data[i * step:(i + 1) * step]).digest() for i in range(3))
            assert native.each(head, data, step, kernel) == want, (step, len(head))
    assert native.each(b"h", b"abcd", 3, kernel) == hashlib.sha256(b"habc").digest()  # a partial record is left out


def test_a_chain_feeds_each_digest_into_the_next(sha_kernel):
    native, kernel = sha_kernel
    rng = random.Random(4)
    head, mid, tail = b"gdskv/block/v1\0", struct.pack("<I", 64), b"\1\3\0\0\0abc"
    for step in (8, 64, 512, 1024):
        data, parent = rng.randbytes(step * 7), rng.randbytes(32)
        want, prev = [], parent
        for i in range(7):
            prev = hashlib.sha256(head + prev + mid + data[i * step:(i + 1) * step] + tail).digest()
            want.append(prev)
        assert native.chain(head, parent, mid, data, step, tail, kernel) == b"".join(want)
    with pytest.raises(ValueError, match="32 bytes"):
        native.chain(head, b"short", mid, data, 8, tail, kernel)
    with pytest.raises(ValueError, match="at least 1"):
        native.each(head, data, 0, kernel)
    assert native.each(b"", b"abc", 1, "no-such-kernel") is None


def test_token_packing_takes_plain_ints_that_fit_and_nothing_else():
    native = pytest.importorskip("gdskv._keys", reason="gdskv._keys is not built in this environment")
    import numpy as np

    ids = [0, 1, -1, 151_935, 2 ** 63 - 1, -2 ** 63]
    assert native.pack_tokens(ids) == struct.pack("<6q", *ids)
    assert native.pack_tokens([]) == b""
    for bad in ([True], [1, 2 ** 63], [-2 ** 63 - 1], [1.0], [np.int64(3)], ["1"]):
        assert native.pack_tokens(bad) is None, bad
    assert native.plain_ints(ids) and native.plain_ints([])
    assert not native.plain_ints([1, True]) and not native.plain_ints([np.int64(1)])
    with pytest.raises(TypeError):
        native.pack_tokens((1, 2))


def test_plain_ints_tells_plain_ints_from_their_look_alikes(key_path):
    import numpy as np

    assert keys_module.plain_ints([0, 1, -5, 2 ** 70]) and keys_module.plain_ints([])
    for bad in ([1, True], [np.int64(1)], [1.0], [1, "2"]):
        assert not keys_module.plain_ints(bad), bad
