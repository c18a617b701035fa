"""Layout semantics: the spec's names, -1 and out-of-range slots, single pool and VSWA builders."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from gdskv.layout import (
    BAD_PAGE_INDEX, GroupPools, KvCacheBufferRef, KvCacheRegion, layout_from_group_tensors, single_pool_layout,
    valid_page_slots,
)


def test_valid_page_slots_skips_bad_pages_and_keeps_ordinals():
    assert list(valid_page_slots([BAD_PAGE_INDEX, BAD_PAGE_INDEX, 7, 3, -1, 0])) == [(2, 7), (3, 3), (5, 0)]
    assert list(valid_page_slots([])) == []


def test_single_pool_region_addresses_rows():
    pool = torch.arange(5 * 2 * 2 * 8, dtype=torch.float16).reshape(5, 2, 2, 8)
    layout = single_pool_layout(pool, tokens_per_block=4)
    assert layout.as_single_pool_tensor() is pool
    (g,) = layout.groups
    (r,) = g.regions
    assert g.layer_ids == (0, 1) and g.window_size is None and g.layer_group_id == 0
    assert r.size == r.stride == 2 * 2 * 8 * 2 == g.bytes_per_page
    assert r.num_slots == 5
    assert r.address_of(3) == pool.data_ptr() + 3 * r.stride
    assert torch.equal(r.slot_tensor(3, torch.float16), pool[3].reshape(-1))
    assert r.buffers[:2] == (KvCacheBufferRef(0, "key", 0), KvCacheBufferRef(0, "value", 0))
    assert layout.group_of_layer(1) is g and layout.group(0) is g
    with pytest.raises(KeyError):
        layout.group(1)


@pytest.mark.parametrize("slot", [-1, 5, 100])
def test_slot_tensor_and_address_of_refuse_outside_the_pool(slot):
    layout = single_pool_layout(torch.zeros(5, 1, 2, 4), tokens_per_block=4)
    r = layout.groups[0].regions[0]
    with pytest.raises(IndexError):
        r.slot_tensor(slot)
    with pytest.raises(IndexError):
        r.address_of(slot)


def test_as_tensor_accepts_minus_one_which_is_why_slot_tensor_exists():
    pool = torch.arange(3 * 8, dtype=torch.uint8).reshape(3, 1, 1, 8)
    r = single_pool_layout(pool, 4).groups[0].regions[0]
    assert torch.equal(r.as_tensor()[-1], r.slot_tensor(2))


def test_writes_through_slot_tensor_land_in_the_pool():
    pool = torch.zeros(4, 2, 2, 4, dtype=torch.float32)
    r = single_pool_layout(pool, 4).groups[0].regions[0]
    r.slot_tensor(2).fill_(0xFF)
    assert (pool[2].view(torch.uint8) == 0xFF).all() and (pool[[0, 1, 3]] == 0).all()


def test_a_pool_that_is_a_view_into_a_larger_allocation_reads_and_writes_its_own_bytes():
    """Issue 10, defect 1: engines carve per-layer pools out of one allocation. A pool starting 32
    elements into its storage read elements 0-3 for slot 0 (a view-relative offset was passed
    as ``as_strided``'s absolute one); slot writes landed in another pool's bytes."""
    arena = torch.arange(32 + 4 * 1 * 2 * 2, dtype=torch.float32)
    pool = arena[32:].view(4, 1, 2, 2)
    r = single_pool_layout(pool, tokens_per_block=2).groups[0].regions[0]
    assert torch.equal(r.slot_tensor(0, torch.float32), pool[0].reshape(-1))
    assert torch.equal(r.slot_tensor(3, torch.float32), pool[3].reshape(-1))
    r.slot_tensor(1).fill_(0)
    assert torch.equal(arena[:32], torch.arange(32, dtype=torch.float32))  # the neighbour is untouched
    assert (pool[1] == 0).all() and (pool[[0, 2, 3]] != 0).all()


def test_vswa_groups_with_several_regions():
    full_k, full_v = torch.zeros(6, 2, 16), torch.zeros(6, 2, 16)
    swa = torch.zeros(3, 1, 2, 16)
    layout = layout_from_group_tensors(
        [GroupPools(None, [0, 2], [full_k, full_v]), GroupPools(32, [1, 3], [swa])], tokens_per_block=8, dtype=torch.float32,
    )
    g0, g1 = layout.groups
    assert (g0.layer_group_id, g1.layer_group_id) == (0, 1)
    assert g0.window_size is None and g1.window_size == 32
    assert len(g0.regions) == 2 and g0.bytes_per_page == 2 * 2 * 16 * 4
    assert g1.bytes_per_page == 1 * 2 * 16 * 4 and g1.regions[0].num_slots == 3
    assert layout.group_of_layer(3) is g1 and layout.group_of_layer(2) is g0
    assert layout.as_single_pool_tensor() is None
    g0.regions[1].slot_tensor(5).fill_(1)
    assert (full_v[5].view(torch.uint8) == 1).all() and (full_k == 0).all()


def test_groups_must_agree_on_slot_count():
    with pytest.raises(ValueError, match="slot count"):
        layout_from_group_tensors([GroupPools(None, [0], [torch.zeros(4, 8), torch.zeros(5, 8)])], 8, torch.float32)


# --- regions over memory gdskv did not allocate (a raw address and size) ------------------------
def test_a_region_over_a_raw_host_address_reads_and_writes_that_buffer():
    """Slot ``i`` of a region built from an address is the memory at ``base + i * stride``: zero
    copy, both ways (here a numpy buffer with 8 bytes of padding between 24-byte slots)."""
    buf = np.arange(4 * 32, dtype=np.uint8)
    r = KvCacheRegion(base=buf.ctypes.data, size=24, stride=32, num_slots=4)
    assert r.device == "cpu"
    assert bytes(r.slot_tensor(2).numpy()) == bytes(buf[64:88])
    r.slot_tensor(1).fill_(0xEE)
    assert (buf[32:56] == 0xEE).all() and (buf[56:64] == np.arange(56, 64)).all() and buf[31] == 31
    assert r.slot_tensor(1).data_ptr() == buf.ctypes.data + 32
    assert r.as_tensor().shape == (4, 24)
    assert torch.equal(r.as_tensor(torch.int32)[3], torch.from_numpy(buf[96:120].view(np.int32)))


def test_a_region_over_a_ctypes_buffer_by_address_sees_later_writes_to_it():
    raw = (ctypes.c_uint8 * 48)()
    r = KvCacheRegion(base=ctypes.addressof(raw), size=16, stride=16, num_slots=3)
    raw[20] = 7
    assert int(r.slot_tensor(1)[4]) == 7
    r.slot_tensor(2).copy_(torch.full((16,), 9, dtype=torch.uint8))
    assert list(raw[32:48]) == [9] * 16 and list(raw[:16]) == [0] * 16


@pytest.mark.parametrize("slot", [-1, 3, 100])
def test_a_raw_address_region_refuses_slots_outside_it(slot):
    buf = np.zeros(3 * 16, dtype=np.uint8)
    r = KvCacheRegion(base=buf.ctypes.data, size=16, stride=16, num_slots=3)
    with pytest.raises(IndexError):
        r.slot_tensor(slot)
    with pytest.raises(IndexError):
        r.address_of(slot)


def test_a_raw_address_region_on_an_unknown_device_or_without_cuda_says_so():
    buf = np.zeros(16, dtype=np.uint8)
    with pytest.raises(RuntimeError, match="host and CUDA"):
        KvCacheRegion(base=buf.ctypes.data, size=16, stride=16, num_slots=1, device="meta").slot_tensor(0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            KvCacheRegion(base=buf.ctypes.data, size=16, stride=16, num_slots=1, device="cuda").slot_tensor(0)


def test_regions_built_from_tensors_know_their_device():
    r = single_pool_layout(torch.zeros(2, 1, 2, 4), tokens_per_block=4).groups[0].regions[0]
    assert r.device == "cpu"
