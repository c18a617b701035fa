"""Round trips of page bytes through both I/O engines, with real files.

kvikio runs through the CUDA driver test double (``tests/fakecuda``) where no real driver exists:
the ``kvikio`` fixture loads it before the first kvikio I/O of this process, and one test repeats
a round trip in a fresh subprocess with ``KVIKIO_COMPAT_MODE=ON``.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from cache_helpers import drop_cached
from gdskv.io.base import IoEngine, Segment, ShortReadError
from gdskv.io.capabilities import cuda_driver_present, gds_available, kvikio_available
from gdskv.io import posix
from gdskv.io.posix import PosixEngine, aligned_host_buffer

try:
    from tests.fakecuda import ensure_libcuda
except ImportError:  # tests/ itself on sys.path (pytest's default "prepend" import mode)
    from fakecuda import ensure_libcuda

TESTS_DIR = Path(__file__).resolve().parent
KiB, MiB = 1 << 10, 1 << 20
PAGE_SIZES = [4 * KiB, 4 * KiB + 128, 3 * 4 * KiB + 7, 1 * MiB, 4 * MiB]
ENGINE_NAMES = ["posix", "posix-odirect", "posix-direct-writes", "kvikio"]


@pytest.fixture(scope="module")
def driver() -> str:
    """``"real"`` or ``"double"``: which libcuda kvikio will find in this process."""
    pytest.importorskip("kvikio", reason="kvikio is an optional extra (gdskv[cu12])")
    return ensure_libcuda()


@pytest.fixture(scope="module")
def engines(driver: str):
    from gdskv.io.kvikio_engine import KvikioEngine

    made = {
        "posix": PosixEngine(threads=4),
        "posix-odirect": PosixEngine(threads=4, o_direct=True),
        "posix-direct-writes": PosixEngine(threads=4, o_direct=True, direct_reads=False),
        "kvikio": KvikioEngine(threads=4, task_size=1 * MiB),
    }
    yield made
    for engine in made.values():
        engine.close()


@pytest.fixture(params=ENGINE_NAMES)
def engine(request: pytest.FixtureRequest, engines: dict[str, IoEngine]) -> IoEngine:
    return engines[request.param]


def _random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _aligned_tensor(nbytes: int) -> torch.Tensor:
    """A page-aligned CPU uint8 tensor, so O_DIRECT (posix) and direct writes (kvikio) engage."""
    return torch.frombuffer(aligned_host_buffer(nbytes), dtype=torch.uint8)


@pytest.mark.parametrize("nbytes", PAGE_SIZES)
def test_page_with_trailer_round_trip(engine: IoEngine, tmp_path: Path, nbytes: int) -> None:
    path = str(tmp_path / "chunk")
    page = _random_bytes(nbytes, seed=nbytes)
    trailer = os.urandom(128)
    wrote = engine.write(path, [Segment(0, page), Segment(nbytes, trailer)])
    assert isinstance(wrote, Future)
    assert wrote.result() == nbytes + 128
    assert os.path.getsize(path) == nbytes + 128

    back, back_trailer = torch.zeros(nbytes, dtype=torch.uint8), bytearray(128)
    assert engine.read(path, [Segment(0, back), Segment(nbytes, back_trailer)]).result() == nbytes + 128
    assert torch.equal(back, page)
    assert bytes(back_trailer) == trailer


@pytest.mark.parametrize("nbytes", [4 * KiB, 1 * MiB, 4 * MiB])
def test_aligned_memory_round_trip(engine: IoEngine, tmp_path: Path, nbytes: int) -> None:
    path = str(tmp_path / "chunk")
    page = _aligned_tensor(nbytes)
    page.copy_(_random_bytes(nbytes, seed=7))
    assert engine.write(path, [Segment(0, page)]).result() == nbytes
    back = _aligned_tensor(nbytes)
    assert engine.read(path, [Segment(0, back)]).result() == nbytes
    assert torch.equal(back, page)


def test_segments_of_several_dtypes_at_offsets(engine: IoEngine, tmp_path: Path) -> None:
    """Region slots of fp16 and bf16 pools (as uint8 views and as they are), with gaps between."""
    path = str(tmp_path / "chunk")
    fp16 = torch.randn(64 * KiB, dtype=torch.float16)
    bf16 = torch.randn(3 * 1000 + 1, dtype=torch.bfloat16)
    raw = _random_bytes(4 * KiB + 128, seed=3)
    layout = [(0, fp16), (200 * KiB, bf16.view(torch.uint8)), (300 * KiB + 5, raw), (400 * KiB, bf16)]
    total = sum(t.numel() * t.element_size() for _, t in layout)
    assert engine.write(path, [Segment(off, t) for off, t in layout]).result() == total

    backs = [(off, torch.empty_like(t)) for off, t in layout]
    assert engine.read(path, [Segment(off, t) for off, t in backs]).result() == total
    for (_, want), (_, got) in zip(layout, backs):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_write_truncates_an_existing_file(engine: IoEngine, tmp_path: Path) -> None:
    path = str(tmp_path / "chunk")
    engine.write(path, [Segment(0, _random_bytes(1 * MiB, seed=1))]).result()
    engine.write(path, [Segment(0, b"short")]).result()
    assert Path(path).read_bytes() == b"short"


def test_short_read_is_an_oserror(engine: IoEngine, tmp_path: Path) -> None:
    path = str(tmp_path / "chunk")
    engine.write(path, [Segment(0, _random_bytes(4 * KiB + 100, seed=2))]).result()
    with pytest.raises(ShortReadError):
        engine.read(path, [Segment(0, torch.empty(8 * KiB, dtype=torch.uint8))]).result()
    with pytest.raises(ShortReadError):  # the trailer read past the end of a truncated chunk
        engine.read(path, [Segment(8 * KiB, bytearray(128))]).result()


def test_missing_file_is_an_oserror(engine: IoEngine, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        engine.read(str(tmp_path / "absent"), [Segment(0, bytearray(16))]).result()
    with pytest.raises(FileNotFoundError):
        engine.write(str(tmp_path / "no-dir" / "chunk"), [Segment(0, b"x")]).result()


def test_batches_resolve_with_byte_counts(engine: IoEngine, tmp_path: Path) -> None:
    pages = {str(tmp_path / f"c{i}"): _random_bytes(MiB // 4 + i, seed=i) for i in range(24)}
    writes = engine.write_batch([(p, [Segment(0, t)]) for p, t in pages.items()])
    assert [f.result() for f in writes] == [t.numel() for t in pages.values()]
    backs = {p: torch.empty_like(t) for p, t in pages.items()}
    reads = engine.read_batch([(p, [Segment(0, t)]) for p, t in backs.items()])
    assert [f.result() for f in reads] == [t.numel() for t in pages.values()]
    assert all(torch.equal(backs[p], pages[p]) for p in pages)


def test_engines_read_each_others_files(engines: dict[str, IoEngine], tmp_path: Path) -> None:
    page = _random_bytes(1 * MiB + 128, seed=11)
    for writer in ENGINE_NAMES:
        path = str(tmp_path / writer)
        engines[writer].write(path, [Segment(0, page)]).result()
        for reader in ENGINE_NAMES:
            back = torch.empty_like(page)
            engines[reader].read(path, [Segment(0, back)]).result()
            assert torch.equal(back, page), (writer, reader)


def test_kvikio_reports_its_mode(engines: dict[str, IoEngine], driver: str) -> None:
    kvikio_engine = engines["kvikio"]
    assert kvikio_engine.name == "kvikio" and "kvikio" in kvikio_engine.describe()
    assert not engines["posix"].gds_active
    if driver == "double":
        assert not kvikio_engine.gds_active
        assert "compat" in kvikio_engine.describe()


def test_capability_probes_never_raise(driver: str) -> None:
    assert kvikio_available()
    present = cuda_driver_present()
    assert isinstance(present, bool)
    if driver == "double":
        assert not present, "the driver test double must never count as a CUDA driver"
    assert isinstance(gds_available(), bool)


def test_auto_picks_kvikio_only_where_it_moves_pages_through_gds(driver: str, monkeypatch) -> None:
    """Without GDS kvikio's compat mode is a slower POSIX path (4x at 256 KiB on an H200 machine):
    ``auto`` takes the POSIX engine there, even with a CUDA device present, and kvikio where GDS
    is available; an engine named in the config is taken as asked."""
    import gdskv.io
    from gdskv.config import GdsKvConfig
    from gdskv.io import capabilities, engine_choice

    assert engine_choice(GdsKvConfig(engine="auto")) == ("kvikio" if gds_available() else "posix")
    if driver == "double":  # a device claimed; the double's cuFile reports no GDS
        for module in (capabilities, gdskv.io):
            monkeypatch.setattr(module, "cuda_driver_present", lambda: True, raising=False)
        monkeypatch.setattr(capabilities, "gds_available", functools.lru_cache(maxsize=1)(capabilities.gds_available.__wrapped__))
        monkeypatch.setattr(gdskv.io, "gds_available", capabilities.gds_available)
        assert not capabilities.gds_available()
        assert engine_choice(GdsKvConfig(engine="auto")) == "posix"
    assert engine_choice(GdsKvConfig(engine="kvikio")) == "kvikio"
    assert engine_choice(GdsKvConfig(engine="posix")) == "posix"


def test_kvikio_asked_for_without_gds_is_built_with_a_warning(driver: str, caplog) -> None:
    from gdskv.config import GdsKvConfig
    from gdskv.io import make_engine

    with caplog.at_level("WARNING", logger="gdskv.io"):
        engine = make_engine(GdsKvConfig(engine="kvikio"))
    try:
        assert engine.name == "kvikio"
        if not engine.gds_active:
            assert "no GPUDirect Storage" in caplog.text and "compat mode" in caplog.text
        else:
            assert "GPUDirect" not in caplog.text
    finally:
        engine.close()


def test_kvikio_round_trip_in_a_fresh_process(driver: str, tmp_path: Path) -> None:
    """The double loaded by a new process before its first kvikio I/O, with compat mode forced."""
    script = textwrap.dedent(
        """
        import sys, torch
        from fakecuda import ensure_libcuda
        which = ensure_libcuda()
        from gdskv.io.base import Segment
        from gdskv.io.kvikio_engine import KvikioEngine
        engine = KvikioEngine(threads=2, task_size=256 * 1024)
        page = torch.randn(300_001, dtype=torch.bfloat16)
        path = sys.argv[1]
        assert engine.write(path, [Segment(0, page), Segment(600_002, b"trailer")]).result() == 600_009
        back, trailer = torch.empty_like(page), bytearray(7)
        assert engine.read(path, [Segment(0, back), Segment(600_002, trailer)]).result() == 600_009
        assert torch.equal(back.view(torch.uint8), page.view(torch.uint8)) and trailer == b"trailer"
        engine.close()
        print(which, engine.gds_active)
        """
    )
    env = dict(os.environ, KVIKIO_COMPAT_MODE="ON")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), str(TESTS_DIR.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "chunk")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [driver, "False"]


def test_bad_memory_is_the_callers_error(engine: IoEngine, tmp_path: Path) -> None:
    """Non-contiguous or read-only memory is a ValueError, and the file is still closed."""
    path = str(tmp_path / "chunk")
    engine.write(path, [Segment(0, _random_bytes(8 * KiB, seed=5))]).result()
    strided = torch.zeros(8 * KiB, dtype=torch.uint8)[::2]
    with pytest.raises(ValueError):
        engine.read(path, [Segment(0, bytearray(16)), Segment(16, strided)]).result()
    with pytest.raises((ValueError, TypeError, BufferError)):  # posix: BufferError from preadv
        engine.read(path, [Segment(0, b"read-only memory")]).result()


def test_store_bench_runs_and_reports_ratios(driver: str, tmp_path: Path) -> None:
    """``gdskv bench`` end to end on a few MiB: every subject measured, pages verified, ratios."""
    from gdskv.bench import BenchOptions, format_report, run

    options = BenchOptions(directory=str(tmp_path), total_bytes=4 * MiB, page_sizes=(1 * MiB, 64 * KiB), rounds=1,
                           engines=("posix", "posix+o_direct", "posix+direct_writes", "kvikio"),
                           pools=("torch", "hugepage"), peers=())
    report = run(options)
    subjects = {row["subject"] for row in report["results"] if row["page_bytes"] == 64 * KiB}
    stores = {f"store:{e}@{p}" for e in options.engines for p in options.pools}
    services = {f"service:host-tier@{p}" for p in options.pools}
    assert subjects == {"ceiling", "raw", "raw+o_direct", "files", "torch.save"} | stores | services
    store_row = next(r for r in report["results"] if r["subject"] == "store:kvikio@torch")
    assert set(store_row["vs_raw"]) == {"save", "load_cold", "load_warm"} and store_row["save_gbps"] > 0
    assert store_row["vs_ceiling"] > 0 and "vs_vllm" not in store_row
    assert "store:kvikio@hugepage" in format_report(report)
    assert list(tmp_path.iterdir()) == []  # the bench cleans up after itself


def test_posix_o_direct_works_on_tmpfs() -> None:
    """Older kernels' tmpfs refuses O_DIRECT with EINVAL; the engine must keep working there
    (buffered, after one warning), and where tmpfs accepts O_DIRECT, directly."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) here")
    with tempfile.TemporaryDirectory(dir=shm) as d:
        engine = PosixEngine(o_direct=True)
        src = torch.arange(8192, dtype=torch.int32).view(torch.uint8)[:16384]
        path = os.path.join(d, "chunk")
        assert engine.write(path, [Segment(0, src)]).result() == src.numel()
        dst = torch.zeros_like(src)
        assert engine.read(path, [Segment(0, dst)]).result() == src.numel()
        assert torch.equal(src, dst)
        engine.close()


