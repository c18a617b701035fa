"""What this machine offers for I/O: a CUDA driver with a device, an importable kvikio, and
GPUDirect Storage behind it.

Called by ``gdskv.io.make_engine`` when the config says ``engine = "auto"``, by ``gdskv demo`` /
``gdskv info`` to report the platform, and by the test suite to decide whether the CUDA driver test
double may be loaded. The probes are cached for the life of the process and never raise.
"""
from __future__ import annotations

import ctypes
import functools
import importlib
from typing import Any

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
