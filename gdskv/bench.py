"""Store throughput against the two obvious alternatives, on one disk, in one run.

Called by ``gdskv bench`` (the CLI) and ``scripts/bench_store.py`` through ``main(argv)``;
``run(options)`` returns the report as a dict for callers that print it themselves.

Subjects, all moving the same pages between the same CPU page pool and the same directory:

- ``raw`` and ``raw+o_direct``: one file, pages written and read sequentially with
  ``pwrite``/``preadv`` at their offsets, through the page cache or with ``O_DIRECT`` (written
  into a preallocated file); the better of the two, per kind, is the disk's sequential speed and
  the yardstick of the ratios and the target;
- ``torch.save``: one ``.pt`` file per block, ``torch.save`` / ``torch.load`` (the approach of
  TensorRT-LLM's example KV cache connector);
- ``store:<engine>``: the gdskv store through ``PageTransfer.save_page`` / ``load_page`` (chunk
  files with trailers, checksums verified on load, temp-file + rename publish), per I/O engine,
  in a fresh store whose chunk directories exist already, as in a store in service;

Each subject saves (timed up to the point the data is on the device: ``syncfs`` of the bench
directory's file system), loads cold (page cache of its files dropped with
``posix_fadvise(DONTNEED)``) and loads warm (again, from the page cache). Subjects are interleaved
within a round and the order rotates between rounds; each figure is the median over rounds, because
disks drift by tens of percent from one run to the next.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from gdskv.config import GdsKvConfig, parse_size
from gdskv.io import make_engine
from gdskv.io.base import IoEngine, Segment
from gdskv.io.posix import PosixEngine, aligned_host_buffer, move_all
from gdskv.store import GroupSpec, Namespace, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus

KINDS = ("save", "load_cold", "load_warm")
SAVE_TARGET = 0.7  # store save >= 0.7 x raw sequential write (issue 2)
LOAD_TARGET = 0.8  # store load >= 0.8 x raw sequential read


@dataclass
class BenchOptions:
    """What ``run`` measures; built from the command line by ``main``."""

    directory: str = field(default_factory=tempfile.gettempdir)
    total_bytes: int = 1 << 30
    page_sizes: tuple[int, ...] = (4 << 20,)
    rounds: int = 3
    engines: tuple[str, ...] = ("posix+o_direct", "posix+direct_writes", "posix", "kvikio+o_direct")
    io_threads: int = 8
    transfer_threads: int = 8
    kvikio_threads: int = 4
    kvikio_task_size: int = 4 << 20
    baselines: bool = True


class _Subject:
    """One way of storing the pages. ``measure`` calls ``prepare`` with a fresh directory, then
    ``save``/``load`` (each returns once every byte has moved), then ``end_round``."""

    name: str

    def prepare(self, workdir: Path, num_pages: int, page_bytes: int) -> None:
        self.workdir = workdir

    def save(self, pages: torch.Tensor) -> None:
        raise NotImplementedError

    def load(self, pages: torch.Tensor) -> None:
        raise NotImplementedError

    def files(self) -> list[str]:
        raise NotImplementedError

    def end_round(self) -> None:
        """Release what ``prepare`` made beyond the files."""

    def close(self) -> None:
        """Release what the subject holds beyond its files (engines, threads)."""


class RawFile(_Subject):
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


class _TorchSave(_Subject):
    name = "torch.save"

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


class StoreSubject(_Subject):
    """The gdskv store over one engine (which ``close`` closes), one fresh store per round. The
    pages may be on any device (``scripts/gpu_check.py`` measures CUDA page pools with it)."""

    def __init__(self, engine_label: str, engine: IoEngine, transfer_threads: int = 8):
        self.name = f"store:{engine_label}"
        self.engine = engine
        self.transfer_threads = transfer_threads

    def prepare(self, workdir: Path, num_pages: int, page_bytes: int) -> None:
        super().prepare(workdir, num_pages, page_bytes)
        spec = NamespaceSpec(model="gdskv-bench", dtype="uint8", tokens_per_block=1,
                             groups=(GroupSpec(0, page_bytes, (0,), None),))
        self.ns = PageStore.open(workdir / "store").namespace(spec)
        self.transfer = PageTransfer(self.ns, self.engine, threads=self.transfer_threads,
                                     stats_flush_seconds=3600.0)
        self.keys = [os.urandom(32) for _ in range(num_pages)]
        # A store in service made its chunk directories long ago (all 4096 of a group exist once
        # it holds some 30k chunks); making them is not the data path's cost, so the directories
        # this round's chunks go to are made before the clock starts.
        for key in self.keys:
            os.makedirs(os.path.dirname(self.ns.chunk_path(0, key)), exist_ok=True)

    def save(self, pages: torch.Tensor) -> None:
        futures = [self.transfer.save_page(0, key, None, [pages[i]]) for i, key in enumerate(self.keys)]
        bad = [status for status in (f.result() for f in futures) if status is not SaveStatus.PUBLISHED]
        if bad:
            raise RuntimeError(f"{self.name}: {len(bad)} pages not published ({bad[0]})")

    def load(self, pages: torch.Tensor) -> None:
        futures = [self.transfer.load_page(0, key, [pages[i]]) for i, key in enumerate(self.keys)]
        bad = [status for status in (f.result() for f in futures) if status is not LoadStatus.LOADED]
        if bad:
            raise RuntimeError(f"{self.name}: {len(bad)} pages not loaded ({bad[0]})")

    def files(self) -> list[str]:
        return [self.ns.chunk_path(0, key) for key in self.keys]

    def end_round(self) -> None:
        self.transfer.close()

    def close(self) -> None:
        self.engine.close()


def bench_engine(label: str, options: BenchOptions, store_path: str) -> IoEngine:
    """The engine of a bench label, as ``make_engine`` builds it from a config: ``<engine>``
    (``o_direct = "off"``), ``<engine>+o_direct`` (``"all"``, the default config),
    ``<engine>+direct_writes`` (``"writes"``), for the engines ``posix`` and ``kvikio``. kvikio's
    settings are process-wide, so a run takes one kvikio label at most. Called by ``run`` and
    ``scripts/gpu_check.py``."""
    name, _, flag = label.partition("+")
    o_direct = {"": "off", "o_direct": "all", "direct_writes": "writes"}.get(flag)
    if o_direct is None:
        raise ValueError(f"unknown engine label {label!r}")
    cfg = GdsKvConfig(store_path=store_path, engine=name, io_threads=options.io_threads,
                      o_direct=o_direct, kvikio_threads=options.kvikio_threads,
                      kvikio_task_size=options.kvikio_task_size)
    return make_engine(cfg)


def engine_usable(label: str, options: BenchOptions, directory: str) -> Optional[str]:
    """None when the engine of ``label`` can move a page in ``directory``; otherwise why not (e.g.
    kvikio without libcuda). Called by ``run`` and ``scripts/gpu_check.py`` before they build it."""
    try:
        engine = bench_engine(label, options, directory)
    except Exception as exc:  # not installed, bad config: report and leave the engine out
        return str(exc)
    probe = os.path.join(directory, f".probe-{label}")
    try:
        engine.write(probe, [Segment(0, torch.zeros(4096, dtype=torch.uint8))]).result()
        engine.read(probe, [Segment(0, torch.zeros(4096, dtype=torch.uint8))]).result()
        return None
    except OSError as exc:
        return str(exc)
    finally:
        engine.close()
        if os.path.exists(probe):
            os.unlink(probe)


# --- the page cache and durability ------------------------------------------------------------
_LIBC = ctypes.CDLL(None, use_errno=True)


def sync_directory_fs(directory: Path) -> None:
    """Flush every dirty page of the file system holding ``directory`` (``syncfs``)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        if getattr(_LIBC, "syncfs", None) is None or _LIBC.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def drop_page_cache(paths: Sequence[str]) -> None:
    """Evict the (clean) cached pages of these files, so the next read comes from the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class ChunkWriter:
    """Valid chunks, many of them, published through ``PageTransfer.save_page``: the transfer
    layer's one chunk writer (temp file, trailer with checksum and keys, rename), so a benchmark
    store holds exactly the files a store in service holds. How ``scripts/bench_lookup.py`` and
    ``scripts/bench_eviction.py`` grow stores to a million chunks in minutes: up to ``window``
    saves are in flight on the transfer's ``threads`` (POSIX engine, page cache); ``flush`` waits
    for them and raises when one was not published. A context manager (``close`` on exit)."""

    def __init__(self, ns: Namespace, threads: int = 8, window: int = 4096):
        self.ns = ns
        self._engine = PosixEngine(threads=1)
        self._transfer = PageTransfer(ns, self._engine, threads=threads, stats_flush_seconds=3600.0)
        self._window = window
        self._pending: list[Future[SaveStatus]] = []

    def write(self, group: int, key: bytes, parent: Optional[bytes], payload: bytes) -> str:
        """Queue the chunk of ``key`` (``payload``: a whole page of the group) and return its path,
        where the file is once ``flush`` returned."""
        page = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._pending.append(self._transfer.save_page(group, key, parent, [page]))
        if len(self._pending) >= self._window:
            self.flush()
        return self.ns.chunk_path(group, key)

    def flush(self) -> None:
        """Wait for every queued chunk; RuntimeError when one was dropped."""
        pending, self._pending = self._pending, []
        bad = [st for st in (f.result() for f in pending) if st not in (SaveStatus.PUBLISHED, SaveStatus.EXISTS)]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(pending)} chunks not published ({bad[0]})")

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._transfer.close()
            self._engine.close()

    def __enter__(self) -> "ChunkWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def page_pool(num_pages: int, page_bytes: int) -> torch.Tensor:
    """A page-aligned CPU page pool ``[num_pages, page_bytes]``, as a pinned or device pool is
    (torch's own CPU allocations are only 64-byte aligned, which would keep O_DIRECT out)."""
    return torch.frombuffer(aligned_host_buffer(num_pages * page_bytes), dtype=torch.uint8).view(num_pages, page_bytes)


# --- the run ----------------------------------------------------------------------------------
def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(subject: _Subject, source: torch.Tensor, target: torch.Tensor, base: Path) -> dict[str, float]:
    """Seconds, by kind, of one save of the pages of ``source`` (``[num_pages, page_bytes]``) up
    to ``syncfs``, one load into ``target`` with the page cache dropped (checked against
    ``source``) and one warm load, in a fresh directory under ``base`` removed afterwards.
    Called per subject and round by ``run``, and by ``scripts/gpu_check.py``."""
    workdir = Path(tempfile.mkdtemp(prefix="round-", dir=base))
    subject.prepare(workdir, source.shape[0], source.shape[1])
    try:
        sync_directory_fs(workdir)  # earlier dirty pages are not this save's cost
        secs = {"save": _timed(lambda: (subject.save(source), sync_directory_fs(workdir)))}
        drop_page_cache(subject.files())
        target.zero_()
        secs["load_cold"] = _timed(lambda: subject.load(target))
        if not torch.equal(target, source):
            raise RuntimeError(f"{subject.name}: pages read back differ from the pages saved")
        secs["load_warm"] = _timed(lambda: subject.load(target))
        return secs
    finally:
        subject.end_round()
        shutil.rmtree(workdir)


def rates(nbytes: int, secs: dict[str, float]) -> str:
    """``save 1.23, load_cold 1.50, load_warm 6.01 GB/s`` for ``nbytes`` moved in ``secs``."""
    return ", ".join(f"{k} {nbytes / secs[k] / 1e9:.2f}" for k in KINDS) + " GB/s"


def _measure_page_size(page_bytes: int, subjects: list[_Subject], options: BenchOptions,
                       base: Path, log: Callable[[str], None]) -> dict[str, dict[str, list[float]]]:
    num_pages = max(1, options.total_bytes // page_bytes)
    source, target = page_pool(num_pages, page_bytes), page_pool(num_pages, page_bytes)
    source.copy_(torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(page_bytes)))
    samples = {s.name: {k: [] for k in KINDS} for s in subjects}
    for rnd in range(options.rounds):
        order = subjects[rnd % len(subjects):] + subjects[:rnd % len(subjects)]
        for subject in order:
            secs = measure(subject, source, target, base)
            for kind in KINDS:
                samples[subject.name][kind].append(secs[kind])
            log(f"  {page_bytes >> 20} MiB pages, round {rnd + 1}/{options.rounds}, {subject.name}: "
                + rates(num_pages * page_bytes, secs))
    return samples


def run(options: BenchOptions, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Measure every subject at every page size; the report as a JSON-ready dict."""
    base = Path(tempfile.mkdtemp(prefix="gdskv-bench-", dir=options.directory))
    report: dict[str, Any] = {"options": {k: (list(v) if isinstance(v, tuple) else v)
                                          for k, v in vars(options).items()},
                              "skipped_engines": {}, "results": []}
    if sum(label.startswith("kvikio") for label in options.engines) > 1:
        raise ValueError("gdskv bench: --engines takes one kvikio label at most (its settings are process-wide)")
    subjects: list[_Subject] = [RawFile(), RawFile(direct=True), _TorchSave()] if options.baselines else []
    try:
        for label in options.engines:
            why = engine_usable(label, options, str(base))
            if why is None:
                subjects.append(StoreSubject(label, bench_engine(label, options, str(base)), options.transfer_threads))
            else:
                report["skipped_engines"][label] = why
                log(f"engine {label} left out: {why}")
        for page_bytes in options.page_sizes:
            samples = _measure_page_size(page_bytes, subjects, options, base, log)
            moved = max(1, options.total_bytes // page_bytes) * page_bytes
            for name, s in samples.items():
                row: dict[str, Any] = {"page_bytes": page_bytes, "subject": name, "bytes": moved}
                for kind in KINDS:
                    row[f"{kind}_gbps"] = moved / statistics.median(s[kind]) / 1e9
                    row[f"{kind}_gbps_rounds"] = [moved / t / 1e9 for t in s[kind]]
                report["results"].append(row)
            _add_ratios(report, page_bytes)
    finally:
        for subject in subjects:
            subject.close()
        shutil.rmtree(base, ignore_errors=True)
    return report


def _add_ratios(report: dict[str, Any], page_bytes: int) -> None:
    """Store rows get ``vs_raw`` (against the better raw subject, per kind), ``vs_torch_save``
    and ``meets_target`` (save and cold load: the disk-bound figures)."""
    rows = {r["subject"]: r for r in report["results"] if r["page_bytes"] == page_bytes}
    raws = [row for name, row in rows.items() if name.startswith("raw")]
    for name, row in rows.items():
        if not name.startswith("store:"):
            continue
        if raws:
            row["vs_raw"] = {k: row[f"{k}_gbps"] / max(r[f"{k}_gbps"] for r in raws) for k in KINDS}
            row["meets_target"] = row["vs_raw"]["save"] >= SAVE_TARGET and row["vs_raw"]["load_cold"] >= LOAD_TARGET
        if "torch.save" in rows:
            row["vs_torch_save"] = {k: row[f"{k}_gbps"] / rows["torch.save"][f"{k}_gbps"] for k in KINDS}


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: GB/s per subject and page size, then the store's ratios."""
    lines = [f"{'page':>6} {'subject':<26} {'save':>7} {'cold':>7} {'warm':>7}   "
             f"{'x best raw (save/cold/warm)':<28} {'x torch.save (save/cold/warm)':<30} target"]
    for row in report["results"]:
        def ratio(key: str) -> str:
            r = row.get(key)
            return "/".join(f"{r[k]:.2f}" for k in KINDS) if r else "-"
        met = row.get("meets_target")
        lines.append(
            f"{row['page_bytes'] >> 20:>4}Mi {row['subject']:<26} {row['save_gbps']:>7.2f} "
            f"{row['load_cold_gbps']:>7.2f} {row['load_warm_gbps']:>7.2f}   {ratio('vs_raw'):<28} "
            f"{ratio('vs_torch_save'):<30} {'' if met is None else ('met' if met else 'MISSED')}"
        )
    for label, why in report["skipped_engines"].items():
        lines.append(f"engine {label} left out: {why}")
    opts = report["options"]
    lines.append(f"GB/s = 1e9 bytes/s; medians of {opts['rounds']} rounds of {opts['total_bytes'] >> 20} MiB; "
                 f"save includes syncfs; cold = page cache dropped; target (the disk's): save >= {SAVE_TARGET} x raw, "
                 f"cold load >= {LOAD_TARGET} x raw; warm load (a page-cache copy for raw) is for reference")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[BenchOptions, bool]:
    """The options, and whether to print JSON."""
    parser = argparse.ArgumentParser(prog="gdskv bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure "
                        "(a temporary subdirectory is created and removed); default: the system temp directory "
                        "(under gdskv bench: the directory that holds the store)")
    parser.add_argument("--total", default="1G", help="bytes of pages per measurement (default 1G)")
    parser.add_argument("--page-size", action="append", choices=["1M", "4M"],
                        help="page size; repeat for several (default: 4M)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians (default 3)")
    parser.add_argument("--engines", default="posix+o_direct,posix+direct_writes,posix,kvikio+o_direct",
                        help="comma-separated engines for the store: posix or kvikio (o_direct off), "
                        "+o_direct (O_DIRECT reads and writes, the default config), +direct_writes "
                        "(O_DIRECT writes only); one kvikio label at most")
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--transfer-threads", type=int, default=8)
    parser.add_argument("--kvikio-threads", type=int, default=4)
    parser.add_argument("--kvikio-task-size", default="4M")
    parser.add_argument("--no-baselines", action="store_true", help="measure the store only")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    options = BenchOptions(
        directory=args.dir, total_bytes=parse_size(args.total),
        page_sizes=tuple(parse_size(p) for p in (args.page_size or ["4M"])),
        rounds=args.rounds, engines=tuple(e for e in args.engines.split(",") if e),
        io_threads=args.io_threads, transfer_threads=args.transfer_threads,
        kvikio_threads=args.kvikio_threads, kvikio_task_size=parse_size(args.kvikio_task_size),
        baselines=not args.no_baselines,
    )
    return options, args.json


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``gdskv bench`` and ``scripts/bench_store.py``; returns the exit status."""
    options, as_json = parse_args(argv)
    report = run(options, log=(lambda line: print(line, file=sys.stderr)))
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return 0
