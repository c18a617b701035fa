#!/usr/bin/env python3
"""Acceptance test for a GPU machine: the paths CI cannot run, as one table; exit 0 only when every check passed.

    python scripts/gpu_check.py --dir DIR [--require-gds] [--max-reserved-growth 512M]

Refuses to run (exit 2, one line saying why) where torch has no CUDA device, where ``--dir`` is
missing or not a directory, or where it lies on tmpfs, overlay, ramfs or squashfs (GDS cannot
serve them, and the page cache would hide the disk). The checks, one row each:

- ``platform``: device, torch, kvikio, compat mode, cuFile's ``is_gds_available``, the file system;
- ``kvikio round trips``: CUDA pages above kvikio's 16 KiB GDS threshold, with unaligned lengths and
  several regions meeting inside file blocks, plus the host trailer; bytes compared;
- ``GDS in use``: which kvikio backend moved those bytes (``kvikio.SummaryMonitor``: GDS against
  POSIX, i.e. compat mode); without GDS this row is SKIP, or FAIL under ``--require-gds``; GDS
  reported available but no byte moved through it is a FAIL;
- ``concurrent saves``: 32 pages of a two-region pool (unaligned regions) saved at once through
  ``PageTransfer`` from CUDA slots, loaded into a zeroed pool, compared; a flipped byte is CORRUPT;
- ``batched transfers``: 64 CUDA pages saved as one ``save_pages`` batch behind one event
  recorded after a producer kernel, then loaded back verified (the native path, the pages staged
  through one pinned buffer where there is no GDS);
- ``native device copies``: 64 pages of two regions with distinct bytes, in shuffled slots of a
  CUDA pool, saved and loaded on the POSIX engine (what ``auto`` takes without GDS: pages staged
  through pinned spans) with each span's copies queued in one native ``cudaMemcpyAsync`` call
  (``gdskv.copies._queue_all``), then with one torch copy per region; both compared with the
  source, GB/s of both (page cache warm); the native call must have run, and only where it is on;
- ``save ready event`` / ``save race control``: a producer kernel on a side stream
  (``torch.cuda._sleep`` then a fill of the page); saved with the event recorded after it, the
  chunk must hold the filled bytes; saved without it (negative control) it must not, else the
  check cannot tell and the row is INCONCLUSIVE (the run fails);
- ``load ready event`` / ``load race control``: a consumer kernel on a side stream (sleep, then a
  copy of the slot); loaded with the event the consumer must see the old bytes, without it (the
  negative control) the loaded ones;
- ``device checksum``: ``poly_hash`` of CUDA tensors against ``poly_hash_host`` of the same bytes,
  and CRC32C of CUDA segments against the host's, at several lengths and splits;
- ``second device``: a page on ``cuda:1`` saved and loaded (SKIP where there is one device);
- ``peak reserved memory``: growth of ``torch.cuda.max_memory_reserved`` over the pools while the
  transfers ran, against ``--max-reserved-growth``;
- ``TensorRT-LLM worker``: ``GdsKvScheduler`` / ``GdsKvWorker`` driven through one prefill with a
  real CUDA stream (its saves wait on the stream's event), then a fresh worker loads the pages;
- ``MAX connector``: ``GdsKvConnector`` over CUDA blocks with MAX's stream given: blocks written
  late by a kernel on it are offloaded as written, then loaded into other blocks, compared;
- ``host tier``: pages saved from CUDA through ``KvService`` with the host tier on (pinned) are
  loaded back as tier hits, and with it off from disk, compared, GB/s of both; on the kvikio
  engine and on the POSIX one (staged spans: the tier filled in the native pass).

``--device cpu`` is a dry run of the checks that host memory allows: it prints the table and
exits 3, never 0. The whole run takes well under 5 minutes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gdskv.bench import sigterm_as_exit  # noqa: E402
from gdskv.config import parse_size  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
REFUSED_FS = frozenset({"tmpfs", "overlay", "ramfs", "devtmpfs", "squashfs"})
PASS, FAIL, SKIP, INCONCLUSIVE = "PASS", "FAIL", "SKIP", "INCONCLUSIVE"
EXIT_PASSED, EXIT_FAILED, EXIT_REFUSED, EXIT_DRY_RUN = 0, 1, 2, 3
SLEEP_CYCLES = 400_000_000  # ~0.2-0.3 s of a spinning kernel on current GPUs: far longer than a save
# Pages above kvikio's 16 KiB GDS threshold; region splits meet inside 4 KiB blocks and leave the
# trailer sharing the payload's last block.
ROUND_TRIP_SPLITS = ([20 * KiB + 7], [1 * MiB], [64 * KiB + 3, 48 * KiB - 3, 20 * KiB + 1],
                     [2 * MiB + 4096 + 1, 1 * MiB - 1])


@dataclass
class Result:
    """One row of the table."""

    check: str
    status: str  # PASS, FAIL, SKIP (the check does not apply here) or INCONCLUSIVE
    detail: str = ""


# --- the pure parts (unit-tested on CPU by tests/test_gpu_check.py) -----------------------------

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True,
                        help="directory on the disk under test (a real file system: not tmpfs or overlay)")
    parser.add_argument("--require-gds", action="store_true",
                        help="fail unless kvikio moved the pages through GDS (not its compat mode)")
    parser.add_argument("--max-reserved-growth", default="512M",
                        help="most that torch.cuda.max_memory_reserved may grow over the pools during transfers")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: dry run on host memory (never exits 0)")
    return parser.parse_args(argv)


def mount_fs_type(mountinfo: str, path: str) -> Optional[str]:
    """The file-system type of the mount holding ``path`` (absolute, links resolved), from the
    text of ``/proc/self/mountinfo``: the longest mount point that is ``path`` or a parent."""
    best, best_type = -1, None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mount_point = fields[4].replace("\\040", " ")
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > best:
            best, best_type = len(mount_point), right.split()[0]
    return best_type


def refusal(cuda_available: bool, directory: str, is_dir: bool, fs_type: Optional[str]) -> Optional[str]:
    """Why this run cannot be an acceptance test (one line), or None when it can start."""
    if not cuda_available:
        return "no CUDA device here (torch.cuda.is_available() is False): the GPU paths cannot be checked"
    if not is_dir:
        return f"--dir {directory} is not a directory"
    if fs_type in REFUSED_FS:
        return f"--dir {directory} is on {fs_type}, not on a disk's file system: GDS cannot serve it; pass a directory on the NVMe under test"
    return None


def format_table(results: Sequence[Result]) -> str:
    """The results as one fixed-width table."""
    width = max([len("check")] + [len(r.check) for r in results])
    lines = [f"{'check':<{width}}  {'status':<12}  detail", f"{'-' * width}  {'-' * 12}  {'-' * 6}"]
    for r in results:
        lines.append(f"{r.check:<{width}}  {r.status:<12}  {r.detail}".rstrip())
    return "\n".join(lines)


def verdict(results: Sequence[Result], dry_run: bool = False) -> tuple[int, str]:
    """The exit status and the last line: 0 only when every row passed (SKIP rows are checks that
    do not apply to this machine) and at least one did; a dry run never passes."""
    failed = [r.check for r in results if r.status == FAIL]
    unsure = [r.check for r in results if r.status == INCONCLUSIVE]
    if failed or unsure:
        parts = ([f"FAILED: {', '.join(failed)}"] if failed else []) + ([f"INCONCLUSIVE: {', '.join(unsure)}"] if unsure else [])
        return EXIT_FAILED, "gpu_check: " + "; ".join(parts)
    if not any(r.status == PASS for r in results):
        return EXIT_FAILED, "gpu_check: no check ran"
    if dry_run:
        return EXIT_DRY_RUN, "gpu_check: dry run on host memory: the checks that ran passed, but this is no GPU acceptance"
    return EXIT_PASSED, "gpu_check: all checks passed"


def race_result(name: str, with_event_ok: bool, control_showed_race: bool) -> list[Result]:
    """The two rows of a readiness-event check: the run with the event must be right, and the
    negative control without it must show the race, else nothing was proved."""
    rows = [Result(f"{name} ready event", PASS if with_event_ok else FAIL,
                   "event awaited: the transfer saw the stream's work" if with_event_ok
                   else "the transfer ran before the stream's work although the event was passed")]
    if control_showed_race:
        rows.append(Result(f"{name} race control", PASS, "without the event the race shows: the check has teeth"))
    else:
        rows.append(Result(f"{name} race control", INCONCLUSIVE,
                           "without the event no race showed, so the run with it proves nothing; "
                           "raise SLEEP_CYCLES"))
    return rows


def gds_result(gds_available: bool, gds_bytes: int, posix_bytes: int, require_gds: bool) -> Result:
    """The ``GDS in use`` row from what kvikio's statistics say each backend moved."""
    moved = f"GDS {gds_bytes / MiB:.1f} MiB, POSIX (compat) {posix_bytes / MiB:.1f} MiB"
    if gds_bytes > 0:
        return Result("GDS in use", PASS, moved)
    if gds_available:
        return Result("GDS in use", FAIL, f"cuFile reports GDS available but none moved through it: {moved}")
    return Result("GDS in use", FAIL if require_gds else SKIP, f"no GDS on this platform (kvikio compat mode): {moved}")


