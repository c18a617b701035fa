"""The device payload checksum (``CHECKSUM_POLY``), ``seal``/``check`` and authenticated chunks.

What the checksum promises (FORMAT.md) is proved here: exhaustively for changes of up to 4 (each
root's solutions, then the pair) and 5 (the pair, jointly) consecutive bytes, algebraically for
swaps, and by torture trials on pages of 256 KiB to 4 MiB for everything else.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from gdskv import checksum as cs
from gdskv import format as fmt
from gdskv.keys import store_key as compute_store_key

P = cs.P


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Intra-op threads only contend on the small shared test machines; restore afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference(data: bytes) -> int:
    """The definition, slowly: ``sum(x_i * R**i) mod P`` for both roots, by Horner's rule."""
    out = []
    for r in cs.ROOTS:
        h = 0
        for x in reversed(data):
            h = (h * r + x) % P
        out.append(h)
    return out[0] | out[1] << 32


def rand_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def poly(t: torch.Tensor) -> int:
    return cs.poly_hash([t])


# --- the function itself ------------------------------------------------------------------------

def test_roots_are_primitive_and_derived_from_their_labels():
    assert cs.R1 == cs._derive_root("r1") and cs.R2 == cs._derive_root("r2") and cs.R1 != cs.R2
    assert cs.is_primitive_root(cs.R1) and cs.is_primitive_root(cs.R2)
    assert 2 * 3 ** 2 * 7 * 11 * 31 * 151 * 331 == P - 1  # so the order test above is complete


@pytest.mark.parametrize("n", [0, 1, 2, 5, 4095, 4096, 4097, 3 * 4096 + 1000, 20011])
def test_torch_host_and_reference_agree(n):
    data = rand_bytes(n, n)
    raw = data.numpy().tobytes()
    assert poly(data) == cs.poly_hash_host(raw) == reference(raw)


def test_torch_host_and_reference_agree_across_steps():
    """Over 1 MiB, so the per-step factors are used, and with a tail of a partial row."""
    data = rand_bytes((1 << 20) + 2 * 4096 + 123, 7)
    raw = data.numpy().tobytes()
    value = reference(raw)
    assert poly(data) == value and cs.poly_hash_host(raw) == value
    assert cs.poly_hash_host(bytearray(raw)) == value and cs.poly_hash_host(memoryview(raw)) == value


def test_extreme_bytes_stay_exact():
    """All 0xFF: the largest row sums the float64 matmul produces (must still be exact)."""
    data = torch.full(((1 << 20) + 4096 + 1,), 255, dtype=torch.uint8)
    raw = data.numpy().tobytes()
    assert poly(data) == cs.poly_hash_host(raw) == reference(raw)
    assert poly(torch.zeros(10000, dtype=torch.uint8)) == 0


def test_segments_split_anywhere_give_the_value_of_the_concatenation():
    data = rand_bytes(3 * (1 << 20) + 777, 3)
    whole = poly(data)
    assert whole == cs.poly_hash_host(data.numpy().tobytes())
    rng = random.Random(5)
    for _ in range(12):
        cuts = sorted(rng.sample(range(data.numel() + 1), rng.randint(1, 5)))
        bounds = [0, *cuts, data.numel()]
        segs = [data[a:b] for a, b in zip(bounds, bounds[1:])]  # empty segments included
        assert poly_segments(segs) == whole
    # cuts at row and step boundaries, and one odd byte
    for cut in (1, 4095, 4096, 1 << 20, (1 << 20) + 1, 2 << 20):
        assert poly_segments([data[:cut], data[cut:]]) == whole


def poly_segments(segs):
    return cs.poly_hash(segs)


def test_segments_of_any_dtype_are_hashed_as_their_bytes():
    page = torch.randn(2, 4096, dtype=torch.float16)
    k, v = page[0], page[1]
    as_bytes = page.reshape(-1).view(torch.uint8)
    assert cs.poly_hash([k, v]) == poly(as_bytes) == cs.poly_hash_host(as_bytes.numpy().tobytes())
    strided = torch.arange(40000, dtype=torch.int32).reshape(200, 200).t()  # not contiguous: hashed in logical order
    assert cs.poly_hash([strided]) == poly(strided.contiguous().reshape(-1).view(torch.uint8))


