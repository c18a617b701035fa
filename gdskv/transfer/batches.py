"""How a batch of pages is spread over the transfer threads: slices, callers, the bookkeeping hook.

Used by ``PageTransfer._batch`` (``gdskv.transfer.core``) and the ``_later`` path
(``gdskv.transfer.later``).
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

from gdskv.priority import lower_this_thread
from gdskv.transfer.pages import DoneFn

log = logging.getLogger(__name__)

SLICE_PAGES = 64
"""Most pages one native batch call moves (``PageTransfer._batch``): enough to amortize the call
and its GIL round trip, few enough that a step's pages still spread over the callers."""
NATIVE_CALLERS = 2
"""Pool threads that pass slices of saves and asynchronous loads to the native batch path at once,
the depth shared among them: two, so that one verifies and resolves its slice (with the GIL)
while the other's pages move (without it). Work that runs beside the serving thread: more
callers are more Python threads taking the GIL from it (``scripts/bench_ttft.py``'s decode steps
with saves at 64 MiB/s / as fast as they go, medians of 5 runs: 1.04 / 1.06x the steps without
at 2 callers, 1.06 / 1.09x at 4)."""
FOREGROUND_CALLERS = 4
"""The same for loads a forward pass waits for, where only their pace counts: while one caller
verifies its slice and its native threads wait for the slowest page of the call, the others'
pages keep the device busy. Cold 256 KiB loads, same files, alternated in one process on the
2-vCPU VM (depth 16): 2 callers of 8 threads 3.01 / 2.72 GB/s (two runs), 4 of 4 3.35 / 3.07
(+11-13%, faster in every round), 8 of 2 3.08, 16 of 1 3.02; at 1 MiB 3.23 vs 3.33, at 4 MiB
equal (the disk's pace)."""
ONE_WRITER_BYTES = 16 << 20
"""Saves posted together from the serving loop (``_later``) up to this many bytes go to one
native writer thread: a decode step's. Writers run beside the serving thread, and on few cores
each one slows its compute, while one writer keeps up with a decode step's saves.
``scripts/bench_ttft.py --only decode`` on the 2-vCPU VM, steps with saves ÷ steps without, for
about 46 pages of 256 KiB a step posted as fast as they go (11.5 MiB) / 13 at 64 MiB/s, means of
5 runs of each, alternated: 8 writers a call 1.061 / 1.054x; two writers (one per 8 MiB) 1.057 /
1.025, 1.051 / 1.025 and 1.077 / 1.026 in three batches; one writer 1.044 / 1.028 and 1.024 /
1.002 against the last two of those, saving 202-238 MB/s flat out as two did. Beyond this size
one writer per 8 MiB rather than per 16 (4 runs each, alternated): 1.035 / 0.992 against 1.052 /
1.031 (the bench's first post of a round is 64 pages, just over this size). Single runs spread
over 1.00-1.10 flat out whatever the rule."""
SAVE_BYTES_PER_THREAD = 8 << 20
"""Larger posts (a prefill's, a bulk save's) get one writer per this many bytes begun, up to the
depth's share (``depth // NATIVE_CALLERS``): one writer moves a large save at half the pace of
eight or less (posted at once, durable: 256 MiB of 1 MiB pages 0.87 against 1.85 GB/s, 512 MiB
of 4 MiB pages 1.92 against 2.27; 32 MiB of 256 KiB pages 0.88 / 1.24 / 1.43 / 1.57 GB/s at
1 / 2 / 4 / 8 writers). A post its writers have not finished by the next step's post overlaps
it, so the writers at work grow with the rate the serving loop saves at."""


def writer_threads(nbytes: int, most: int) -> int:
    """Native writer threads for ``nbytes`` of saves posted together by the serving loop
    (``LaterPath._later``): one up to ``ONE_WRITER_BYTES``, else one per
    ``SAVE_BYTES_PER_THREAD`` begun, at most ``most``."""
    if nbytes <= ONE_WRITER_BYTES:
        return 1
    return max(1, min(most, -(-nbytes // SAVE_BYTES_PER_THREAD)))


def bookkeep(on_done: Optional[DoneFn], done: list[int], results: Optional[list[Any]], skipped: Sequence[int] = ()) -> None:
    """``on_done`` of finished pages, before their futures resolve; never raises."""
    if on_done is None:
        return
    try:
        on_done(done, results, list(skipped))
    except Exception:  # never lose the pages' futures to the bookkeeping
        log.exception("gdskv: bookkeeping of a finished slice failed")


def started_pool(threads: int, name: str, nice: int) -> ThreadPoolExecutor:
    """A transfer pool, its threads started now rather than by the first batch on the serving
    thread; each first lowers itself by ``nice`` (``gdskv.priority``; 0 leaves it alone)."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name, initializer=lower_this_thread, initargs=(nice,))
    for _ in range(threads):
        pool.submit(int)
    return pool
