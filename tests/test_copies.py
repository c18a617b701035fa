"""``gdskv.copies``: a page's segments to and from one flat host buffer, checked before any byte
moves (sizes that do not add up, strided segments), one by one, many at once on native threads,
and as the per-device copies a GPU's native call queues."""
from __future__ import annotations

import pytest
import torch

from gdskv.copies import device_copies, gather, payload_nbytes, scatter, scatter_many

PAGE = 256


def segments(seed: int | None = None) -> list[torch.Tensor]:
    """A page as two segments (K and V regions): random bytes, or zeros without a seed."""
    if seed is None:
        return [torch.zeros(PAGE // 2, dtype=torch.uint8), torch.zeros(PAGE // 2, dtype=torch.uint8)]
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (2, PAGE // 2), dtype=torch.uint8, generator=g).unbind())


def test_copy_helpers_check_sizes_and_round_trip():
    segs = segments(7)
    buf = torch.empty(PAGE, dtype=torch.uint8)
    gather(segs, buf)
    out = segments()
    scatter(buf, out)
    assert all(torch.equal(x, y) for x, y in zip(out, segs))
    with pytest.raises(ValueError):
        scatter(buf[:-1], out)
    with pytest.raises(ValueError):
        gather(segs, torch.empty(PAGE + 1, dtype=torch.uint8))
    strided = torch.zeros(2 * PAGE, dtype=torch.uint8)[::2]
    assert payload_nbytes(segs) == PAGE and payload_nbytes([strided]) is None


def test_scatter_many_copies_every_entry_into_its_pages_or_refuses_before_copying():
    bufs = [torch.full((PAGE,), i, dtype=torch.uint8) for i in range(6)]
    pages = [segments() for _ in range(6)]
    scatter_many(list(zip(bufs, pages)), threads=3)
    assert all(torch.equal(torch.cat(pages[i]), bufs[i]) for i in range(6))
    short = [torch.zeros(PAGE // 2, dtype=torch.uint8), torch.zeros(PAGE // 2 - 1, dtype=torch.uint8)]
    fresh = segments()
    with pytest.raises(ValueError):
        scatter_many([(bufs[1], fresh), (bufs[2], short)], threads=2)
    assert all(int(t.sum()) == 0 for t in fresh)  # refused before any copy


def test_device_copies_pair_each_segment_with_its_place_in_the_flat_buffer_both_ways():
    """``device_copies``: what ``_queue_all`` hands to one native ``cudaMemcpyAsync`` call per
    device (run on a GPU by ``scripts/gpu_check.py``): a page's segments end to end in its flat
    buffer, destination first, grouped by device; sizes that do not add up or a strided segment
    are refused before anything is copied."""
    buf_a, buf_b = torch.zeros(300, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    a = [torch.zeros(100, dtype=torch.uint8), torch.zeros(50, dtype=torch.float32)]
    b = [torch.zeros(32, dtype=torch.bfloat16)]
    into = device_copies([(buf_a, a), (buf_b, b)], True)
    assert into == {torch.device("cpu"): [(a[0].data_ptr(), buf_a.data_ptr(), 100),
                                          (a[1].data_ptr(), buf_a.data_ptr() + 100, 200),
                                          (b[0].data_ptr(), buf_b.data_ptr(), 64)]}
    out = device_copies([(buf_a, a)], False)
    assert out[torch.device("cpu")] == [(buf_a.data_ptr(), a[0].data_ptr(), 100), (buf_a.data_ptr() + 100, a[1].data_ptr(), 200)]
    with pytest.raises(ValueError, match="299"):
        device_copies([(buf_a, [a[0], torch.zeros(199, dtype=torch.uint8)])], True)
    with pytest.raises(ValueError, match="contiguous"):
        device_copies([(buf_b, [torch.zeros(8, 8, dtype=torch.uint8).t()])], True)
