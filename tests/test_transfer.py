"""``PageTransfer`` on real files: pages staged through a host buffer (what device pages get
when the engine has no GDS: issue 10, the device checksum computed on the host copy that exists
anyway) round-trip, carry CRC32C, and a staged load touches the page only once verified."""
from __future__ import annotations

from pathlib import Path

import torch

from gdskv import format as fmt
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus

KEYS = chain_keys(list(range(64)), 16, "transfer")
SIZES = [4096 + 100, 3000]


def pages(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in SIZES]


def transfer(store_path: str, **kw) -> PageTransfer:
    ns = PageStore.open(store_path).namespace(NamespaceSpec("transfer/m", "float16", 16, (GroupSpec(0, sum(SIZES), (0,)),)))
    return PageTransfer(ns, PosixEngine(threads=1, o_direct=True), threads=2, **kw)


def test_a_staged_page_round_trips_and_is_checksummed_with_crc32c_on_the_host_copy(store_path):
    x = transfer(store_path, stage_host=True)
    src = pages(1)
    assert x.save_page(0, KEYS[0], None, src).result() is SaveStatus.PUBLISHED
    raw = Path(x.ns.chunk_path(0, KEYS[0])).read_bytes()
    assert fmt.unpack(raw[-fmt.TRAILER_BYTES:]).checksum_algo == fmt.CHECKSUM_CRC32C
    dst = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
    assert x.load_page(0, KEYS[0], dst).result() is LoadStatus.LOADED
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    plain = transfer(store_path)  # an unstaged reader reads what a staged writer wrote
    dst2 = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
    assert plain.load_page(0, KEYS[0], dst2).result() is LoadStatus.LOADED
    assert all(torch.equal(a, b) for a, b in zip(src, dst2))
    x.close()
    plain.close()


def test_a_corrupt_chunk_never_reaches_a_staged_page(store_path):
    x = transfer(store_path, stage_host=True)
    x.save_page(0, KEYS[1], KEYS[0], pages(2)).result()
    path = Path(x.ns.chunk_path(0, KEYS[1]))
    raw = bytearray(path.read_bytes())
    raw[7] ^= 0x40
    path.write_bytes(bytes(raw))
    dst = [torch.full((n,), 0xAB, dtype=torch.uint8) for n in SIZES]
    assert x.load_page(0, KEYS[1], dst).result() is LoadStatus.CORRUPT
    assert all((d == 0xAB).all() for d in dst)  # untouched: the bad bytes stayed in the staging buffer
    x.close()


def test_pages_of_different_sizes_share_one_growing_staging_buffer(store_path):
    x = transfer(store_path, stage_host=True)
    small = x._staged([torch.zeros(10, dtype=torch.uint8)])
    big = x._staged([torch.zeros(1 << 20, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8)])
    assert [v.numel() for v in small] == [10] and [v.numel() for v in big] == [1 << 20, 5]
    assert x._staged([torch.zeros(3, dtype=torch.uint8)])[0].data_ptr() == big[0].data_ptr()
    assert transfer(store_path)._staged(pages(0)) is None  # host pages, no GDS question: not staged
    x.close()
