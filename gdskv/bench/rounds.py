"""A bench run: subjects interleaved over rounds per page size, each measured the same way, and
the command line (``main``) behind ``gdskv bench`` and ``scripts/bench_store.py``.
"""
from __future__ import annotations

import gc
import json
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Optional, Sequence

import torch

from gdskv.bench.disk import drop_page_cache, fill_page_cache, page_pool, spread_directories, sync_directory_fs
from gdskv.bench.options import BenchOptions, parse_args
from gdskv.bench.report import add_ratios, format_report, size_label
from gdskv.bench.baselines import DiskCeiling, FilePerPage, RawFile, TorchSave
from gdskv.bench.subjects import ServiceSubject, StoreSubject, Subject, bench_engine, engine_usable
from gdskv.io import batch as batchio


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(subject: Subject, source: torch.Tensor, target: torch.Tensor, base: Path,
            shape: Optional[tuple[int, int]] = None) -> dict[str, float]:
    """Seconds, by kind, of one save of the pages of ``source`` (``[num_pages, page_bytes]``) up
    to ``syncfs``, one load into ``target`` with the page cache dropped and one warm load
    (files read through the page cache first), each into pages the subject cleared before and
    checks after, outside the timing, in a fresh directory under ``base`` removed afterwards.
    Called per subject and round by ``run``. ``shape``: pages and page size, for
    subjects that hold their own pages (then ``source`` and ``target`` are empty)."""
    workdir = Path(tempfile.mkdtemp(prefix="round-", dir=base))
    subject.prepare(workdir, *(shape or source.shape))
    try:
        sync_directory_fs(workdir)  # earlier dirty pages are not this save's cost
        secs = {"save": _timed(lambda: (subject.save(source), sync_directory_fs(workdir)))}
        files = subject.files()
        hot = getattr(subject, "supports_hot", False)
        drop_page_cache(files)
        if hot:
            subject.forget_hot()
        subject.clear(target)
        secs["load_cold"] = _timed(lambda: subject.load(target))
        subject.check(source, target)
        if hot and subject.hot_ready():
            subject.clear(target)
            secs["load_hot"] = _timed(lambda: subject.load_hot(target))
            subject.check(source, target)
        fill_page_cache(files)
        if hot:
            subject.forget_hot()
        subject.clear(target)
        secs["load_warm"] = _timed(lambda: subject.load(target))
        subject.check(source, target)
        return secs
    finally:
        subject.end_round()
        shutil.rmtree(workdir)


def rates(nbytes: int, secs: dict[str, float]) -> str:
    """``save 1.23, load_cold 1.50, load_warm 6.01 GB/s`` for ``nbytes`` moved in ``secs``."""
    return ", ".join(f"{k} {nbytes / v / 1e9:.2f}" for k, v in secs.items()) + " GB/s"


def _measure_page_size(page_bytes: int, subjects: list[Any], options: BenchOptions, base: Path,
                       log: Callable[[str], None], skipped: dict[str, str],
                       torch_offsets: dict[int, int]) -> dict[str, dict[str, list[float]]]:
    """Every round of every subject at one page size. A peer whose driver dies is taken out of
    ``subjects`` (for the later page sizes too), with the reason in ``skipped``. Where the torch
    pool that pages load into starts past a page boundary goes into ``torch_offsets``."""
    from gdskv.peers import PeerUnavailable

    num_pages = max(1, options.total_bytes // page_bytes)
    data = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(page_bytes))
    pools: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for kind in {s.pool for s in subjects}:
        if kind == "own":  # a peer's driver holds its own pages
            pools[kind] = (torch.empty(num_pages, 0, dtype=torch.uint8),) * 2
            continue
        source, target = page_pool(num_pages, page_bytes, kind), page_pool(num_pages, page_bytes, kind)
        source.copy_(data)
        pools[kind] = (source, target)
        if kind == "torch":
            torch_offsets[page_bytes] = target.data_ptr() % 4096
    del data
    samples: dict[str, dict[str, list[float]]] = {s.name: {} for s in subjects}
    for rnd in range(options.rounds if subjects else 0):  # every subject may have been left out
        order = subjects[rnd % len(subjects):] + subjects[:rnd % len(subjects)]
        for subject in order:
            if subject not in subjects:
                continue  # its driver died earlier in this round
            try:
                secs = measure(subject, *pools[subject.pool], base, (num_pages, page_bytes))
            except PeerUnavailable as exc:  # a peer's driver died: the others' figures still count
                log(f"  {size_label(page_bytes)} pages: {exc}; left out from here on")
                skipped[f"{subject.name} from {size_label(page_bytes)} pages on"] = str(exc)
                subjects.remove(subject)
                subject.close()
                continue
            for kind, v in secs.items():
                samples[subject.name].setdefault(kind, []).append(v)
            log(f"  {size_label(page_bytes)} pages, round {rnd + 1}/{options.rounds}, {subject.name}: "
                + rates(num_pages * page_bytes, secs))
    for subject in subjects:
        if getattr(subject, "supports_hot", False) and samples[subject.name] and "load_hot" not in samples[subject.name]:
            skipped[f"{subject.name} hot loads at {size_label(page_bytes)} pages"] = (
                "its cold loads were served by the page cache, which leaves the host tier alone (a file system "
                "in memory, such as tmpfs, cannot drop its files): point --dir at a disk")
    return {name: s for name, s in samples.items() if s}



