"""What this machine offers for I/O: a CUDA driver with a device, and an importable kvikio.

Called by ``gdskv.io.make_engine`` when the config says ``engine = "auto"``, by ``gdskv demo`` /
``gdskv info`` to report the platform, and by the test suite to decide whether the CUDA driver test
double may be loaded. Both probes are cached for the life of the process and never raise.
"""
from __future__ import annotations

import ctypes
import functools
import importlib

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