def test_calling_thread_forms_match_the_futures(engine: IoEngine, tmp_path: Path) -> None:
    """``read_now`` / ``write_now`` (what the transfer layer calls) move the same bytes, and a
    truncated file is a ShortReadError or another OSError there too."""
    path = str(tmp_path / "chunk")
    regions = [_random_bytes(64 * KiB, seed=1), _random_bytes(3000, seed=2)]
    trailer = os.urandom(128)
    segs = [Segment(0, regions[0]), Segment(64 * KiB, regions[1]), Segment(64 * KiB + 3000, trailer)]
    assert engine.write_now(path, segs) == 64 * KiB + 3000 + 128
    back = [torch.zeros_like(r) for r in regions]
    tail = bytearray(128)
    assert engine.read_now(path, [Segment(0, back[0]), Segment(64 * KiB, back[1]), Segment(64 * KiB + 3000, tail)]) == 64 * KiB + 3128
    assert all(torch.equal(a, b) for a, b in zip(regions, back)) and bytes(tail) == trailer
    os.truncate(path, 64 * KiB + 100)
    with pytest.raises(OSError):
        engine.read_now(path, [Segment(0, back[0]), Segment(64 * KiB, back[1]), Segment(64 * KiB + 3000, tail)])



def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache, by ``mincore(2)`` on a private mapping of it: a check
    independent of the engine's own ``cachestat`` probe."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    npages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
        vec = (ctypes.c_ubyte * npages)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec)


