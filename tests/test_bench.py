"""``gdskv.bench.ChunkWriter``: benchmark stores are filled through the transfer's one chunk writer."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from gdskv.bench import ChunkWriter
from gdskv.io.posix import PosixEngine
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, PageTransfer

PAGE = 64


def test_chunk_writer_publishes_chunks_a_load_verifies(tmp_path: Path) -> None:
    ns = PageStore.open(tmp_path / "store").namespace(
        NamespaceSpec(model="bench", dtype="uint8", tokens_per_block=1, groups=(GroupSpec(0, PAGE, (0,), None),)))
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(20)]
    with ChunkWriter(ns, threads=2, window=7) as writer:
        paths = [writer.write(0, k, keys[i - 1] if i else None, bytes([i]) * PAGE) for i, k in enumerate(keys)]
    assert paths == [ns.chunk_path(0, k) for k in keys]
    assert ns.contains_many(0, keys) == [True] * len(keys)
    assert not list((tmp_path / "store").rglob("*.tmp.*")), "temp files left behind"
    engine = PosixEngine(threads=1)
    xfer = PageTransfer(ns, engine, threads=1)
    try:
        page = torch.zeros(PAGE, dtype=torch.uint8)
        assert xfer.load_page(0, keys[5], [page]).result() is LoadStatus.LOADED
        assert bytes(page.numpy()) == bytes([5]) * PAGE
    finally:
        xfer.close()
        engine.close()
