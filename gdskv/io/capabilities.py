"""What this machine offers for I/O: a CUDA driver with a device, an importable kvikio, and
GPUDirect Storage behind it.

Called by ``gdskv.io.make_engine`` when the config says ``engine = "auto"``, by ``gdskv demo`` /
``gdskv info`` to report the platform, by ``gdskv.copies`` for the CUDA runtime's copy entry
point, and by the test suite to decide whether the CUDA driver test double may be loaded. The
probes are cached for the life of the process and never raise.
"""
from __future__ import annotations

import ctypes
import functools
import importlib
from typing import Any, Iterable

_CUDA_SUCCESS = 0


@functools.lru_cache(maxsize=1)
def cuda_driver_present() -> bool:
    """True when ``libcuda.so.1`` opens, initialises, and reports at least one device.

    Initialises the driver in this process (``cuInit``), as any later CUDA use would; a test double
    of the driver (which has no ``cuInit`` and no devices) reads as absent.
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != _CUDA_SUCCESS:
            return False
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_SUCCESS:
            return False
        return count.value > 0
    except Exception:  # no library, missing symbol, anything else: no usable driver
        return False


@functools.lru_cache(maxsize=1)
def kvikio_available() -> bool:
    """True when the ``kvikio`` package imports (it is an optional extra: ``gdskv[cu12]``)."""
    try:
        importlib.import_module("kvikio")
    except Exception:  # not installed, or installed without its native libraries
        return False
    return True


@functools.lru_cache(maxsize=1)
def gds_available() -> bool:
    """True when kvikio imports, a CUDA driver is present and cuFile reports GPUDirect Storage
    (the nvidia-fs driver), with kvikio's compat mode not forced. Opens the cuFile driver."""
    if not (kvikio_available() and cuda_driver_present()):
        return False
    return gds_usable(importlib.import_module("kvikio"))


def gds_usable(kvikio: Any) -> bool:
    """Whether ``kvikio``, as configured now, will use cuFile with the nvidia-fs driver, i.e. real
    GPUDirect Storage (``KvikioEngine`` asks after applying its settings)."""
    try:
        if kvikio.defaults.is_compat_mode_preferred():
            return False
        import kvikio.cufile_driver

        return bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception:  # no cuFile library, no driver: compat mode
        return False


@functools.lru_cache(maxsize=1)
def cuda_memcpy_async() -> int:
    """The address of ``cudaMemcpyAsync`` in the CUDA runtime library torch has loaded (the one
    whose streams and devices it uses), or 0: no CUDA device, or a runtime linked into torch
    statically (then there is no library to name). Initialises CUDA in this process; called once
    device pages are being copied, so CUDA is in use already."""
    try:
        import torch

        if not torch.cuda.is_available():
            return 0
        torch.cuda.init()
        with open("/proc/self/maps") as maps:
            path = runtime_library(maps)
        if path is None:
            return 0
        return ctypes.cast(ctypes.CDLL(path).cudaMemcpyAsync, ctypes.c_void_p).value or 0
    except Exception:  # no /proc, no symbol: the per-copy torch path
        return 0


def runtime_library(maps: Iterable[str]) -> "str | None":
    """The path of the CUDA runtime (``libcudart.so*``) among a ``/proc/<pid>/maps`` listing's
    mapped files, or None."""
    for line in maps:
        parts = line.split(maxsplit=5)
        path = parts[5].strip() if len(parts) == 6 else ""
        if path.startswith("/") and path.rsplit("/", 1)[-1].startswith("libcudart.so"):
            return path
    return None
