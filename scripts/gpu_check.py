#!/usr/bin/env python3
"""One command for a GPU machine: the paths CI cannot run, with numbers.

    python scripts/gpu_check.py [--dir DIR] [--total 512M] [--page-size 4M]

1. platform: CUDA device, driver, kvikio, compat mode, whether GDS is active;
2. kvikio engine with CUDA tensors (GDS where present, kvikio's bounce buffers otherwise):
   round trips of odd, 1 MiB and 4 MiB pages plus a host trailer, bf16 included;
3. posix engine with CUDA tensors (pinned bounce buffers): buffered, O_DIRECT writes (the
   default config), O_DIRECT reads and writes;
4. the store: ``PageTransfer.save_page`` / ``load_page`` from and into CUDA page slots of a
   ``single_pool_layout``, verified against the original pages; a flipped byte is a miss;
5. a short bench per engine on CUDA page slots (``gdskv.bench.measure``: save to the device,
   ``syncfs``; cold load, page cache dropped; warm load), next to raw sequential
   ``pwrite``/``pread`` of the same bytes from page-aligned host memory.

On a machine without CUDA it says so and exits 0. Exits 1 if any check fails.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gdskv import bench  # noqa: E402
from gdskv.config import parse_size  # noqa: E402
from gdskv.io.base import IoEngine, Segment  # noqa: E402
from gdskv.io.capabilities import cuda_driver_present, kvikio_available  # noqa: E402
from gdskv.layout import single_pool_layout  # noqa: E402
from gdskv.store import NamespaceSpec, PageStore  # noqa: E402
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus, page_segments  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
DEVICE = "cuda"  # --device cpu runs the same checks on host memory (a dry run of this script)


ENGINE_LABELS = ("posix", "posix+direct_writes", "posix+o_direct", "kvikio+o_direct")  # see gdskv.bench.bench_engine


def engines(workdir: Path) -> dict[str, IoEngine]:
    """Every engine of ``ENGINE_LABELS`` this machine can build, by label."""
    made: dict[str, IoEngine] = {}
    options = bench.BenchOptions()
    for label in ENGINE_LABELS:
        why = bench.engine_usable(label, options, str(workdir))
        if why is not None:
            print(f"  {label}: left out ({why})")
            continue
        made[label] = bench.bench_engine(label, options, str(workdir))
    return made


def check_platform() -> None:
    if DEVICE != "cuda":
        print(f"  dry run on {DEVICE} memory")
        return
    props = torch.cuda.get_device_properties(0)
    print(f"  device: {props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
    print(f"  libcuda with a device: {cuda_driver_present()}; kvikio installed: {kvikio_available()}")
    if kvikio_available():
        import kvikio
        import kvikio.defaults

        print(f"  kvikio {kvikio.__version__}: compat_mode={kvikio.defaults.get('compat_mode')!s}, "
              f"compat preferred={kvikio.defaults.is_compat_mode_preferred()}")


def check_engine_round_trips(label: str, engine: IoEngine, workdir: Path) -> None:
    print(f"  {engine.describe()}")
    for nbytes in (4 * KiB + 128, 1 * MiB, 4 * MiB):
        page = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEVICE)
        trailer = os.urandom(128)
        path = str(workdir / f"{label}-{nbytes}")
        assert engine.write(path, [Segment(0, page), Segment(nbytes, trailer)]).result() == nbytes + 128
        back, back_trailer = torch.zeros_like(page), bytearray(128)
        assert engine.read(path, [Segment(0, back), Segment(nbytes, back_trailer)]).result() == nbytes + 128
        assert torch.equal(back, page) and bytes(back_trailer) == trailer, f"{label}: {nbytes} B differ"
    bf16 = torch.randn(3, 1000, dtype=torch.bfloat16, device=DEVICE)
    path = str(workdir / f"{label}-bf16")
    engine.write(path, [Segment(0, bf16.view(torch.uint8).reshape(-1))]).result()
    back16 = torch.empty_like(bf16)
    engine.read(path, [Segment(0, back16.view(torch.uint8).reshape(-1))]).result()
    assert torch.equal(back16, bf16), f"{label}: bf16 page differs"
    print(f"  {label}: {DEVICE} round trips of 4224 B, 1 MiB, 4 MiB and bf16 pages OK")


def check_store(label: str, engine: IoEngine, workdir: Path) -> None:
    pool = torch.randn(16, 4, 2, 64 * 1024, dtype=torch.bfloat16, device=DEVICE)  # 1 MiB pages
    layout = single_pool_layout(pool, tokens_per_block=64)
    ns = PageStore.open(workdir / f"store-{label}").namespace(NamespaceSpec.from_layout(layout, model="gpu-check"))
    transfer = PageTransfer(ns, engine)
    group = layout.group(0)
    keys = [os.urandom(32) for _ in range(pool.shape[0])]
    saved = [transfer.save_page(0, k, None, page_segments(group, s)) for s, k in enumerate(keys)]
    assert all(f.result() is SaveStatus.PUBLISHED for f in saved), [f.result() for f in saved]
    original = pool.clone()
    pool.zero_()
    loaded = [transfer.load_page(0, k, page_segments(group, s)) for s, k in enumerate(keys)]
    assert all(f.result() is LoadStatus.LOADED for f in loaded), [f.result() for f in loaded]
    assert torch.equal(pool, original), f"{label}: pages loaded through the store differ"
    path = ns.chunk_path(0, keys[0])
    with open(path, "r+b") as f:  # a flipped payload byte must be a miss, never data
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    status = transfer.load_page(0, keys[0], page_segments(group, 0)).result()
    assert status is LoadStatus.CORRUPT, f"{label}: corrupt chunk loaded as {status}"
    transfer.close()
    print(f"  {label}: 16 bf16 pages of 1 MiB saved from and loaded into {DEVICE} slots, verified; "
          "flipped byte -> CORRUPT")


def short_bench(label: str, engine: IoEngine, workdir: Path, total: int, page_bytes: int) -> str:
    """The store over ``engine`` moving pages of a ``DEVICE`` page pool (engine left open)."""
    num_pages = max(1, total // page_bytes)
    pool = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8, device=DEVICE)
    secs = bench.measure(bench.StoreSubject(label, engine), pool, torch.empty_like(pool), workdir)
    return bench.rates(num_pages * page_bytes, secs)


def raw_baseline(workdir: Path, total: int, page_bytes: int) -> str:
    """``gdskv.bench``'s raw subjects (one file, buffered and O_DIRECT writes) on host pools."""
    num_pages = max(1, total // page_bytes)
    source, target = bench.page_pool(num_pages, page_bytes), bench.page_pool(num_pages, page_bytes)
    source.copy_(torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8))
    return "\n  ".join(
        f"{raw.name:<13} {bench.rates(num_pages * page_bytes, bench.measure(raw, source, target, workdir))}"
        "  (host memory, one file)"
        for raw in (bench.RawFile(), bench.RawFile(direct=True)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="directory on the disk to use (default: the system temp directory)")
    parser.add_argument("--total", default="512M", help="bytes per bench measurement (default 512M)")
    parser.add_argument("--page-size", default="4M", help="bench page size (default 4M)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: run the same checks on host memory, to try this script without a GPU")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check")
        return 0
    total, page_bytes = parse_size(args.total), parse_size(args.page_size)
    workdir = Path(tempfile.mkdtemp(prefix="gdskv-gpu-check-", dir=args.dir))
    failures: list[str] = []

    def step(title: str, fn: Callable[[], object]) -> None:
        print(title)
        try:
            result = fn()
            if isinstance(result, str):
                print(f"  {result}")
        except Exception:  # report every failing check, then the exit status says it
            failures.append(title)
            traceback.print_exc()

    made: dict[str, IoEngine] = {}
    try:
        step("platform", check_platform)
        made = engines(workdir)
        for label, engine in made.items():
            step(f"engine {label}: {DEVICE} tensors", lambda: check_engine_round_trips(label, engine, workdir))
            step(f"store over {label}: {DEVICE} page slots", lambda: check_store(label, engine, workdir))
        step(f"bench raw sequential, {page_bytes >> 20} MiB pages", lambda: raw_baseline(workdir, total, page_bytes))
        for label, engine in made.items():
            step(f"bench store over {label}, {page_bytes >> 20} MiB {DEVICE} pages",
                 lambda: short_bench(label, engine, workdir, total, page_bytes))
    finally:
        for engine in made.values():
            engine.close()
        shutil.rmtree(workdir, ignore_errors=True)
    print("gpu_check: " + ("all checks passed" if not failures else f"FAILED: {', '.join(failures)}"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