def _subjects(options: BenchOptions, base: Path, report: dict[str, Any], log: Callable[[str], None]) -> list[Any]:
    """Every subject the options ask for; the ones that cannot run here are left out, with the
    reason in ``report["skipped"]``."""
    from gdskv.peers import PeerSubject, PeerUnavailable

    subjects: list[Any] = ([DiskCeiling(), RawFile(), RawFile(direct=True), FilePerPage(options.transfer_threads), TorchSave()]
                           if options.baselines else [])
    for pool in options.pools:
        try:
            page_pool(1, 4096, pool)
        except ValueError as exc:
            report["skipped"][f"pool {pool}"] = str(exc)
            continue
        for label in options.engines:
            why = engine_usable(label, options, str(base))
            if why is None:
                subjects.append(StoreSubject(label, bench_engine(label, options, str(base)), options.transfer_threads, pool))
            else:
                report["skipped"][f"store:{label}"] = why
        if options.service:
            subjects.append(ServiceSubject(options, pool))
    for key in options.peers:
        try:
            subjects.append(PeerSubject(key, log))
        except PeerUnavailable as exc:
            report["skipped"][f"peer {key}"] = str(exc)
    for what, why in report["skipped"].items():
        log(f"{what} left out: {why}")
    return subjects


TERMINATED_STATUS = 128 + signal.SIGTERM
"""The exit status of a bench stopped by SIGTERM (the shell's convention)."""


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within it, from the main thread, SIGTERM (a job manager, ``timeout``, ``kill``) raises
    ``SystemExit(TERMINATED_STATUS)`` as Ctrl-C raises ``KeyboardInterrupt``: the benchmark
    unwinds through its cleanup (temporary directories, peer drivers, servers) instead of dying
    with them left behind. Used by ``run`` and by the benchmark scripts' ``__main__``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> NoReturn:
        raise SystemExit(TERMINATED_STATUS)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(options: BenchOptions, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Measure every subject at every page size; the report as a JSON-ready dict. Stopped by
    SIGTERM, it removes what it made and raises ``SystemExit(TERMINATED_STATUS)``."""
    with sigterm_as_exit():
        return _run(options, log)


def _run(options: BenchOptions, log: Callable[[str], None]) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="gdskv-bench-", dir=options.directory))
    report: dict[str, Any] = {"options": {k: (list(v) if isinstance(v, tuple) else v)
                                          for k, v in vars(options).items()},
                              "skipped": {}, "results": []}
    if sum(label.startswith("kvikio") for label in options.engines) > 1:
        raise ValueError("gdskv bench: --engines takes one kvikio label at most (its settings are process-wide)")
    subjects: list[Any] = []
    try:
        report["direct_io"] = _direct_io(base)
        report["spread_directories"] = spread_directories(base)
        subjects = _subjects(options, base, report, log)
        gc.collect()
        gc.freeze()
        for page_bytes in options.page_sizes:
            samples = _measure_page_size(page_bytes, subjects, options, base, log, report["skipped"],
                                         report["direct_io"]["torch_pool_offsets"])
            moved = max(1, options.total_bytes // page_bytes) * page_bytes
            for name, s in samples.items():
                row: dict[str, Any] = {"page_bytes": page_bytes, "subject": name, "bytes": moved}
                for kind, v in s.items():
                    row[f"{kind}_gbps"] = moved / statistics.median(v) / 1e9
                    row[f"{kind}_gbps_rounds"] = [moved / t / 1e9 for t in v]
                report["results"].append(row)
            add_ratios(report, page_bytes)
    finally:
        gc.unfreeze()
        for subject in subjects:
            subject.close()
        shutil.rmtree(base, ignore_errors=True)
    return report


def _direct_io(base: Path) -> dict[str, Any]:
    """The memory alignment at which the native path moves pages in place on the file system
    under ``base`` (``batchio.dio_alignment``; None where the kernel does not say; 0 where it
    takes no direct I/O); ``_measure_page_size`` adds where each torch pool started past a page
    boundary (``torch_pool_offsets``, by page size)."""
    probe = base / "direct-io-probe"
    probe.write_bytes(b"\0")
    try:
        dio = batchio.dio_alignment(str(probe))
    finally:
        probe.unlink()
    return {"memory_align": None if dio is None else (dio.in_place if dio.offset else 0), "torch_pool_offsets": {}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``gdskv bench`` and ``scripts/bench_store.py``; returns the exit status."""
    options, as_json = parse_args(argv)
    report = run(options, log=(lambda line: print(line, file=sys.stderr)))
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return 0
