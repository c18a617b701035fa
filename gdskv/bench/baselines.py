"""The bench's baselines: what the store is measured against in the same run.

``ceiling`` (the disk's), ``raw`` and ``raw+o_direct`` (one file), ``files`` (one plain file per
page, buffered, no checksum: the yardstick of warm loads) and ``torch.save`` (one file per
block, TensorRT-LLM's example connector). Built by ``gdskv.bench.rounds``.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from gdskv.bench.subjects import Subject
from gdskv.io.posix import move_all


class RawFile(Subject):
    """One file, pages at their offsets: also the raw baseline of ``scripts/gpu_check.py``.

    ``direct``: written with ``O_DIRECT`` into a preallocated file and read with ``O_DIRECT``
    (the pools are huge-page-backed and aligned), else written and read through the page cache
    with the kernel's readahead. Both are measured because neither wins everywhere: direct I/O is
    the faster way to the device, the page cache the faster warm read; the yardstick of each kind
    is the better of the two.
    """

    def __init__(self, direct: bool = False):
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.name = "raw+o_direct" if self.direct else "raw"

    def save(self, pages: torch.Tensor) -> None:
        path = self.files()[0]
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        try:
            view = memoryview(pages.numpy()).cast("B")
            page_bytes = pages.shape[1]
            if self.direct:  # O_DIRECT growth without preallocation is slower
                os.posix_fallocate(fd, 0, pages.shape[0] * page_bytes)
            for off in range(0, pages.shape[0] * page_bytes, page_bytes):
                move_all(os.pwritev, fd, [view[off:off + page_bytes]], off)
        finally:
            os.close(fd)

    def load(self, pages: torch.Tensor) -> None:
        fd = os.open(self.files()[0], os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        try:
            view = memoryview(pages.numpy()).cast("B")
            page_bytes = pages.shape[1]
            for off in range(0, pages.shape[0] * page_bytes, page_bytes):
                if move_all(os.preadv, fd, [view[off:off + page_bytes]], off) != page_bytes:
                    raise OSError(f"{self.files()[0]}: short read at {off}")
        finally:
            os.close(fd)

    def files(self) -> list[str]:
        return [str(self.workdir / "pages.bin")]


class FilePerPage(Subject):
    """One plain file per page, spread over directories as the store's chunks are, written and
    read by ``threads`` Python threads (the store's depth), buffered, without a checksum: the
    yardstick of the store's warm loads (page-cache reads of files like its own)."""

    name = "files"
    pool = "torch"

    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(threads)

    def prepare(self, workdir: Path, num_pages: int, page_bytes: int) -> None:
        super().prepare(workdir, num_pages, page_bytes)
        self._paths = [str(workdir / "c" / str(i % 64) / str(i)) for i in range(num_pages)]
        for i in range(min(64, num_pages)):
            os.makedirs(os.path.dirname(self._paths[i]), exist_ok=True)

    def _each(self, fn: Callable[[int], None], n: int) -> None:
        for _ in self._pool.map(fn, range(n)):
            pass

    def save(self, pages: torch.Tensor) -> None:
        def one(i: int) -> None:
            with open(self._paths[i], "wb", buffering=0) as f:
                f.write(memoryview(pages[i].numpy()))

        self._each(one, pages.shape[0])

    def load(self, pages: torch.Tensor) -> None:
        def one(i: int) -> None:
            with open(self._paths[i], "rb", buffering=0) as f:
                if f.readinto(memoryview(pages[i].numpy())) != pages.shape[1]:
                    raise OSError(f"{self._paths[i]}: short read")

        self._each(one, pages.shape[0])

    def files(self) -> list[str]:
        return self._paths

    def close(self) -> None:
        self._pool.shutdown()


class DiskCeiling(Subject):
    """The disk's ceiling: every page's bytes in one preallocated file, moved with ``O_DIRECT``
    in 4 MiB requests by 8 threads, from page-aligned memory. What no store of many files can
    beat; the yardstick of the cold-load target."""

    name = "ceiling"
    REQUEST = 4 << 20
    THREADS = 8

    def _spans(self, pages: torch.Tensor) -> tuple[memoryview, list[int]]:
        view = memoryview(pages.numpy()).cast("B")
        return view, list(range(0, view.nbytes, self.REQUEST))

    def _run(self, pages: torch.Tensor, write: bool) -> None:
        view, starts = self._spans(pages)
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        fd = os.open(self.files()[0], flags | os.O_DIRECT, 0o600)
        try:
            if write:
                os.posix_fallocate(fd, 0, view.nbytes)
            op = os.pwritev if write else os.preadv

            def one(start: int) -> None:
                span = view[start:start + self.REQUEST]
                if move_all(op, fd, [span], start) != span.nbytes:
                    raise OSError(f"{self.files()[0]}: short {'write' if write else 'read'} at {start}")

            with ThreadPoolExecutor(self.THREADS) as pool:
                list(pool.map(one, starts))
        finally:
            os.close(fd)

    def save(self, pages: torch.Tensor) -> None:
        self._run(pages, write=True)

    def load(self, pages: torch.Tensor) -> None:
        self._run(pages, write=False)

    def files(self) -> list[str]:
        return [str(self.workdir / "ceiling.bin")]


class TorchSave(Subject):
    name = "torch.save"
    pool = "torch"

    def prepare(self, workdir: Path, num_pages: int, page_bytes: int) -> None:
        super().prepare(workdir, num_pages, page_bytes)
        self._paths: list[str] = []

    def save(self, pages: torch.Tensor) -> None:
        self._paths = [str(self.workdir / f"block{i}.pt") for i in range(pages.shape[0])]
        for i, path in enumerate(self._paths):
            torch.save(pages[i].clone(), path)  # a view would save the whole pool's storage

    def load(self, pages: torch.Tensor) -> None:
        for i, path in enumerate(self._paths):
            pages[i].copy_(torch.load(path))

    def files(self) -> list[str]:
        return self._paths
