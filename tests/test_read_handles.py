"""kvikio read handles reused across loads (issue 10, item 8), with real files and real kvikio
(through the CUDA driver test double where no driver exists): a hot chunk is not reopened, a
replaced chunk is never read through its old handle, and an evicted chunk's blocks are not held
for longer than ``handle_max_age``."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from gdskv.io.base import Segment

try:
    from tests.fakecuda import ensure_libcuda
except ImportError:  # tests/ itself on sys.path (pytest's default "prepend" import mode)
    from fakecuda import ensure_libcuda

PAGE = 64 << 10


@pytest.fixture(scope="module")
def driver() -> str:
    pytest.importorskip("kvikio", reason="kvikio is an optional extra (gdskv[cu12])")
    return ensure_libcuda()


def _engine(**kw):
    from gdskv.io.kvikio_engine import KvikioEngine

    return KvikioEngine(threads=2, task_size=1 << 20, **kw)


def _write(path: Path, fill: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(bytes([fill]) * PAGE)
    os.replace(tmp, path)  # as a save publishes: a new inode under the chunk's name


def _read(engine, path: Path) -> torch.Tensor:
    buf = torch.empty(PAGE, dtype=torch.uint8)
    assert engine.read_now(str(path), [Segment(0, buf)]) == PAGE
    return buf


def _held(path: Path) -> int:
    """Descriptors of this process open on ``path``'s inode, deleted or not (kvikio's own)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target in (str(path), f"{path} (deleted)")
    return n


def test_a_hot_chunk_is_read_through_one_handle(driver: str, tmp_path: Path) -> None:
    engine = _engine()
    try:
        chunk = tmp_path / "c"
        _write(chunk, 7)
        for _ in range(5):
            assert bool((_read(engine, chunk) == 7).all())
        assert (engine.read_handles.opened, engine.read_handles.reused) == (1, 4)
    finally:
        engine.close()
    assert _held(chunk) == 0


def test_a_replaced_chunk_is_never_read_through_its_old_handle(driver: str, tmp_path: Path) -> None:
    engine = _engine()
    try:
        chunk = tmp_path / "c"
        _write(chunk, 1)
        assert bool((_read(engine, chunk) == 1).all())
        _write(chunk, 2)
        assert bool((_read(engine, chunk) == 2).all())
        assert engine.read_handles.opened == 2
    finally:
        engine.close()


def test_an_evicted_chunk_is_not_held_open_past_the_max_age(driver: str, tmp_path: Path) -> None:
    engine = _engine(handle_max_age=0.3)
    try:
        chunk = tmp_path / "c"
        _write(chunk, 3)
        _read(engine, chunk)
        assert _held(chunk) > 0  # cached
        chunk.unlink()  # evicted by another process; this engine stays idle
        deadline = time.monotonic() + 5
        while _held(chunk) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _held(chunk) == 0 and len(engine.read_handles) == 0
    finally:
        engine.close()


@pytest.mark.parametrize("capacity", [0, 2])
def test_no_more_handles_than_the_capacity_stay_open(driver: str, tmp_path: Path, capacity: int) -> None:
    engine = _engine(handle_cache=capacity)
    try:
        chunks = [tmp_path / f"c{i}" for i in range(6)]
        for i, c in enumerate(chunks):
            _write(c, i)
            for _ in range(2):
                assert bool((_read(engine, c) == i).all())
        assert len(engine.read_handles) == capacity
        assert sum(_held(c) > 0 for c in chunks) == capacity
        assert engine.read_handles.opened == (6 if capacity else 12)
    finally:
        engine.close()


def test_concurrent_reads_of_shared_handles_all_read_their_chunk(driver: str, tmp_path: Path) -> None:
    engine = _engine(handle_cache=3, handle_max_age=0.05)
    chunks = [tmp_path / f"c{i}" for i in range(5)]
    for i, c in enumerate(chunks):
        _write(c, 10 + i)
    wrong: list[int] = []

    def reader(seed: int) -> None:
        for n in range(60):
            i = (seed * 7 + n) % len(chunks)
            if not bool((_read(engine, chunks[i]) == 10 + i).all()):
                wrong.append(i)

    try:
        threads = [threading.Thread(target=reader, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not wrong and engine.read_handles.reused > 0
    finally:
        engine.close()
    assert sum(_held(c) for c in chunks) == 0
