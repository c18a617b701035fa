"""kvikio I/O engine: ``kvikio.CuFile`` reads and writes, GPUDirect Storage where the platform has it.

Made by ``gdskv.io.make_engine`` when the config asks for ``engine = "kvikio"`` (or ``"auto"`` finds
kvikio and a CUDA driver); used by the transfer layer (``gdskv.transfer``) for every chunk file.

Each call opens one ``CuFile`` for the call's path, issues every segment at once with kvikio's
asynchronous ``pread``/``pwrite`` (which split each segment into ``task_size`` tasks on kvikio's
own thread pool), waits for all of them and closes the file. The transfer layer's threads make
that call themselves, once per page (``read_now``/``write_now``); ``read``/``write`` run it on one
of the engine's call threads and return a ``concurrent.futures.Future`` at once, so they never
block the caller, not even on ``open``.

Handles are not cached across calls. A chunk file is written once, under a temporary name that is
renamed when complete, and afterwards only read, quarantined or evicted: a cached write handle
would never be used again, and a cached read handle would keep an evicted or quarantined file's
blocks allocated (and its space counted against the disk) for as long as it stays cached. One
handle per call serves all segments of a page (its regions and its trailer).

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
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch

from gdskv.confined import open_data_file
from gdskv.io.base import Buffer, IoEngine, Segment, ShortReadError, tensor_bytes

# errno values by their strerror text: kvikio reports system errors as RuntimeError whose message
# ends with strerror(errno); this maps them back onto OSError subclasses (FileNotFoundError, ...).
_ERRNO_BY_TEXT = {os.strerror(code): code for code in sorted(errno.errorcode, reverse=True)}


class KvikioEngine(IoEngine):
    """Asynchronous chunk-file I/O through ``kvikio.CuFile``; one instance per worker process."""

    name = "kvikio"

    def __init__(self, threads: int = 4, task_size: int = 4 << 20, fsync: bool = False,
                 direct_writes: bool = True, direct_reads: bool = False, file_mode: int = 0o600) -> None:
        """``threads``: kvikio's thread pool size, and the number of ``read``/``write`` calls in
        flight at once (``read_now``/``write_now`` run on their callers' threads).
        ``task_size``: the bytes one kvikio task moves (a segment is split into tasks of this size).
        ``fsync``: flush each written file to the device before the call returns.
        ``direct_writes``/``direct_reads``: kvikio's ``auto_direct_io_write``/``_read`` (compat
        mode: O_DIRECT for page-aligned host memory), where this kvikio has them.
        ``file_mode``: permissions of the files it creates.
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
        self._gds = _gds_usable(kvikio)
        self._calls = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gdskv-kvikio")

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

    def _run(self, path: str, segments: Sequence[Segment], flags: str) -> int:
        """One call: open, issue every segment, wait for all, close. The file is opened by
        ``open_data_file`` first (no link, no FIFO, exact mode) and kvikio reopens that very
        file through ``/proc/self/fd``."""
        fd = open_data_file(path, write=flags == "w", mode=self.file_mode)
        try:
            handle = self._kvikio.CuFile(f"/proc/self/fd/{fd}", flags)
        except RuntimeError as exc:
            os.close(fd)
            raise _os_error(exc, path) from exc
        try:
            pending = []
            failure: BaseException | None = None
            op = handle.pread if flags == "r" else handle.pwrite
            for seg in segments:
                try:
                    memory, nbytes = _kvikio_buffer(seg.buf, writable=flags == "r")
                    pending.append((op(memory, nbytes, seg.file_offset), nbytes, seg.file_offset))
                except (RuntimeError, TypeError, ValueError) as exc:
                    failure = exc
                    break
            total = 0
            for io_future, nbytes, offset in pending:  # wait for all: none may outlive the handle
                try:
                    done = io_future.get()
                except RuntimeError as exc:
                    failure = failure or exc
                    continue
                if done != nbytes and failure is None:
                    failure = (ShortReadError if flags == "r" else OSError)(
                        f"{path}: {nbytes} bytes at {offset} requested, {done} moved")
                total += done
            if isinstance(failure, (TypeError, ValueError)):  # the caller's memory, not the file
                raise failure
            if failure is not None:
                raise _os_error(failure, path) from failure
            if flags == "w" and self.fsync:
                os.fsync(handle.fileno())
            return total
        finally:
            handle.close()
            os.close(fd)

    def close(self) -> None:
        self._calls.shutdown(wait=True)


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


def _gds_usable(kvikio: Any) -> bool:
    """Whether kvikio will use cuFile with the nvidia-fs driver, i.e. real GPUDirect Storage."""
    try:
        if kvikio.defaults.is_compat_mode_preferred():
            return False
        import kvikio.cufile_driver

        return bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception:  # no cuFile library, no driver: compat mode
        return False
