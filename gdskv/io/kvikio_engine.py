"""kvikio I/O engine: ``kvikio.CuFile`` reads and writes, GPUDirect Storage where the platform has it.

Made by ``gdskv.io.make_engine`` when the config asks for ``engine = "kvikio"`` (or ``"auto"`` finds
GPUDirect Storage: ``capabilities.gds_available``); used by the transfer layer (``gdskv.transfer``)
for every chunk file.

Each call opens one ``CuFile`` for the call's path, issues the segments with kvikio's asynchronous
``pread``/``pwrite`` (which split each segment into ``task_size`` tasks on kvikio's own thread
pool), waits for all of them and closes the file. A read issues every segment at once. A write
never has two writes in flight into the same 4 KiB file block (``_Calls``): the trailer of a
payload whose length is not a multiple of 4 KiB waits for the payload's last region, and so does
a region that starts inside the block where the previous one ends; a segment that starts off a
block boundary goes as one kvikio task. The transfer layer's threads make
that call themselves, once per page (``read_now``/``write_now``); ``read``/``write`` run it on one
of the engine's call threads and return a ``concurrent.futures.Future`` at once, so they never
block the caller, not even on ``open``.

Read handles are reused across calls (``gdskv.io.handles.HandleCache``: by inode, at most
``handle_cache`` of them, none older than ``handle_max_age`` seconds, so an evicted chunk's blocks
are freed soon); a hot chunk costs one ``open`` and ``fstat`` per load instead of three opens and a
cuFile handle registration. Write handles are not: a chunk file is written once, under a temporary
name that is renamed when complete. One handle per call serves all segments of a page (its
regions and its trailer).

Device memory may be registered with cuFile once per worker (``register_buffers``, opt-in: the KV
pool's regions at bring-up); unregistered device memory goes through cuFile's own bounce buffers.
Registration is a no-op in compat mode.

Memory: CPU tensors go to kvikio as zero-copy numpy views; CUDA tensors go as they are (kvikio
reads ``__cuda_array_interface__``; with GDS it DMAs straight into device memory, in compat mode it
bounces through its own pinned buffers). Both are viewed as ``uint8`` first so any dtype (bf16
included) passes.

kvikio's thread pool, task size and direct-I/O policy are process-wide settings: the last engine
constructed in a process sets them for every engine in it. The policy follows the config's
``o_direct`` as the POSIX engine's does: in compat mode kvikio moves page-aligned host memory with
O_DIRECT for writes (``writes``, ``all``) and reads (``all``); GDS bypasses the page cache anyway.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from gdskv.confined import open_data_file
from gdskv.io.base import Buffer, IoEngine, Segment, ShortReadError, tensor_bytes
from gdskv.io.capabilities import gds_usable
from gdskv.io.handles import HandleCache

log = logging.getLogger(__name__)

# errno values by their strerror text: kvikio reports system errors as RuntimeError whose message
# ends with strerror(errno); this maps them back onto OSError subclasses (FileNotFoundError, ...).
_ERRNO_BY_TEXT = {os.strerror(code): code for code in sorted(errno.errorcode, reverse=True)}


class KvikioEngine(IoEngine):
    """Asynchronous chunk-file I/O through ``kvikio.CuFile``; one instance per worker process."""

    name = "kvikio"

    def __init__(self, threads: int = 4, task_size: int = 4 << 20, fsync: bool = False,
                 direct_writes: bool = True, direct_reads: bool = False, file_mode: int = 0o600,
                 handle_cache: int = 64, handle_max_age: float = 2.0) -> None:
        """``threads``: kvikio's thread pool size, and the number of ``read``/``write`` calls in
        flight at once (``read_now``/``write_now`` run on their callers' threads).
        ``task_size``: the bytes one kvikio task moves (a segment is split into tasks of this size).
        ``fsync``: flush each written file to the device before the call returns.
        ``direct_writes``/``direct_reads``: kvikio's ``auto_direct_io_write``/``_read`` (compat
        mode: O_DIRECT for page-aligned host memory), where this kvikio has them.
        ``file_mode``: permissions of the files it creates.
        ``handle_cache`` / ``handle_max_age``: how many read handles stay open for reuse, and for
        how many seconds at most (0 handles: every read opens its own).
        """
        import kvikio
        import kvikio.defaults

        if threads < 1 or task_size < 1:
            raise ValueError(f"kvikio threads ({threads}) and task_size ({task_size}) must be positive")
        if kvikio.defaults.get("num_threads") != threads:
            kvikio.defaults.set("num_threads", threads)
        if kvikio.defaults.get("task_size") != task_size:
            kvikio.defaults.set("task_size", task_size)
        for setting, value in (("auto_direct_io_write", direct_writes), ("auto_direct_io_read", direct_reads)):
            try:
                if kvikio.defaults.get(setting) != value:
                    kvikio.defaults.set(setting, value)
            except (KeyError, ValueError, RuntimeError):  # a kvikio before these settings
                pass
        self._kvikio = kvikio
        self.threads = threads
        self.task_size = task_size
        self.fsync = fsync
        self.file_mode = file_mode
        self._gds = gds_usable(kvikio)
        self._calls = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gdskv-kvikio")
        self._registered: dict[tuple[str, int], torch.Tensor] = {}  # allocation -> the view registered
        self._registered_lock = threading.Lock()
        self.read_handles = HandleCache(capacity=handle_cache, max_age=handle_max_age)

    @property
    def gds_active(self) -> bool:
        """True when kvikio runs cuFile (not its compat mode) and the cuFile driver reports GDS.

        In kvikio's AUTO compat mode a file on a file system that GDS cannot serve still falls back
        to compat mode for that file; this reports the platform, not each file.
        """
        return self._gds

    def describe(self) -> str:
        mode = "GDS active" if self._gds else "GDS inactive: kvikio compat mode"
        return f"{self.name} ({mode}, {self.threads} threads, {self.task_size >> 10} KiB tasks)"

    # --- the two calls ----------------------------------------------------------------------
    def read(self, path: str, segments: Sequence[Segment]) -> "Future[int]":
        return self._calls.submit(self._run, path, list(segments), "r")

    def write(self, path: str, segments: Sequence[Segment]) -> "Future[int]":
        return self._calls.submit(self._run, path, list(segments), "w")

    def read_now(self, path: str, segments: Sequence[Segment]) -> int:
        return self._run(path, segments, "r")

    def write_now(self, path: str, segments: Sequence[Segment]) -> int:
        return self._run(path, segments, "w")

    def _open_handle(self, fd: int, flags: str, path: str) -> Any:
        """kvikio's handle of the file open at ``fd``: kvikio reopens it through ``/proc/self/fd``
        (``kvikio.CuFile`` takes a path only, and opening the path itself would follow a link,
        block on a FIFO and create with kvikio's own mode)."""
        try:
            return self._kvikio.CuFile(f"/proc/self/fd/{fd}", flags)
        except RuntimeError as exc:
            raise _os_error(exc, path) from exc

    def _run(self, path: str, segments: Sequence[Segment], flags: str) -> int:
        """One call: open (``open_data_file``: no link, no FIFO, exact mode), issue the segments,
        wait for all, close. A read takes its kvikio handle from ``read_handles`` (made anew only
        for a file not open already: kvikio's buffered and O_DIRECT opens and, under GDS, a cuFile
        handle registration); a write makes one and closes it.

        Reads issue every segment at once. Writes never have two writes in flight that touch the
        same ``BLOCK`` of the file (see ``_Calls``)."""
        writing = flags == "w"
        fd = open_data_file(path, write=writing, mode=self.file_mode)
        if writing:
            try:
                handle = self._open_handle(fd, flags, path)
            except BaseException:
                os.close(fd)
                raise
            return self._issue(handle, fd, path, segments, writing=True)
        try:
            entry = self.read_handles.acquire(fd, lambda: self._open_handle(fd, flags, path))
        finally:
            os.close(fd)
        try:
            return self._issue(entry.handle, None, path, segments, writing=False)
        finally:
            self.read_handles.release(entry)

    def _issue(self, handle: Any, fd: Optional[int], path: str, segments: Sequence[Segment], writing: bool) -> int:
        """Issue every segment on ``handle``, wait for all; a write handle (and ``fd``) is closed."""
        calls = _Calls(path, writing)
        try:
            op = handle.pread if not writing else handle.pwrite
            for seg in segments:
                try:
                    memory, nbytes = _kvikio_buffer(seg.buf, writable=not writing)
                except (TypeError, ValueError) as exc:
                    calls.fail(exc)
                    break
                offset = seg.file_offset
                task_size = None
                if writing:
                    calls.settle_sharing(offset, nbytes)  # wait for writes into this segment's blocks
                    if calls.failure is not None:
                        break
                    task_size = _write_task_size(offset, nbytes, self.task_size)
                try:
                    io_future = op(memory, nbytes, offset) if task_size is None else op(memory, nbytes, offset, task_size)
                except (RuntimeError, TypeError, ValueError) as exc:
                    calls.fail(exc)
                    break
                calls.add(io_future, nbytes, offset)
            calls.settle_all()  # none may outlive the handle
            calls.raise_failure()
            if writing and self.fsync:
                os.fsync(handle.fileno())
            return calls.total
        finally:
            if writing:
                handle.close()
                os.close(fd)

    # --- cuFile buffer registration ------------------------------------------------------------
    def register_buffers(self, tensors: Iterable[torch.Tensor]) -> int:
        """Register device memory (a worker's KV pool regions) with cuFile once, so GDS moves page
        bytes straight to and from it instead of through cuFile's own bounce buffers.

        Opt-in: a worker calls it once at bring-up with its pool's region tensors. kvikio
        registers the whole CUDA allocation that holds each tensor (``kvikio.memory_register``);
        tensors of an allocation already registered by this engine are skipped. A no-op (0)
        without GDS (kvikio's compat mode), for host tensors, and where this kvikio has no
        registration call. A registration cuFile refuses is logged and left out: transfers still
        work, through cuFile's bounce buffers. Registrations last until ``close``. Returns how
        many allocations this call registered."""
        if not self._gds:
            return 0
        register, _ = _registration_calls(self._kvikio)
        if register is None:
            return 0
        done = 0
        for t in tensors:
            if not _registrable(t):
                continue
            flat = tensor_bytes(t)
            key = (str(flat.device), flat.untyped_storage().data_ptr())
            with self._registered_lock:
                if key in self._registered:
                    continue
                try:
                    register(_kvikio_buffer(flat, writable=False)[0])
                except (RuntimeError, TypeError, ValueError) as exc:
                    log.warning("gdskv: cuFile refused to register %d bytes of %s (%s); its pages move through "
                                "cuFile's bounce buffers", flat.numel(), flat.device, exc)
                    continue
                self._registered[key] = flat
                done += 1
        return done

    @property
    def registered_buffers(self) -> int:
        """How many allocations ``register_buffers`` has registered and ``close`` will deregister."""
        return len(self._registered)

    def _deregister_all(self) -> None:
        _, deregister = _registration_calls(self._kvikio)
        with self._registered_lock:
            held, self._registered = list(self._registered.values()), {}
        for flat in held:
            try:
                if deregister is not None:
                    deregister(_kvikio_buffer(flat, writable=False)[0])
            except (RuntimeError, TypeError, ValueError) as exc:  # at shutdown: say so, go on
                log.warning("gdskv: cuFile deregistration of %s memory failed: %s", flat.device, exc)

    def close(self) -> None:
        self._calls.shutdown(wait=True)
        self.read_handles.clear()
        self._deregister_all()


BLOCK = 4096
"""The file-system block that an unaligned cuFile / O_DIRECT write reads, modifies and writes back
whole: two writes in flight into one block could each write back the other's bytes stale."""


def _blocks(offset: int, nbytes: int) -> tuple[int, int]:
    """The first and last ``BLOCK`` index a span touches (an empty span touches none: (1, 0))."""
    if nbytes <= 0:
        return 1, 0
    return offset // BLOCK, (offset + nbytes - 1) // BLOCK


def _write_task_size(offset: int, nbytes: int, task_size: int) -> int:
    """The task size for kvikio's split of one write: the engine's, when every task then starts on
    a block boundary; else the whole segment in one task (kvikio's tasks of a segment run at once,
    and tasks cut at unaligned offsets would share blocks)."""
    if offset % BLOCK == 0 and task_size % BLOCK == 0:
        return task_size
    return max(nbytes, 1)


class _Calls:
    """The kvikio futures of one engine call: their byte counts, the first failure, and (for
    writes) which file blocks each one touches, so a write is issued only once every write in
    flight into any of its blocks has completed.

    Why (issue 10, item 4): the chunk format puts the 128-byte trailer right behind the payload,
    so when the payload length is not a multiple of 4 KiB they share a block; a page's regions
    likewise meet inside blocks. Under GDS the payload goes through cuFile (O_DIRECT: an unaligned
    end is a read-modify-write of the whole block) while the trailer, below kvikio's GDS
    threshold, goes through the page cache; issued together, either may write back the other's
    bytes stale. Waiting costs a wait only where segments meet inside a block: the trailer of an
    unaligned payload waits for the payload's last region, block-aligned regions all go at once."""

    def __init__(self, path: str, writing: bool) -> None:
        self.path = path
        self.writing = writing
        self.pending: list[tuple[Any, int, int, int, int]] = []  # future, nbytes, offset, first, last block
        self.total = 0
        self.failure: Optional[BaseException] = None

    def add(self, io_future: Any, nbytes: int, offset: int) -> None:
        self.pending.append((io_future, nbytes, offset, *_blocks(offset, nbytes)))

    def fail(self, exc: BaseException) -> None:
        self.failure = self.failure or exc

    def settle_sharing(self, offset: int, nbytes: int) -> None:
        """Wait for every pending call that touches a block of ``[offset, offset + nbytes)``."""
        first, last = _blocks(offset, nbytes)
        keep = []
        for entry in self.pending:
            if entry[3] <= last and first <= entry[4]:
                self._settle(entry)
            else:
                keep.append(entry)
        self.pending = keep

    def settle_all(self) -> None:
        pending, self.pending = self.pending, []
        for entry in pending:
            self._settle(entry)

    def _settle(self, entry: tuple[Any, int, int, int, int]) -> None:
        io_future, nbytes, offset = entry[:3]
        try:
            done = io_future.get()
        except RuntimeError as exc:
            self.fail(exc)
            return
        if done != nbytes and self.failure is None:
            self.failure = (OSError if self.writing else ShortReadError)(
                f"{self.path}: {nbytes} bytes at {offset} requested, {done} moved")
        self.total += done

    def raise_failure(self) -> None:
        failure = self.failure
        if isinstance(failure, (TypeError, ValueError)):  # the caller's memory, not the file
            raise failure
        if failure is not None:
            raise _os_error(failure, self.path) from failure


def _registrable(t: Any) -> bool:
    """Whether ``register_buffers`` hands ``t`` to cuFile: a contiguous CUDA tensor."""
    return isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.is_contiguous() and t.numel() > 0


def _registration_calls(kvikio: Any) -> tuple[Optional[Callable[[Any], Any]], Optional[Callable[[Any], Any]]]:
    """kvikio's cuFile buffer (de)registration calls: ``memory_register`` / ``memory_deregister``
    (kvikio 24.x and later), or ``buffer_register`` / ``buffer_deregister`` where an older
    kvikio names them so; (None, None) where it has neither."""
    for reg, dereg in (("memory_register", "memory_deregister"), ("buffer_register", "buffer_deregister")):
        register, deregister = getattr(kvikio, reg, None), getattr(kvikio, dereg, None)
        if callable(register) and callable(deregister):
            return register, deregister
    return None, None


def _kvikio_buffer(buf: Buffer, writable: bool) -> tuple[Any, int]:
    """The object kvikio accepts for a segment's memory, and its size in bytes.

    CPU tensor -> zero-copy uint8 numpy view; CUDA tensor -> uint8 view of itself; bytes-like ->
    numpy view. ``writable``: the call reads into this memory (so ``bytes`` cannot take it).
    """
    if isinstance(buf, torch.Tensor):
        flat = tensor_bytes(buf)
        return (flat.numpy() if flat.device.type == "cpu" else flat), flat.numel()
    view = np.frombuffer(buf, dtype=np.uint8)
    if writable and not view.flags.writeable:
        raise ValueError("cannot read into read-only memory (bytes); pass a bytearray")
    return view, view.nbytes


def _os_error(exc: BaseException, path: str) -> OSError:
    """kvikio's RuntimeError (or ours) as the OSError the engine contract promises."""
    if isinstance(exc, OSError):
        return exc
    text = str(exc).rstrip()
    if "shared object" in text:  # kvikio could not load libcuda / libcufile: not about the file
        return OSError(errno.EIO, f"kvikio cannot load a CUDA library: {text}", path)
    if text.endswith("EOF"):
        return ShortReadError(f"{path}: file ended before the requested bytes ({text})")
    for strerror, code in _ERRNO_BY_TEXT.items():
        if text.endswith(strerror):
            return OSError(code, f"{strerror} (kvikio: {text})", path)
    return OSError(errno.EIO, f"kvikio I/O failed: {text}", path)