# --- the checks (need a CUDA device; --device cpu runs the host-memory ones) --------------------

class Checks:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.device = args.device
        self.workdir = workdir
        self.results: list[Result] = []
        self.engine = None
        self.backend_bytes = {"GDS": 0, "POSIX": 0}
        self.peak_growth = 0

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def run(self, name: str, fn: Callable[[], object]) -> None:
        """One check: its rows, or one FAIL row with the exception's last line (traceback to stderr)."""
        try:
            out = fn()
        except Exception as exc:  # every failing check is a row; the exit status says it
            traceback.print_exc(file=sys.stderr)
            self.results.append(Result(name, FAIL, f"{type(exc).__name__}: {exc}".splitlines()[0][:160]))
            return
        rows = out if isinstance(out, list) else [out]
        self.results.extend(r if isinstance(r, Result) else Result(name, PASS, str(r)) for r in rows)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    # platform
    def platform(self) -> Result:
        import kvikio
        import kvikio.defaults

        from gdskv.io.kvikio_engine import KvikioEngine

        parts = []
        if self.cuda:
            props = torch.cuda.get_device_properties(0)
            parts.append(f"{props.name} x{torch.cuda.device_count()}, torch {torch.__version__} CUDA {torch.version.cuda}")
        mode = kvikio.defaults.get("compat_mode")
        parts.append(f"kvikio {kvikio.__version__} compat_mode={getattr(mode, 'name', mode)}")
        try:
            import kvikio.cufile_driver

            parts.append(f"is_gds_available={kvikio.cufile_driver.get('is_gds_available')}")
        except Exception as exc:  # no libcufile
            parts.append(f"cuFile driver unavailable ({type(exc).__name__})")
        parts.append(f"fs={self.args.fs_type}")
        self.engine = KvikioEngine(threads=8, task_size=4 * MiB)
        parts.append(self.engine.describe())
        return Result("platform", PASS, "; ".join(parts))

    def _monitor(self):
        try:
            import kvikio

            return kvikio.SummaryMonitor()
        except Exception:  # a kvikio without statistics
            return None

    def _count_backends(self, monitor) -> None:
        if monitor is None:
            return
        by = monitor.get().by_backend
        for name in self.backend_bytes:
            self.backend_bytes[name] += int(by.get(name, {}).get("bytes_transferred", 0))

    def round_trips(self) -> Result:
        from gdskv.io.base import Segment

        monitor = self._monitor()
        moved = 0
        for i, split in enumerate(ROUND_TRIP_SPLITS):
            regions = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=self.device) for n in split]
            trailer = os.urandom(128)
            segs, off = [], 0
            for r in regions:
                segs.append(Segment(off, r))
                off += r.numel()
            path = str(self.workdir / f"rt-{i}")
            self.sync()
            assert self.engine.write_now(path, segs + [Segment(off, trailer)]) == off + 128
            backs = [torch.zeros_like(r) for r in regions]
            tail = bytearray(128)
            back_segs = [Segment(s.file_offset, b) for s, b in zip(segs, backs)] + [Segment(off, tail)]
            assert self.engine.read_now(path, back_segs) == off + 128
            self.sync()
            assert all(torch.equal(a, b) for a, b in zip(regions, backs)) and bytes(tail) == trailer, f"split {split} differs"
            moved += off
        bf16 = torch.randn(3, 7001, dtype=torch.bfloat16, device=self.device)
        path = str(self.workdir / "rt-bf16")
        self.engine.write_now(path, [Segment(0, bf16)])
        back16 = torch.empty_like(bf16)
        self.engine.read_now(path, [Segment(0, back16)])
        self.sync()
        assert torch.equal(back16.view(torch.int16), bf16.view(torch.int16)), "bf16 page differs"
        reused = self.engine.read_handles.reused
        for _ in range(3):  # a hot chunk: read through the handle already open
            self.engine.read_now(path, [Segment(0, back16)])
        assert self.engine.read_handles.reused >= reused + 3, "a hot chunk was reopened for every read"
        self._count_backends(monitor)
        return Result("kvikio round trips", PASS,
                      f"{len(ROUND_TRIP_SPLITS)} pages of 20 KiB-3 MiB in 1-3 unaligned regions + trailer, bf16; {moved / MiB:.1f} MiB each way; "
                      f"read handles opened {self.engine.read_handles.opened}, reused {self.engine.read_handles.reused}")

    def gds(self) -> Result:
        try:
            import kvikio.cufile_driver

            available = bool(kvikio.cufile_driver.get("is_gds_available"))
        except Exception:
            available = False
        if self._monitor() is None:
            return Result("GDS in use", FAIL if self.args.require_gds else SKIP,
                          "this kvikio has no SummaryMonitor: which backend moved the bytes is unknown")
        return gds_result(available, self.backend_bytes["GDS"], self.backend_bytes["POSIX"], self.args.require_gds)

    def _store(self, name: str, pool_shapes: Sequence[tuple[int, ...]], dtype=torch.bfloat16, device: Optional[str] = None,
               engine=None):
        """A namespace over a pool of one or more regions on ``device`` and its PageTransfer (on
        ``engine``, the kvikio engine by default)."""
        from gdskv.layout import GroupPools, KvCacheBufferRef, layout_from_group_tensors
        from gdskv.store import NamespaceSpec, PageStore
        from gdskv.transfer import PageTransfer

        device = device or self.device
        regions = [torch.randn(*shape, dtype=dtype, device=device) for shape in pool_shapes]
        refs = [[KvCacheBufferRef(0, kind)] for kind in ("key", "value", "extra")[:len(regions)]]
        layout = layout_from_group_tensors([GroupPools(None, (0,), regions, refs)], 16, dtype)
        ns = PageStore.open(self.workdir / f"store-{name}").namespace(NamespaceSpec.from_layout(layout, model=f"gpu-check-{name}"))
        return layout, regions, PageTransfer(ns, engine or self.engine, threads=8)

    def concurrent_saves(self) -> Result:
        from gdskv.transfer import LoadStatus, SaveStatus, page_segments

        # two regions per page of 96 KiB + 2 B and 160 KiB - 4 B: unaligned, each above 16 KiB
        layout, regions, transfer = self._store("concurrent", [(32, 49153), (32, 81918)])
        try:
            group = layout.group(0)
            keys = [os.urandom(32) for _ in range(32)]
            self.sync()
            t0 = time.perf_counter()
            saved = [transfer.save_page(0, k, None, page_segments(group, s)) for s, k in enumerate(keys)]
            statuses = [f.result() for f in saved]
            t_save = time.perf_counter() - t0
            assert all(s is SaveStatus.PUBLISHED for s in statuses), statuses
            original = [r.clone() for r in regions]
            for r in regions:
                r.zero_()
            self.sync()
            t0 = time.perf_counter()
            loaded = [transfer.load_page(0, k, page_segments(group, s)) for s, k in enumerate(keys)]
            statuses = [f.result() for f in loaded]
            t_load = time.perf_counter() - t0
            assert all(s is LoadStatus.LOADED for s in statuses), statuses
            assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(regions, original)), "loaded pages differ"
            path = transfer.ns.chunk_path(0, keys[0])
            with open(path, "r+b") as f:  # a flipped payload byte must be a miss, never data
                f.seek(50_001)
                byte = f.read(1)
                f.seek(50_001)
                f.write(bytes([byte[0] ^ 0xFF]))
            status = transfer.load_page(0, keys[0], page_segments(group, 0)).result()
            assert status is LoadStatus.CORRUPT, f"a corrupt chunk loaded as {status}"
            nbytes = sum(r[0].numel() * r.element_size() for r in regions) * len(keys)
            return Result("concurrent saves", PASS,
                          f"32 pages x 2 unaligned regions ({nbytes / len(keys) / KiB:.0f} KiB): save {nbytes / t_save / 1e9:.2f} GB/s, "
                          f"load {nbytes / t_load / 1e9:.2f} GB/s (page cache warm), verified; flipped byte -> CORRUPT")
        finally:
            transfer.close()

    def batched_transfers(self) -> Result:
        """``save_pages`` / ``load_pages``: a step's device pages as one batch behind one readiness
        event recorded after a producer kernel on a side stream; what is saved is what the producer
        wrote, and every page loads back verified."""
        from gdskv.transfer import LoadStatus, SaveStatus, page_segments

        layout, regions, transfer = self._store("batched", [(64, 131072)])
        try:
            group = layout.group(0)
            keys = [os.urandom(32) for _ in range(64)]
            self.sync()
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
                regions[0].fill_(3.0)
            ready = torch.cuda.Event()
            ready.record(side)
            saved = [f.result() for f in transfer.save_pages(0, [(k, None, page_segments(group, s)) for s, k in enumerate(keys)], ready)]
            assert all(s is SaveStatus.PUBLISHED for s in saved), saved
            regions[0].zero_()
            self.sync()
            t0 = time.perf_counter()
            loaded = [f.result() for f in transfer.load_pages(0, [(k, page_segments(group, s)) for s, k in enumerate(keys)])]
            t_load = time.perf_counter() - t0
            assert all(s is LoadStatus.LOADED for s in loaded), loaded
            assert bool((regions[0] == 3.0).all()), "a batch saved a page before its producer finished, or loaded wrong bytes"
            nbytes = regions[0].numel() * regions[0].element_size()
            # no save rate: the save waits for the producer's sleeping kernel by design
            return Result("batched transfers", PASS, f"64 pages of {nbytes // 64 // KiB} KiB saved as one batch behind one "
                          f"event (the producer's writes saved), loaded at {nbytes / t_load / 1e9:.2f} GB/s "
                          "(page cache warm, first batch), verified")
        finally:
            transfer.close()

    def native_copies(self) -> Result:
        """A staged step's device copies in one native call per span (``copies._queue_all``)
        against a torch copy per region, on the same pages: what is loaded back is what was saved,
        page by page (distinct bytes, shuffled slots: a page copied to or from the wrong place
        shows), and the native call ran only where it is on."""
        import gdskv.copies as copies
        from gdskv.config import GdsKvConfig
        from gdskv.io import batch as batchio
        from gdskv.io import make_engine
        from gdskv.io.capabilities import cuda_memcpy_async
        from gdskv.transfer import LoadStatus, SaveStatus, page_segments

        if not cuda_memcpy_async():
            return Result("native device copies", FAIL, "cudaMemcpyAsync not found in torch's CUDA runtime: a copy per region")
        engine = make_engine(GdsKvConfig(engine="posix"))
        layout, regions, transfer = self._store("native-copies", [(128, 65536), (128, 65536)], engine=engine)
        real, calls = batchio.copy_device, []
        batchio.copy_device = lambda *a: (calls.append(len(a[0])), real(*a))[1]
        try:
            group = layout.group(0)
            slots = torch.randperm(128)[:64].tolist()
            index = torch.tensor(slots, device=regions[0].device)
            nbytes = group.bytes_per_page * len(slots)
            rows = []
            for native in (True, False):
                copies.NATIVE_DEVICE_COPIES = native
                calls.clear()
                keys = [os.urandom(32) for _ in slots]
                original = [r.clone() for r in regions]
                self.sync()
                t0 = time.perf_counter()
                saved = [f.result() for f in transfer.save_pages(0, [(k, None, page_segments(group, s)) for k, s in zip(keys, slots)])]
                t_save = time.perf_counter() - t0
                assert all(s is SaveStatus.PUBLISHED for s in saved), saved
                for r in regions:
                    r.zero_()
                self.sync()
                t0 = time.perf_counter()
                loaded = [f.result() for f in transfer.load_pages(0, [(k, page_segments(group, s)) for k, s in zip(keys, slots)])]
                t_load = time.perf_counter() - t0
                assert all(s is LoadStatus.LOADED for s in loaded), loaded
                assert all(torch.equal(r[index].view(torch.int16), o[index].view(torch.int16)) for r, o in zip(regions, original)), \
                    f"native={native}: loaded pages differ from the saved ones"
                want = 2 * 2 * len(slots) if native else 0  # two regions, saved and loaded
                assert sum(calls) == want, f"native={native}: {sum(calls)} copies in native calls, expected {want}"
                rows.append(f"{'native' if native else 'per region'}: save {nbytes / t_save / 1e9:.2f}, load {nbytes / t_load / 1e9:.2f}")
                for r, o in zip(regions, original):
                    r.copy_(o)
            return Result("native device copies", PASS, f"64 pages of {group.bytes_per_page // KiB} KiB in 2 regions, shuffled "
                          f"slots, GB/s (page cache warm) {'; '.join(rows)}; equal")
        finally:
            batchio.copy_device = real
            copies.NATIVE_DEVICE_COPIES = True
            transfer.close()
            engine.close()

    def save_race(self) -> list[Result]:
        from gdskv.transfer import LoadStatus, SaveStatus, page_segments

        layout, regions, transfer = self._store("save-race", [(4, 262144)])  # 512 KiB pages
        try:
            group = layout.group(0)
            outcomes = []
            for slot, use_event in ((0, True), (1, False)):
                regions[0][slot].fill_(1.0)
                torch.cuda.synchronize()
                side = torch.cuda.Stream()
                with torch.cuda.stream(side):
                    torch.cuda._sleep(SLEEP_CYCLES)  # the producer is still busy ...
                    regions[0][slot].fill_(2.0)  # ... when it writes the page
                ready = torch.cuda.Event()
                ready.record(side)
                key = os.urandom(32)
                status = transfer.save_page(0, key, None, page_segments(group, slot), ready if use_event else None).result()
                torch.cuda.synchronize()
                if status is not SaveStatus.PUBLISHED:
                    outcomes.append(False)
                    continue
                regions[0][slot].zero_()
                torch.cuda.synchronize()
                loaded = transfer.load_page(0, key, page_segments(group, slot)).result()
                fresh = loaded is LoadStatus.LOADED and bool((regions[0][slot] == 2.0).all())
                outcomes.append(fresh)
            return race_result("save", with_event_ok=outcomes[0], control_showed_race=not outcomes[1])
        finally:
            transfer.close()

    def load_race(self) -> list[Result]:
        from gdskv.transfer import LoadStatus, SaveStatus, page_segments

        layout, regions, transfer = self._store("load-race", [(4, 262144)])
        try:
            group = layout.group(0)
            regions[0][3].fill_(7.0)
            key = os.urandom(32)
            assert transfer.save_page(0, key, None, page_segments(group, 3)).result() is SaveStatus.PUBLISHED
            outcomes = []
            for slot, use_event in ((0, True), (1, False)):
                regions[0][slot].fill_(1.0)  # the slot's old contents, still read by a kernel
                snapshot = torch.zeros_like(regions[0][slot])
                torch.cuda.synchronize()
                side = torch.cuda.Stream()
                with torch.cuda.stream(side):
                    torch.cuda._sleep(SLEEP_CYCLES)
                    snapshot.copy_(regions[0][slot])
                ready = torch.cuda.Event()
                ready.record(side)
                status = transfer.load_page(0, key, page_segments(group, slot), ready if use_event else None).result()
                torch.cuda.synchronize()
                outcomes.append((status is LoadStatus.LOADED, bool((snapshot == 1.0).all())))
            (loaded_ok, old_seen), (_, control_old_seen) = outcomes
            return race_result("load", with_event_ok=loaded_ok and old_seen, control_showed_race=not control_old_seen)
        finally:
            transfer.close()

    def device_checksum(self) -> Result:
        from gdskv import checksum
        from gdskv import format as fmt

        cases = 0
        for n, cuts in ((1, ()), (4095, (1000,)), (1 * MiB + 7, (333_333, 700_001)), (4 * MiB + 1, (2 * MiB,))):
            host = torch.randint(0, 256, (n,), dtype=torch.uint8)
            dev = host.to(self.device)
            bounds = [0, *cuts, n]
            dev_parts = [dev[a:b] for a, b in zip(bounds, bounds[1:])]
            want_poly = checksum.poly_hash_host(host.numpy())
            got_poly = checksum.poly_hash(dev_parts)
            assert got_poly == want_poly, f"poly_hash on {self.device} {got_poly:#x} != host {want_poly:#x} ({n} B)"
            want_crc = fmt.crc32c_at(host.data_ptr(), n, 0)
            assert checksum.crc32c_segments(dev_parts) == want_crc, f"CRC32C of {self.device} segments differs ({n} B)"
            cases += 1
        return Result("device checksum", PASS, f"poly_hash({self.device}) == poly_hash_host and CRC32C equal at {cases} lengths/splits")

    def second_device(self) -> Result:
        if not self.cuda or torch.cuda.device_count() < 2:
            return Result("second device", SKIP, "one CUDA device here")
        from gdskv.transfer import LoadStatus, SaveStatus, page_segments

        layout, regions, transfer = self._store("cuda1", [(4, 40961)], device="cuda:1")
        try:
            group = layout.group(0)
            key = os.urandom(32)
            want = regions[0][2].clone()
            assert transfer.save_page(0, key, None, page_segments(group, 2)).result() is SaveStatus.PUBLISHED
            regions[0][2].zero_()
            assert transfer.load_page(0, key, page_segments(group, 2)).result() is LoadStatus.LOADED
            assert torch.equal(regions[0][2].view(torch.int16), want.view(torch.int16)), "cuda:1 page differs"
            return Result("second device", PASS, "an 80 KiB bf16 page saved from and loaded into cuda:1")
        finally:
            transfer.close()

    def max_connector(self) -> Result:
        """MAX's KVConnector over CUDA blocks with MAX's stream given (``engine_streams``): blocks
        written late by a kernel on that stream are offloaded as the kernel left them, then loaded
        into other blocks of the same pool (read to scratch, verified, copied in stream order)."""
        from gdskv.config import GdsKvConfig
        from gdskv.connectors.max import GdsKvConnector, LeafMemory
        from gdskv.connectors.max.types import KVCacheGroupId

        pages = torch.zeros(8, 64 * KiB, dtype=torch.uint8, device=self.device)
        stream = torch.cuda.Stream() if self.cuda else None
        conn = GdsKvConnector({"full": KVCacheGroupId.full()}, [{"full": LeafMemory((pages,), False)}],
                              model="gpu-check/max", dtype="uint8", tokens_per_block=16,
                              config=GdsKvConfig(store_path=str(self.workdir / "store-max"), host_bytes=0),
                              engine=self.engine, engine_streams={pages.device: stream} if stream is not None else None)
        hashes = [i.to_bytes(8, "big") for i in range(1, 5)]
        try:
            if stream is not None:
                with torch.cuda.stream(stream):  # the step that writes the blocks is still running
                    torch.cuda._sleep(SLEEP_CYCLES)
                    for b in range(4):
                        pages[b].fill_(b + 1)
            else:
                for b in range(4):
                    pages[b].fill_(b + 1)
            saved = conn.offload({"full": [0, 1, 2, 3]}, {"full": hashes})
            saved.synchronize()
            assert saved.is_complete()
            for b, h in enumerate(hashes):
                with open(conn.namespaces[0].chunk_path(0, h), "rb") as f:
                    assert f.read(64 * KiB) == bytes([b + 1]) * (64 * KiB), f"block {b} saved before MAX's stream wrote it"
            assert all(conn.lookup(hashes)["full"])
            loaded = conn.load({"full": [4, 5, 6, 7]}, {"full": hashes})
            loaded.synchronize()
            self.sync()
            assert torch.equal(pages[4:8], pages[0:4]), "loaded blocks differ"
        finally:
            conn.shutdown()
        how = "written late on MAX's stream (its event awaited)" if stream is not None else "in host memory (dry run)"
        return Result("MAX connector", PASS, f"4 blocks of 64 KiB {how}, offloaded as written, loaded into other blocks, equal")

    def host_tier(self) -> Result:
        """The host tier in front of the disk (pinned where CUDA is): a page saved from device
        memory is written through to the tier; loaded twice into a zeroed page, the first load is
        a hit from the tier, bytes compared; with the tier off the same load comes from disk. On
        the kvikio engine (the per-page path) and on the POSIX one (staged spans, the tier's
        buffers filled in the native pass that seals the pages)."""
        from gdskv.config import GdsKvConfig
        from gdskv.io import make_engine
        from gdskv.service import KvService
        from gdskv.store import NamespaceSpec
        from gdskv.transfer import LoadStatus, SaveStatus, page_segments

        layout, regions, transfer = self._store("host-tier-layout", [(16, 96 * KiB + 2), (16, 160 * KiB - 4)])
        transfer.close()
        group = layout.group(0)
        spec = NamespaceSpec.from_layout(layout, model="gpu-check-host-tier")
        posix = make_engine(GdsKvConfig(engine="posix"))
        rows = []
        for (label, engine), host_bytes in [(e, h) for e in (("kvikio", self.engine), ("posix", posix)) for h in ("64M", 0)]:
            service = KvService(GdsKvConfig(store_path=str(self.workdir / f"store-host-{label}-{host_bytes}"),
                                            host_bytes=host_bytes), spec, engine=engine)
            try:
                keys = [os.urandom(32) for _ in range(8)]
                saved = [service.save(0, k, None, page_segments(group, s)).result() for s, k in enumerate(keys)]
                assert all(st is SaveStatus.PUBLISHED for st in saved), saved
                original = [r[:8].clone() for r in regions]
                for r in regions:
                    r[8:].zero_()
                self.sync()
                t0 = time.perf_counter()
                got = [service.load(0, k, page_segments(group, 8 + s)).result() for s, k in enumerate(keys)]
                seconds = time.perf_counter() - t0
                self.sync()
                assert all(st is LoadStatus.LOADED for st in got), got
                assert all(torch.equal(r[8:].view(torch.int16), o.view(torch.int16)) for r, o in zip(regions, original)), "loaded pages differ"
                hits = service.counters.host_hits
                want = 8 if host_bytes else 0
                assert hits == want, f"host_bytes={host_bytes}: {hits} host-tier hits, expected {want}"
                nbytes = group.bytes_per_page * 8
                rows.append(f"{label} {'tier' if host_bytes else 'disk'} {nbytes / seconds / 1e9:.2f} GB/s")
            finally:
                service.close()
        posix.close()
        return Result("host tier", PASS, f"8 pages of {group.bytes_per_page // KiB} KiB in 2 unaligned regions saved from "
                      f"{self.device}, loaded back: {', '.join(rows)} (host hits 8 / 0 each), equal")

    def trtllm_worker(self) -> Result:
        """One prefill through GdsKvScheduler/GdsKvWorker with a real CUDA stream, then a fresh
        worker loads the pages into a zeroed pool (as tests/test_trtllm_connector.py drives them)."""
        from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
        from gdskv.config import GdsKvConfig
        from gdskv.engine.requests import RequestData, SchedulerOutput

        tpb, layers = 16, 2
        config = GdsKvConfig(store_path=str(self.workdir / "store-trtllm"))

        tokens = list(range(5, 5 + 4 * tpb + 3))  # 4 full blocks
        pages = [3, 7, 1, 9, 4]
        stream = torch.cuda.Stream() if self.cuda else None

        def step(pool: torch.Tensor, request_id: int, computed: int, fill: bool) -> tuple[GdsKvWorker, GdsKvScheduler]:
            args = StandaloneLlmArgs.build("gpu-check/model", tpb)
            scheduler, worker = GdsKvScheduler(args, config=config), GdsKvWorker(args, config=config)
            worker.register_kv_caches(pool)
            request = type("Req", (), {"request_id": request_id, "get_tokens": lambda self, beam: list(tokens)})()
            matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
            assert matched == computed, f"matched {matched} tokens, expected {computed}"
            scheduler.update_state_after_alloc(request, pages)
            out = SchedulerOutput()
            out.new_requests.append(RequestData(request_id, tokens, list(pages), [list(pages)], computed, len(tokens) - computed))
            worker.bind_connector_meta(scheduler.build_connector_meta(out))
            worker.start_load_kv(stream)
            for layer in range(layers):
                worker.wait_for_layer_load(layer, stream)
                if fill and stream is not None:
                    with torch.cuda.stream(stream):  # the layer's KV written late, on the engine's stream
                        torch.cuda._sleep(SLEEP_CYCLES // 4)
                        for p in pages:
                            pool[p, layer].fill_(float(p * 10 + layer))
                elif fill:
                    for p in pages:
                        pool[p, layer].fill_(float(p * 10 + layer))
                worker.save_kv_layer(layer, stream)
            worker.wait_for_save(stream)
            if scheduler.request_finished(request, pages):
                given, deadline = [request_id], time.monotonic() + 60
                while not worker.get_finished(given, [])[0]:
                    given = []
                    assert time.monotonic() < deadline, "saves never finished"
                    time.sleep(0.005)
            return worker, scheduler

        pool = torch.zeros(12, layers, 2, tpb * 64, dtype=torch.bfloat16, device=self.device)
        worker, _ = step(pool, 1, 0, fill=True)
        saved = worker.counters.saves_published
        worker.close()
        self.sync()
        fresh = torch.zeros_like(pool)
        worker2, _ = step(fresh, 2, 4 * tpb, fill=False)
        loaded = worker2.counters.loads_loaded
        worker2.close()
        self.sync()
        assert saved == 4 and loaded == 4, f"saved {saved}, loaded {loaded} pages (4 each expected)"
        for p in pages[:4]:
            assert torch.equal(fresh[p].view(torch.int16), pool[p].view(torch.int16)), f"page {p} differs after the load"
        how = "from a CUDA stream's late writes (the worker's event awaited)" if stream is not None else "from host memory (dry run)"
        return Result("TensorRT-LLM worker", PASS, f"4 pages saved {how}, restored by a fresh worker, equal")

    def all(self) -> list[Result]:
        self.run("platform", self.platform)
        if self.engine is None:
            return self.results
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_reserved()
        self.run("kvikio round trips", self.round_trips)
        self.run("GDS in use", self.gds)
        self.run("concurrent saves", self.concurrent_saves)
        if self.cuda:
            self.run("batched transfers", self.batched_transfers)
            self.run("native device copies", self.native_copies)
            self.run("save race", self.save_race)
            self.run("load race", self.load_race)
        else:
            self.results.append(Result("ready events", SKIP, "need CUDA streams"))
        self.run("device checksum", self.device_checksum)
        self.run("second device", self.second_device)
        if self.cuda:
            growth = torch.cuda.max_memory_reserved() - base
            limit = parse_size(self.args.max_reserved_growth)
            self.results.append(Result("peak reserved memory", PASS if growth <= limit else FAIL,
                                       f"max_memory_reserved grew {growth / MiB:.0f} MiB over {base / MiB:.0f} MiB during the "
                                       f"checks above, their ~40 MiB of pools included (limit {limit / MiB:.0f} MiB)"))
        self.run("TensorRT-LLM worker", self.trtllm_worker)
        self.run("MAX connector", self.max_connector)
        self.run("host tier", self.host_tier)
        return self.results


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    directory = os.path.realpath(args.dir)
    try:
        with open("/proc/self/mountinfo") as f:
            args.fs_type = mount_fs_type(f.read(), directory)
    except OSError:
        args.fs_type = None
    dry_run = args.device == "cpu"
    why = refusal(dry_run or torch.cuda.is_available(), args.dir, os.path.isdir(directory), args.fs_type)
    if why is not None:
        print(f"gpu_check: refused: {why}")
        return EXIT_REFUSED
    try:
        import kvikio  # noqa: F401
    except Exception as exc:  # the kvikio engine is what this checks
        print(f"gpu_check: refused: kvikio does not import ({type(exc).__name__}: {exc}); pip install 'gdskv[cu12]'")
        return EXIT_REFUSED
    workdir = Path(tempfile.mkdtemp(prefix="gdskv-gpu-check-", dir=directory))
    started = time.monotonic()
    checks = Checks(args, workdir)
    try:
        results = checks.all()
    finally:
        if checks.engine is not None:
            checks.engine.close()
        shutil.rmtree(workdir, ignore_errors=True)
    print(format_table(results))
    code, line = verdict(results, dry_run=dry_run)
    print(f"{line} ({time.monotonic() - started:.0f} s)")
    return code


if __name__ == "__main__":
    with sigterm_as_exit():
        sys.exit(main())
