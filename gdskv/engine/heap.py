"""The C heap of a serving process: keep memory a step freed for the next step.

glibc's ``malloc`` gives freed memory back to the kernel as soon as enough of it sits at the top
of the heap (``brk`` shrinks) and serves larger blocks with ``mmap`` and ``munmap``. A decode
step of the reference engine frees and reallocates its temporaries every step, so it trims and
unmaps dozens of times a step; each time the kernel flushes the TLB of every CPU that runs the
process, and while the connector's transfer threads run on the other CPU those flushes are
interrupts there that the step waits for. Measured on the 2-vCPU development VM (32k-token
asynchronous restore, ``scripts/bench_decode_under_load.py``): the decoders' steps 1.5-2x slower
at the median while the prefix loaded, and 1.04-1.17x once the heap was kept. Serving processes
on CPUs do the same with another allocator (vLLM's CPU backend asks for tcmalloc).

Called by ``ReferenceEngine.generate`` when ``EngineConfig.steady_heap`` is set.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
SETTINGS = ((M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20), (M_MMAP_THRESHOLD, 32 << 20))
"""Trim only beyond 1 GiB free at the top, grow the heap 64 MiB at a time, and ``mmap`` only
blocks of 32 MiB and more (glibc's largest threshold): a step's temporaries stay in the heap."""


def keep_freed_memory() -> bool:
    """Set ``SETTINGS`` with glibc's ``mallopt`` (process-wide, for the process's life); False
    where the C library has no ``mallopt`` or refuses one (another libc): nothing changes then."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = all(mallopt(option, value) == 1 for option, value in SETTINGS)
    if not ok:
        log.info("gdskv: this C library did not take the steady-heap settings; the engine's heap is left as it is")
    return ok