def test_host_forms_and_payload_checksum_agree():
    data = rand_bytes(70001, 11)
    raw = data.numpy().tobytes()
    assert cs.poly_hash_host(raw) == cs.payload_checksum([data], fmt.CHECKSUM_POLY) == poly(data)
    assert fmt.crc32c(raw) == cs.payload_checksum([data[:5], data[5:]], fmt.CHECKSUM_CRC32C)
    with pytest.raises(ValueError):
        cs.payload_checksum([data], fmt.CHECKSUM_WEIGHTED)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_and_host_agree_on_a_gpu():
    for n in (1, 4097, (1 << 20) + 4096 + 3, 4 << 20):
        data = rand_bytes(n, n)
        dev = data.to("cuda")
        assert cs.poly_hash([dev[: n // 2], dev[n // 2:]]) == cs.poly_hash_host(data.numpy().tobytes())


# --- what defeated the old position-weighted sum -------------------------------------------------

def test_detects_plus1_minus2_plus1_on_consecutive_bytes():
    """(+1, -2, +1) on three consecutive bytes: the old weighted sum missed it."""
    page = rand_bytes(1 << 18, 1)
    page[1000:1003] = torch.tensor([100, 100, 100], dtype=torch.uint8)
    bad = page.clone()
    bad[1000:1003] = torch.tensor([101, 98, 101], dtype=torch.uint8)
    raw, raw_bad = page.numpy().tobytes(), bad.numpy().tobytes()
    assert fmt.weighted_checksum(raw) == fmt.weighted_checksum(raw_bad)  # the old sum's blind spot
    assert poly(page) != poly(bad) and cs.poly_hash_host(raw) != cs.poly_hash_host(raw_bad)


def test_detects_a_swap_of_two_bytes_65521_apart():
    """Two different bytes exchanged 65,521 positions apart: the old weighted sum missed it."""
    page = rand_bytes(1 << 18, 2)
    page[500], page[500 + 65521] = 7, 200
    bad = page.clone()
    bad[500], bad[500 + 65521] = 200, 7
    raw, raw_bad = page.numpy().tobytes(), bad.numpy().tobytes()
    assert fmt.weighted_checksum(raw) == fmt.weighted_checksum(raw_bad)
    assert poly(page) != poly(bad) and cs.poly_hash_host(raw) != cs.poly_hash_host(raw_bad)


# --- exhaustive proofs ---------------------------------------------------------------------------

_E = np.arange(-255, 256, dtype=np.int64)


def _roots_of_short_changes(r: int) -> list[tuple[int, int, int, int]]:
    """Every nonzero (e0, e1, e2, e3), |e_k| <= 255, with e0 + e1 r + e2 r^2 + e3 r^3 = 0 mod P,
    by meet in the middle: A = {e0 + e1 r}, B = {-(e2 r^2 + e3 r^3)}, 511^2 values each."""
    r2, r3 = r * r % P, pow(r, 3, P)
    a = ((_E[:, None] + _E[None, :] * r) % P).ravel()
    b = ((-(_E[:, None] * r2 + _E[None, :] * r3)) % P).ravel()
    order = np.argsort(a, kind="stable")
    a_sorted = a[order]
    lo, hi = np.searchsorted(a_sorted, b, "left"), np.searchsorted(a_sorted, b, "right")
    out = []
    for j in np.nonzero(hi > lo)[0]:
        for i in order[lo[j]:hi[j]]:
            e = (int(_E[i // 511]), int(_E[i % 511]), int(_E[j // 511]), int(_E[j % 511]))
            if any(e):
                out.append(e)
    return out


def _value(e, r: int) -> int:
    return sum(c * pow(r, k, P) for k, c in enumerate(e)) % P


def test_no_change_of_up_to_4_consecutive_bytes_escapes_both_hashes():
    """A change of bytes i..i+3 by (e0..e3) shifts h by R^i (e0 + e1 R + e2 R^2 + e3 R^3); R^i is
    invertible, so it escapes one hash iff the bracket is 0 mod P. Each root alone has a few dozen
    such vectors; none is a root of the other."""
    sols1 = _roots_of_short_changes(cs.R1)
    sols2 = _roots_of_short_changes(cs.R2)
    assert 0 < len(sols1) < 200 and 0 < len(sols2) < 200  # the search finds what it should
    assert all(_value(e, cs.R1) == 0 for e in sols1) and all(_value(e, cs.R2) == 0 for e in sols2)
    assert [e for e in sols1 if _value(e, cs.R2) == 0] == []
    assert [e for e in sols2 if _value(e, cs.R1) == 0] == []
    # and the torch form really misses, in its first residue only, what the search says R1 misses
    for e in sols1[:5]:
        page = rand_bytes(4096 * 3, 9)
        page[5000:5004] = torch.tensor([255 if c < 0 else 0 for c in e], dtype=torch.uint8)
        bad = page.clone()
        bad[5000:5004] = (page[5000:5004].to(torch.int16) + torch.tensor(e, dtype=torch.int16)).to(torch.uint8)
        h, hb = poly(page), poly(bad)
        assert h & 0xFFFFFFFF == hb & 0xFFFFFFFF and h != hb


def test_no_change_of_up_to_5_consecutive_bytes_escapes_the_pair():
    """Stronger than the design asked: jointly, mod P for both roots at once (a 62-bit value), no
    nonzero (e0..e4) with |e_k| <= 255 vanishes. Meet in the middle over 511^2 x 511^3 vectors."""
    a1 = (_E[:, None] + _E[None, :] * cs.R1) % P
    a2 = (_E[:, None] + _E[None, :] * cs.R2) % P
    a = np.sort((a1 + a2 * P).ravel())  # (e0 + e1 R) for both roots, as one value below P**2
    assert np.all(np.diff(a) != 0)  # no two (e0, e1) collide, so one equality test per query suffices
    p1 = [pow(cs.R1, k, P) for k in range(5)]
    p2 = [pow(cs.R2, k, P) for k in range(5)]
    b1 = ((-(_E[:, None] * p1[2] + _E[None, :] * p1[3])) % P).ravel()
    b2 = ((-(_E[:, None] * p2[2] + _E[None, :] * p2[3])) % P).ravel()
    matches = 0
    for e4 in range(-255, 256):
        c1 = (b1 - e4 * p1[4]) % P
        c2 = (b2 - e4 * p2[4]) % P
        b = np.sort(c1 + c2 * P)  # sorted queries: searchsorted walks the table in order
        i = np.minimum(np.searchsorted(a, b), a.size - 1)
        matches += int(np.count_nonzero(a[i] == b))
    assert matches == 1  # the zero vector, and nothing else


def test_a_swap_never_escapes():
    """Swapping x at a and y at b (x != y) changes h by (y - x)(R^a - R^b): |y - x| < P, and
    R^a != R^b for a != b below P - 1 because each root's order is P - 1 (primitive)."""
    for r in cs.ROOTS:
        assert cs.is_primitive_root(r)


# --- torture: random damage on large pages, every trial must be caught --------------------------

SIZES = [256 << 10, 1 << 20, (3 << 20) + 4096 * 5 + 17, 4 << 20]


def _pages():
    for i, n in enumerate(SIZES):
        page = rand_bytes(n, 100 + i)
        yield page, poly(page)


def _torture(mutate, trials_per_page: int) -> int:
    rng = random.Random(1234)
    done = 0
    for page, clean in _pages():
        for _ in range(trials_per_page):
            undo = mutate(page, rng)
            if undo is None:
                continue
            try:
                assert poly(page) != clean, f"missed: {undo[0]}"
            finally:
                page[undo[1]:undo[1] + undo[2].numel()] = undo[2]
            done += 1
        assert poly(page) == clean
    return done


def _overwrite(page: torch.Tensor, at: int, new: torch.Tensor):
    old = page[at:at + new.numel()].clone()
    if torch.equal(old, new):
        return None
    page[at:at + new.numel()] = new
    return (f"at {at}: {old.tolist()[:8]} -> {new.tolist()[:8]}", at, old)


def test_random_single_byte_changes_are_detected():
    def mutate(page, rng):
        at = rng.randrange(page.numel())
        return _overwrite(page, at, torch.tensor([rng.randrange(256)], dtype=torch.uint8))
    assert _torture(mutate, 60) > 200


def test_random_changes_of_up_to_4_consecutive_bytes_are_detected():
    def mutate(page, rng):
        n = rng.randint(1, 4)
        at = rng.randrange(page.numel() - n)
        new = page[at:at + n].clone()
        for k in range(n):
            if rng.random() < 0.8:
                new[k] = rng.randrange(256)
        return _overwrite(page, at, new)
    assert _torture(mutate, 80) > 250


def test_random_swaps_at_random_distances_are_detected():
    def mutate(page, rng):
        a, b = sorted(rng.sample(range(page.numel()), 2))
        if rng.random() < 0.3:  # special distances: the old sum's period and row/step boundaries
            b = a + rng.choice([65521, 4096, 1 << 20, 1, 2, 3])
            if b >= page.numel():
                return None
        x, y = int(page[a]), int(page[b])
        if x == y:
            return None  # not a change
        old = page[a:b + 1].clone()
        page[a], page[b] = y, x
        return (f"swap {a} <-> {b}", a, old)
    assert _torture(mutate, 80) > 250


def test_random_4k_block_overwrites_are_detected():
    def mutate(page, rng):
        at = rng.randrange(page.numel() - 4096)
        kind = rng.random()
        if kind < 0.4:
            new = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        elif kind < 0.7:
            new = torch.full((4096,), rng.randrange(256), dtype=torch.uint8)  # zeroed / filled block
        else:
            src = rng.randrange(page.numel() - 4096)  # a block copied from elsewhere in the page
            new = page[src:src + 4096].clone()
        return _overwrite(page, at, new)
    assert _torture(mutate, 60) > 200


# --- seal / check --------------------------------------------------------------------------------

NS = "0123456789abcdef"
KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
PARENT = bytes(range(64, 96))
SECRET = b"s" * 16 + b"ecret-key"


def sk(key: bytes = KEY, group: int = 0) -> bytes:
    return compute_store_key(NS, group, key)


def page_segments(seed: int = 0):
    return [rand_bytes(4096, seed), rand_bytes(1000, seed + 1)]


def sealed(segs, **kw):
    args = dict(group=0, store_key=sk(), block_key=KEY, parent_key=PARENT)
    args.update(kw)
    return cs.seal(segs, **args)


def checked(trailer, segs, **kw):
    args = dict(group=0, store_key=sk(), block_key=KEY, nbytes=5096)
    args.update(kw)
    return cs.check(trailer, segs, **args)


@pytest.mark.parametrize("algo, want", [(None, fmt.CHECKSUM_CRC32C), (fmt.CHECKSUM_CRC32C, fmt.CHECKSUM_CRC32C),
                                        (fmt.CHECKSUM_POLY, fmt.CHECKSUM_POLY)])
@pytest.mark.parametrize("auth", [None, SECRET])
def test_seal_then_check_round_trips(algo, want, auth):
    segs = page_segments()
    raw = sealed(segs, algo=algo, auth_key=auth)
    t = fmt.unpack(raw)
    assert (t.version, t.checksum_algo, t.authenticated, t.parent_key) == (2, want, auth is not None, PARENT)
    assert t.store_key == (None if auth else sk())
    assert checked(raw, segs, auth_key=auth) is None
    payload = b"".join(s.numpy().tobytes() for s in segs)
    assert cs.check_host(raw, memoryview(payload), group=0, store_key=sk(), block_key=KEY, nbytes=5096, auth_key=auth) is None
    assert raw == cs.seal_host(payload, group=0, store_key=sk(), block_key=KEY, parent_key=PARENT,
                               algo=want, auth_key=auth)


def test_seal_refuses_the_weak_algorithm():
    with pytest.raises(ValueError):
        sealed(page_segments(), algo=fmt.CHECKSUM_WEIGHTED)


def test_check_reasons():
    segs = page_segments()
    raw = sealed(segs)
    assert checked(raw[:-1] + bytes([raw[-1] ^ 1]), segs) == "bad-trailer"
    assert checked(raw, segs, group=1) == "foreign-key"
    assert checked(raw, segs, block_key=OTHER, store_key=sk(OTHER)) == "foreign-key"
    assert checked(raw, segs, store_key=sk(OTHER)) == "foreign-key"  # a 62-bit collision
    assert checked(raw, segs, nbytes=5000) == "bad-size"
    assert checked(raw, segs[:1], nbytes=5096) == "bad-size"
    bad = [segs[0].clone(), segs[1]]
    bad[0][17] ^= 1
    assert checked(raw, bad) == "bad-checksum"
    poly_raw = sealed(segs, algo=fmt.CHECKSUM_POLY)
    assert checked(poly_raw, bad) == "bad-checksum"
    assert set(cs.REASONS) >= {"bad-trailer", "foreign-key", "bad-size", "bad-checksum", "weak-checksum",
                               "unauthenticated", "bad-mac"}


def _v1(segs, algo: int) -> bytes:
    payload = b"".join(s.numpy().tobytes() for s in segs)
    value = fmt.crc32c(payload) if algo == fmt.CHECKSUM_CRC32C else fmt.weighted_checksum(payload)
    return fmt.pack(fmt.Trailer(0, len(payload), value, sk(), KEY, PARENT, algo, version=1))


def test_v1_crc_chunks_still_load_and_v1_weighted_chunks_are_weak():
    segs = page_segments()
    assert checked(_v1(segs, fmt.CHECKSUM_CRC32C), segs) is None
    assert checked(_v1(segs, fmt.CHECKSUM_WEIGHTED), segs) == "weak-checksum"
    payload = memoryview(b"".join(s.numpy().tobytes() for s in segs))
    assert cs.check_host(_v1(segs, fmt.CHECKSUM_WEIGHTED), payload, group=0, store_key=sk(), block_key=KEY,
                         nbytes=5096) == "weak-checksum"


# --- authenticated chunks ------------------------------------------------------------------------

def _forge(raw: bytes, segs, new_segs, *, block_key: bytes = KEY) -> bytes:
    """What an attacker without the key can do: swap the payload (and maybe the block key),
    recompute the payload checksum and the trailer's own CRC, keep the old MAC."""
    t = fmt.unpack(raw)
    value = cs.payload_checksum(new_segs, t.checksum_algo)
    from dataclasses import replace
    return fmt.pack(replace(t, payload_crc=value, block_key=block_key))


@pytest.mark.parametrize("algo", [fmt.CHECKSUM_CRC32C, fmt.CHECKSUM_POLY])
def test_a_forged_chunk_is_a_miss(algo):
    segs = page_segments()
    raw = sealed(segs, algo=algo, auth_key=SECRET)
    evil = [torch.zeros(4096, dtype=torch.uint8), segs[1]]
    forged = _forge(raw, segs, evil)
    assert checked(forged, evil, auth_key=SECRET) == "bad-mac"  # checksums fine: only the MAC tells
    assert checked(forged, evil) == "unauthenticated"  # a reader without the key cannot trust it either
    # dropping the flag (an unauthenticated chunk with recomputed checksums) does not help
    plain = sealed(evil)
    assert checked(plain, evil, auth_key=SECRET) == "unauthenticated"
    # corruption of a genuine chunk is still told apart from forgery
    bad = [segs[0].clone(), segs[1]]
    bad[0][0] ^= 0x80
    assert checked(raw, bad, auth_key=SECRET) == "bad-checksum"


def test_a_valid_chunk_replayed_under_another_key_is_a_miss():
    segs = page_segments()
    raw = sealed(segs, auth_key=SECRET)
    # copied as is to another key's place: its trailer names its own key
    assert checked(raw, segs, block_key=OTHER, store_key=sk(OTHER), auth_key=SECRET) == "foreign-key"
    # with the block key rewritten (and the trailer's CRC fixed): the MAC covers the keys
    moved = _forge(raw, segs, segs, block_key=OTHER)
    assert checked(moved, segs, block_key=OTHER, store_key=sk(OTHER), auth_key=SECRET) == "bad-mac"
    # into another namespace with the same block key: the MAC covers the full store key
    other_ns = compute_store_key("fedcba9876543210", 0, KEY)
    assert checked(raw, segs, store_key=other_ns, auth_key=SECRET) == "bad-mac"
    # another layer group, trailer rewritten: the MAC covers the group
    from dataclasses import replace
    regrouped = fmt.pack(replace(fmt.unpack(raw), layer_group=1))
    assert checked(regrouped, segs, group=1, store_key=sk(group=1), auth_key=SECRET) == "bad-mac"
    # a different parent (lineage rewritten)
    reparented = fmt.pack(replace(fmt.unpack(raw), parent_key=OTHER))
    assert checked(reparented, segs, auth_key=SECRET) == "bad-mac"


def test_a_wrong_key_is_a_miss_and_the_right_key_loads():
    segs = page_segments()
    raw = sealed(segs, auth_key=SECRET)
    assert checked(raw, segs, auth_key=b"another-secret-key!") == "bad-mac"
    assert checked(raw, segs, auth_key=SECRET) is None
    assert checked(raw, segs) == "unauthenticated"  # no key configured: cannot be checked
    assert checked(sealed(segs), segs, auth_key=SECRET) == "unauthenticated"
