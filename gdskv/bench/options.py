"""The options of ``gdskv bench`` (``BenchOptions``) and their command line (``parse_args``),
apart from the benchmark itself so that a usage mistake is answered before torch is imported
(``gdskv.bench`` imports nothing until a name is used). ``OneLineParser`` is the benchmark
scripts' parser too."""
from __future__ import annotations

import argparse
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import NoReturn, Optional, Sequence

from gdskv.config import ConfigError, GdsKvConfig, parse_size

DESCRIPTION = "Store throughput against the two obvious alternatives, on one disk, in one run."
POOLS = ("torch", "hugepage", "pinned", "cuda")
MIN_PAGE, MAX_PAGE = 4 << 10, 64 << 20


@dataclass
class BenchOptions:
    """What ``run`` measures; built from the command line by ``main``."""

    directory: str = field(default_factory=tempfile.gettempdir)
    total_bytes: int = 1 << 30
    page_sizes: tuple[int, ...] = (4 << 20,)
    rounds: int = 3
    engines: tuple[str, ...] = ("posix+o_direct", "posix")
    pools: tuple[str, ...] = ("torch",)
    peers: tuple[str, ...] = ("vllm", "lmcache")
    io_threads: int = GdsKvConfig.io_threads
    transfer_threads: int = GdsKvConfig.io_threads
    kvikio_threads: int = 4
    kvikio_task_size: int = 4 << 20
    baselines: bool = True
    service: bool = True
    """Also measure ``ServiceSubject`` (the default config through ``KvService``, host tier on)."""


ENGINE_LABEL = re.compile(r"^(posix|kvikio)(\+(o_direct|direct_writes))?$")
"""A ``--engines`` label (``bench_engine`` builds its engine)."""
MEMORY_PER_TOTAL = 3
"""Bytes of memory a run holds per byte of ``--total``: the pages saved, the pages loaded into,
and the service subject's host tier."""


def _size(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as e:  # argparse would say "invalid _size value"
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return n


def _page_size(text: str) -> int:
    n = _size(text)
    if not MIN_PAGE <= n <= MAX_PAGE or n % 512:
        raise argparse.ArgumentTypeError(f"page size must be a multiple of 512 bytes in [4K, 64M], got {text!r}")
    return n


class OneLineParser(argparse.ArgumentParser):
    """argparse that answers a usage mistake with one line on stderr and exit status 2 (no usage
    block: ``--help`` has it). Used by ``gdskv bench`` and the benchmark scripts."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[BenchOptions, bool]:
    """The options, and whether to print JSON."""
    parser = OneLineParser(prog="gdskv bench", description=DESCRIPTION)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure "
                        "(a temporary subdirectory is created and removed); default: the system temp directory "
                        "(under gdskv bench: the directory that holds the store)")
    parser.add_argument("--total", default=1 << 30, type=_size, help="bytes of pages per measurement (default 1G)")
    parser.add_argument("--page-size", action="append", type=_page_size,
                        help="page size (64K .. 16M are what engines use); repeat for several (default: 256K, 1M, 4M)")
    parser.add_argument("--pool", action="append", choices=POOLS,
                        help="page pool of the store subjects; repeat for several (default: torch)")
    parser.add_argument("--peers", default="vllm,lmcache",
                        help="comma-separated peers to measure: vllm, lmcache (default both; '' for none)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians (default 3)")
    parser.add_argument("--engines", default="posix+o_direct,posix",
                        help="comma-separated engines for the store: posix or kvikio (o_direct off), "
                        "+o_direct (O_DIRECT reads and writes, the default config), +direct_writes "
                        "(O_DIRECT writes only); one kvikio label at most")
    parser.add_argument("--io-threads", type=int, default=GdsKvConfig.io_threads)
    parser.add_argument("--transfer-threads", type=int, default=GdsKvConfig.io_threads)
    parser.add_argument("--kvikio-threads", type=int, default=4)
    parser.add_argument("--kvikio-task-size", default=4 << 20, type=_size)
    parser.add_argument("--no-baselines", action="store_true", help="measure the store only")
    parser.add_argument("--no-service", action="store_true",
                        help="leave out the service subject (the default config through KvService, host tier on)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    unknown = [p for p in args.peers.split(",") if p and p not in ("vllm", "lmcache")]
    if unknown:
        parser.error(f"--peers: unknown peer {unknown[0]!r} (vllm, lmcache)")
    if not os.path.isdir(args.dir):
        parser.error(f"--dir: not a directory: {args.dir}")
    engines = tuple(e for e in args.engines.split(",") if e)
    wrong = [e for e in engines if not ENGINE_LABEL.match(e)] or ([] if engines else [args.engines])
    if wrong:
        parser.error(f"--engines: {wrong[0]!r} is not an engine label (posix or kvikio, each optionally +o_direct or "
                     "+direct_writes; comma-separated)")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if MEMORY_PER_TOTAL * args.total > memory:
        parser.error(f"--total: {args.total >> 20} MiB of pages needs about {MEMORY_PER_TOTAL * args.total >> 30} GiB of "
                     f"memory (the pages saved, the pages loaded, the host tier's copy); this machine has {memory >> 30} GiB")
    # the engines' settings, checked as the config checks them, before any subject is measured
    # (the transfer threads are a transfer's depth: the config's io_threads)
    for flag, setting in (("--io-threads", {"io_threads": args.io_threads}),
                          ("--transfer-threads", {"io_threads": args.transfer_threads}),
                          ("--kvikio-threads", {"kvikio_threads": args.kvikio_threads}),
                          ("--kvikio-task-size", {"kvikio_task_size": args.kvikio_task_size})):
        try:
            GdsKvConfig(**setting)
        except ConfigError as e:
            parser.error(f"{flag}: {e}")
    options = BenchOptions(
        directory=args.dir, total_bytes=args.total,
        page_sizes=tuple(args.page_size or (256 << 10, 1 << 20, 4 << 20)), pools=tuple(args.pool or ("torch",)),
        peers=tuple(p for p in args.peers.split(",") if p),
        rounds=args.rounds, engines=engines,
        io_threads=args.io_threads, transfer_threads=args.transfer_threads,
        kvikio_threads=args.kvikio_threads, kvikio_task_size=args.kvikio_task_size,
        baselines=not args.no_baselines, service=not args.no_service,
    )
    return options, args.json