@pytest.mark.parametrize("aligned", [True, False], ids=["huge-page-pool", "torch-tensor"])
def test_cold_chunks_are_read_direct_and_cached_ones_from_the_cache(tmp_path: Path, aligned: bool) -> None:
    """With direct reads, a chunk not in the page cache is read with O_DIRECT (it stays out of the
    cache), the unaligned trailer and unaligned page memory coming through the staging buffer; a
    chunk in the cache is read from it. The buffered engine fills the cache on a cold read."""
    nbytes = 1 * MiB
    page = _random_bytes(nbytes, seed=5)
    trailer = os.urandom(128)
    path = str(tmp_path / "chunk")
    buffered, direct = PosixEngine(threads=1), PosixEngine(threads=1, o_direct=True)
    try:
        buffered.write_now(path, [Segment(0, page), Segment(nbytes, trailer)])
        drop_cached(path)
        if _resident_pages(path):
            pytest.skip("this file system keeps the file's pages cached after POSIX_FADV_DONTNEED")

        back = _aligned_tensor(nbytes) if aligned else torch.zeros(nbytes, dtype=torch.uint8)
        back.zero_()
        tail = bytearray(128)
        assert direct.read_now(path, [Segment(0, back), Segment(nbytes, tail)]) == nbytes + 128
        assert torch.equal(back, page) and bytes(tail) == trailer
        assert _resident_pages(path) == 0, "a cold chunk must be read with O_DIRECT"

        back.zero_()
        assert buffered.read_now(path, [Segment(0, back), Segment(nbytes, tail)]) == nbytes + 128
        assert torch.equal(back, page)
        assert _resident_pages(path) == -(-(nbytes + 128) // 4096)
        fd = os.open(path, os.O_RDONLY)
        try:  # the probe that sends this read to the cache (False where the kernel lacks cachestat)
            assert posix._cached(fd, [Segment(0, back), Segment(nbytes, tail)]) == posix._cachestat_works
        finally:
            os.close(fd)

        back.zero_()
        assert direct.read_now(path, [Segment(0, back), Segment(nbytes, tail)]) == nbytes + 128
        assert torch.equal(back, page) and bytes(tail) == trailer
    finally:
        buffered.close()
        direct.close()


def _cache_pages(path: str, nbytes: int, drop: tuple[int, int]) -> None:
    """Every page of the file cached in 4 KiB folios (readahead off), then the byte range
    ``drop`` (``(start, end)``, end 0: to the end) dropped from the cache."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the write's folios may be large
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # 4 KiB folios, which a range drops
        for off in range(0, nbytes, 4096):
            os.pread(f.fileno(), 4096, off)
        os.posix_fadvise(f.fileno(), drop[0], drop[1] and drop[1] - drop[0], os.POSIX_FADV_DONTNEED)


@pytest.mark.parametrize("native", [False, True], ids=["per-page", "native-batch"])
@pytest.mark.parametrize("nbytes, drop, through_cache", [
    (256 * KiB, (256 * KiB, 0), True),   # the trailer's page reclaimed
    (256 * KiB, (0, 0), False),          # nothing cached
    (1 * MiB, (256 * KiB, 0), True),     # only the head cached
    (1 * MiB, (0, 256 * KiB), False),    # only the head reclaimed
], ids=["trailer-page-reclaimed", "cold", "head-cached", "head-reclaimed"])
def test_the_page_cache_probe_decides_by_a_chunks_head(tmp_path: Path, native: bool, nbytes: int,
                                                        drop: tuple[int, int], through_cache: bool) -> None:
    """Whether a chunk is read through the page cache is decided by its first 256 KiB
    (``posix.CACHED_PROBE_BYTES``: the probe walks every folio it asks about; chunks are written
    and read whole): through the cache, which fetches the missing pages (all of them resident
    after), when most of the head is cached, so a warm chunk whose trailer's page was reclaimed is
    not read from the disk whole; with O_DIRECT, leaving the cache as it was, when it is not."""
    from gdskv.io import batch as batchio
    from gdskv import format as fmt

    if native and not batchio.available():
        pytest.skip("the native batch path (gdskv.io._batchio) is not built in this environment")
    assert posix.CACHED_PROBE_BYTES == 256 * KiB
    page = _random_bytes(nbytes, seed=6)
    trailer = os.urandom(128)
    engine = PosixEngine(threads=1, o_direct=True)
    path, total = str(tmp_path / "chunk"), -(-(nbytes + 128) // 4096)
    try:
        engine.write_now(path, [Segment(0, page), Segment(nbytes, trailer)])
        _cache_pages(path, nbytes + 128, drop)
        before = _resident_pages(path)
        if before != total - -(-((drop[1] or nbytes + 128) - drop[0]) // 4096):
            pytest.skip("this file system keeps the file's pages cached after POSIX_FADV_DONTNEED")
        back, tail = torch.zeros(nbytes, dtype=torch.uint8), bytearray(128)
        if native:
            root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                [got] = engine.read_chunks_now(root, [("chunk", batchio.pieces_of([back], tail))], 1)
            finally:
                os.close(root)
            assert got.err == 0 and got.crc == fmt.crc32c_at(page.data_ptr(), nbytes)
        else:
            assert engine.read_now(path, [Segment(0, back), Segment(nbytes, tail)]) == nbytes + 128
        assert torch.equal(back, page) and bytes(tail) == trailer
        assert _resident_pages(path) == (total if through_cache else before)
    finally:
        engine.close()


def test_direct_read_of_a_truncated_chunk_is_a_short_read(tmp_path: Path) -> None:
    path = str(tmp_path / "chunk")
    nbytes = 64 * KiB
    engine = PosixEngine(threads=1, o_direct=True)
    try:
        engine.write_now(path, [Segment(0, _aligned_tensor(nbytes)), Segment(nbytes, os.urandom(128))])
        os.truncate(path, nbytes + 100)
        drop_cached(path)
        with pytest.raises(ShortReadError):
            engine.read_now(path, [Segment(0, _aligned_tensor(nbytes)), Segment(nbytes, bytearray(128))])
    finally:
        engine.close()


def test_kvikio_follows_the_o_direct_setting(driver: str, tmp_path: Path) -> None:
    """``o_direct = "all"`` makes kvikio read page-aligned memory with O_DIRECT in compat mode (a
    cold chunk stays out of the page cache); ``"off"`` turns its direct writes off too."""
    import kvikio.defaults

    from gdskv.config import GdsKvConfig
    from gdskv.io import make_engine

    nbytes = 1 * MiB
    page = _aligned_tensor(nbytes)
    page.copy_(_random_bytes(nbytes, seed=9))
    path = str(tmp_path / "chunk")
    try:
        engine = make_engine(GdsKvConfig(store_path=str(tmp_path), engine="kvikio", o_direct="all"))
        assert kvikio.defaults.get("auto_direct_io_read") and kvikio.defaults.get("auto_direct_io_write")
        engine.write_now(path, [Segment(0, page), Segment(nbytes, os.urandom(128))])
        drop_cached(path)
        if _resident_pages(path):
            pytest.skip("this file system keeps the file's pages cached after POSIX_FADV_DONTNEED")
        back = _aligned_tensor(nbytes)
        back.zero_()
        engine.read_now(path, [Segment(0, back), Segment(nbytes, bytearray(128))])
        assert torch.equal(back, page)
        if driver == "double" or not engine.gds_active:
            assert _resident_pages(path) <= 1, "only the buffered trailer may be cached"
        engine.close()
        make_engine(GdsKvConfig(store_path=str(tmp_path), engine="kvikio", o_direct="off")).close()
        assert not kvikio.defaults.get("auto_direct_io_read") and not kvikio.defaults.get("auto_direct_io_write")
    finally:  # back to the settings of the module's kvikio engine
        from gdskv.io.kvikio_engine import KvikioEngine

        KvikioEngine(threads=4, task_size=1 * MiB).close()


def _extents(path: str) -> list[tuple[int, int, int]]:
    """``(logical, physical, length)`` of each extent of ``path`` by the FIEMAP ioctl."""
    import fcntl
    import struct

    count = 16
    req = bytearray(32 + 56 * count)
    struct.pack_into("QQIIII", req, 0, 0, 2**64 - 1, 1, 0, count, 0)  # FIEMAP_FLAG_SYNC
    with open(path, "rb") as f:
        fcntl.ioctl(f.fileno(), 0xC020660B, req, True)  # FS_IOC_FIEMAP
    mapped = struct.unpack_from("I", req, 20)[0]
    return [struct.unpack_from("QQQ", req, 32 + 56 * i) for i in range(mapped)]


def test_direct_writes_lay_a_chunk_out_in_one_piece(tmp_path: Path) -> None:
    """The payload goes with O_DIRECT and the trailer through the page cache; the file's blocks
    are allocated together first, so a cold load is one device request, not two far apart."""
    path = str(tmp_path / "chunk")
    nbytes = 1 * MiB
    engine = PosixEngine(threads=1, o_direct=True)
    try:
        engine.write_now(path, [Segment(0, _aligned_tensor(nbytes)), Segment(nbytes, os.urandom(128))])
    finally:
        engine.close()
    try:
        extents = _extents(path)
    except OSError:
        pytest.skip("this file system has no FIEMAP")
    assert sum(length for _, _, length in extents) >= nbytes + 128
    for (log_a, phys_a, len_a), (log_b, phys_b, _) in zip(extents, extents[1:]):
        assert log_b == log_a + len_a and phys_b == phys_a + len_a, f"chunk split on disk: {extents}"


# --- kvikio: write order (issue 10, item 4) and cuFile buffer registration (item 8) -----------

BLOCK = 4 * KiB


class _WriteRecorder:
    """Stands in for the ``kvikio`` module inside one ``KvikioEngine``: its ``CuFile`` handles pass
    every call on to kvikio's own, and record each ``pwrite`` as in flight from its issue until its
    future's ``get()`` returns. Every write issued while another write in flight touches one of
    its 4 KiB blocks is a conflict, and so is a write kvikio would cut into tasks at offsets off a
    block boundary (its tasks run at once and would share blocks)."""

    def __init__(self, kvikio: object) -> None:
        self._kvikio = kvikio
        self.in_flight: list[tuple[int, int]] = []  # (first block, last block)
        self.conflicts: list[str] = []
        self.writes: list[tuple[int, int, int]] = []  # (offset, size, task size)
        self.most_in_flight = 0

    def __getattr__(self, name: str):
        return getattr(self._kvikio, name)

    def CuFile(self, path: str, flags: str = "r"):  # noqa: N802 (kvikio's name)
        return _RecordingHandle(self, self._kvikio.CuFile(path, flags))

    def issued(self, size: int, offset: int, task_size) -> tuple[int, int]:
        import kvikio.defaults

        task = task_size or kvikio.defaults.get("task_size")
        self.writes.append((offset, size, task))
        blocks = (offset // BLOCK, (offset + size - 1) // BLOCK)
        for first, last in self.in_flight:
            if first <= blocks[1] and blocks[0] <= last:
                self.conflicts.append(f"write of {size} B at {offset} issued while blocks {first}..{last} were being written")
        if size > task and (offset % BLOCK or task % BLOCK):
            self.conflicts.append(f"write of {size} B at {offset} cut into {task} B tasks off block boundaries")
        self.in_flight.append(blocks)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        return blocks


class _RecordingHandle:
    def __init__(self, recorder: _WriteRecorder, handle) -> None:
        self._recorder, self._handle = recorder, handle

    def __getattr__(self, name: str):
        return getattr(self._handle, name)

    def pwrite(self, buf, size=None, file_offset=0, task_size=None):
        blocks = self._recorder.issued(size, file_offset, task_size)
        future = self._handle.pwrite(buf, size, file_offset, task_size)
        return _RecordingFuture(self._recorder, future, blocks)


class _RecordingFuture:
    def __init__(self, recorder: _WriteRecorder, future, blocks: tuple[int, int]) -> None:
        self._recorder, self._future, self._blocks = recorder, future, blocks

    def get(self) -> int:
        try:
            return self._future.get()
        finally:
            if self._blocks in self._recorder.in_flight:
                self._recorder.in_flight.remove(self._blocks)

    def done(self) -> bool:
        return self._future.done()


REGION_SPLITS = [
    [5000],  # one region, unaligned: the trailer shares its last block
    [4 * KiB * 3 + 7],
    [64 * KiB, 64 * KiB, 3000],  # aligned regions, then an unaligned one
    [3000, 5000, 100_001],  # regions meeting inside blocks
    [1 * MiB + 1, 300 * KiB - 5, 4 * KiB],  # above the 16 KiB GDS threshold, split into tasks
]


@pytest.fixture
def recorded_kvikio(driver: str):
    """A kvikio engine with 64 KiB tasks (so large regions are split) whose kvikio calls are recorded."""
    from gdskv.io.kvikio_engine import KvikioEngine

    engine = KvikioEngine(threads=2, task_size=64 * KiB)
    recorder = _WriteRecorder(engine._kvikio)
    engine._kvikio = recorder
    yield engine, recorder
    engine.close()
    KvikioEngine(threads=4, task_size=1 * MiB).close()  # back to the module's engine settings


@pytest.mark.parametrize("sizes", REGION_SPLITS, ids=lambda s: "+".join(map(str, s)))
def test_kvikio_writes_in_flight_never_share_a_file_block(recorded_kvikio, tmp_path: Path, sizes: list[int]) -> None:
    """A chunk's regions and its trailer: no two writes in flight at once touch the same 4 KiB
    block (under GDS an unaligned cuFile write rewrites its whole block), and the bytes land."""
    engine, recorder = recorded_kvikio
    regions = [_random_bytes(n, seed=n) for n in sizes]
    trailer = os.urandom(128)
    segs, off = [], 0
    for r in regions:
        segs.append(Segment(off, r))
        off += r.numel()
    segs.append(Segment(off, trailer))
    path = str(tmp_path / "chunk")
    assert engine.write_now(path, segs) == off + 128
    assert recorder.conflicts == []
    assert len(recorder.writes) == len(segs) and recorder.in_flight == []
    data = Path(path).read_bytes()
    assert data == b"".join(r.numpy().tobytes() for r in regions) + trailer


def test_kvikio_block_aligned_regions_are_written_at_once(recorded_kvikio, tmp_path: Path) -> None:
    """The order costs a wait only where segments share a block: aligned regions go together."""
    engine, recorder = recorded_kvikio
    regions = [_random_bytes(64 * KiB, seed=i) for i in range(4)]
    segs = [Segment(i * 64 * KiB, r) for i, r in enumerate(regions)] + [Segment(256 * KiB, os.urandom(128))]
    engine.write(str(tmp_path / "chunk"), segs).result()
    assert recorder.conflicts == [] and recorder.most_in_flight == 5


def test_kvikio_failed_write_still_waits_for_every_issued_write(recorded_kvikio, tmp_path: Path) -> None:
    """A segment the engine cannot take (strided memory) ends the call: nothing issued outlives it."""
    engine, recorder = recorded_kvikio
    strided = torch.zeros(8 * KiB, dtype=torch.uint8)[::2]
    with pytest.raises(ValueError):
        engine.write_now(str(tmp_path / "chunk"), [Segment(0, _random_bytes(5000, seed=1)), Segment(5000, strided)])
    assert recorder.in_flight == []


def test_kvikio_register_buffers_is_a_no_op_without_gds(engines: dict[str, IoEngine]) -> None:
    engine = engines["kvikio"]
    if engine.gds_active:
        pytest.skip("GDS is active here")
    pool = torch.zeros(4, 1024)
    assert engine.register_buffers([pool, pool[1]]) == 0 and engine.registered_buffers == 0


def test_kvikio_register_buffers_goes_through_kvikio_once_per_allocation(driver: str, monkeypatch) -> None:
    """With GDS (pretended): each allocation registered once, deregistered at close; a registration
    cuFile refuses (here: the driver double refuses every call) is left out, not raised."""
    import types

    from gdskv.io import kvikio_engine
    from gdskv.io.kvikio_engine import KvikioEngine

    monkeypatch.setattr(kvikio_engine, "_registrable", lambda t: isinstance(t, torch.Tensor) and t.numel() > 0)
    engine = KvikioEngine(threads=1, task_size=1 * MiB)
    engine._gds = True
    k_pool, v_pool = torch.zeros(8, 256), torch.zeros(8, 256, dtype=torch.bfloat16)
    real = engine._kvikio
    if driver == "double":  # kvikio's own registration call reaches the double, which refuses it
        assert engine.register_buffers([k_pool]) == 0 and engine.registered_buffers == 0
    calls: list[tuple[str, int]] = []
    engine._kvikio = types.SimpleNamespace(
        memory_register=lambda buf: calls.append(("register", buf.__array_interface__["data"][0])),
        memory_deregister=lambda buf: calls.append(("deregister", buf.__array_interface__["data"][0])))
    try:
        assert engine.register_buffers([k_pool, v_pool, k_pool]) == 2
        assert engine.register_buffers([v_pool]) == 0 and engine.registered_buffers == 2
        assert calls == [("register", k_pool.data_ptr()), ("register", v_pool.data_ptr())]
    finally:
        engine.close()
        engine._kvikio = real
        KvikioEngine(threads=4, task_size=1 * MiB).close()
    assert calls[2:] == [("deregister", k_pool.data_ptr()), ("deregister", v_pool.data_ptr())]
    assert engine.registered_buffers == 0


def test_o_direct_writes_open_a_direct_descriptor_only_for_memory_that_can_use_it(tmp_path: Path, monkeypatch) -> None:
    """Plain torch CPU tensors (64-byte aligned) cannot go O_DIRECT: their saves open no second
    descriptor and preallocate nothing (a page's bytes are identical either way); page-aligned
    memory does go direct."""
    engine = PosixEngine(threads=1, o_direct=True)
    opened = []
    real = engine._open_direct
    monkeypatch.setattr(engine, "_open_direct", lambda fd, path: opened.append(path) or real(fd, path))
    raw = torch.empty(64 * KiB + 8192, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096 + 64  # 64 bytes past a page boundary, as torch's allocator hands out
    plain = raw[start:start + 64 * KiB]
    plain.copy_(torch.arange(64 * KiB) % 251)
    aligned = torch.frombuffer(aligned_host_buffer(64 * KiB), dtype=torch.uint8)
    aligned.copy_(plain)
    trailer = bytes(range(100))
    for name, page in (("plain", plain), ("aligned", aligned)):
        engine.write_now(str(tmp_path / name), [Segment(0, page), Segment(64 * KiB, trailer)])
        assert (tmp_path / name).read_bytes() == bytes(plain.numpy()) + trailer
    assert opened == [str(tmp_path / "aligned")]
    engine.close()


@pytest.mark.parametrize("nbytes", [1, 4 * KiB, 300 * KiB, 1056 * KiB, 2 * MiB, 5 * MiB + 1])
def test_an_aligned_host_buffer_lies_in_whole_huge_pages_of_its_mapping(nbytes: int) -> None:
    """Every 2 MiB-aligned range the buffer touches lies inside the mapping advised to use huge
    pages, so transparent huge pages can back all of it. A native call's staging buffer (~1 MiB:
    4 threads of 256 KiB chunks) used to end past its mapping's last whole huge page; the kernel
    backed that tail with 4 KiB pages, O_DIRECT reads into which were slow on the development VM,
    and cold 256 KiB loads into torch pools ran at 0.68-0.84x loads in place (0.94-0.99x after)."""
    import ctypes

    buf = aligned_host_buffer(nbytes)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    region = buf.obj
    first = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert len(buf) == nbytes and start % posix.HUGE_PAGE == 0
    assert first <= start and -(-(start + nbytes) // posix.HUGE_PAGE) * posix.HUGE_PAGE <= first + len(region)


def test_the_cuda_runtime_is_found_among_the_mapped_files_by_its_name_only():
    """``runtime_library``: the ``libcudart.so*`` that torch mapped (whose ``cudaMemcpyAsync``
    ``gdskv.hosttier`` calls), never a library merely named like it or a line without a path."""
    from gdskv.io.capabilities import cuda_memcpy_async, runtime_library

    maps = ["7f00-7f01 r--p 00000000 fd:01 12 /usr/lib/libcudart_static_helper.so\n",
            "7f01-7f02 rw-p 00000000 00:00 0 \n",
            "7f02-7f03 r-xp 00000000 fd:01 13 /opt/venv/lib/nvidia/cu13/lib/libcudart.so.13\n",
            "7f03-7f04 r-xp 00000000 fd:01 14 /opt/other/libcudart.so.12\n"]
    assert runtime_library(maps) == "/opt/venv/lib/nvidia/cu13/lib/libcudart.so.13"
    assert runtime_library(maps[:2]) is None
    assert runtime_library(["7f00-7f01 r--p 00000000 00:00 0                  [heap]\n"]) is None
    if not torch.cuda.is_available():
        assert cuda_memcpy_async() == 0
