"""Store throughput against the two obvious alternatives, on one disk, in one run.

Called by ``gdskv bench`` (the CLI) and ``scripts/bench_store.py`` through ``main(argv)``;
``run(options)`` returns the report as a dict for callers that print it themselves. The
package: ``options`` (the command line, read before torch is imported), ``subjects`` (the store
and the service), ``baselines``, ``disk`` (page cache, durability, directories, page pools),
``rounds`` (the measurement) and ``report``. Its names are imported from their modules on first use,
so ``gdskv.bench.options`` costs no torch import.

Subjects, all moving pages of the same size and count between a page pool and one directory:

- ``ceiling``: the disk's ceiling, one file, ``O_DIRECT``, 4 MiB requests from 8 threads,
  page-aligned memory (the same at every page size);
- ``raw`` and ``raw+o_direct``: one file, pages written and read one after another at their
  offsets, through the page cache or with ``O_DIRECT`` (page-aligned memory);
- ``files``: one plain file per page (the store's count, sizes and directory fan-out), written
  and read buffered by Python threads at the store's depth, no checksum: ``warm/files`` in the
  report compares the store's warm loads with page-cache reads of files like its own;
- ``torch.save``: one ``.pt`` file per block (TensorRT-LLM's example KV cache connector);
- ``store:<engine>@<pool>``: the gdskv store through ``PageTransfer.save_pages`` / ``load_pages``
  (chunk files with trailers, checksums verified on load, temp-file + rename publish) in a fresh
  store whose chunk directories exist already (as in a store in service), per I/O engine label
  (``posix+o_direct`` is the default config) and per page pool: ``torch`` (plain ``torch.empty``
  CPU tensors, what engines hand over), ``hugepage`` (2 MiB-aligned host memory advised to use
  huge pages), ``pinned`` and ``cuda`` (where CUDA exists);
- ``service:host-tier@<pool>``: the store as a serving process runs it, through ``KvService`` with
  the default config (host tier on): saves write through into the tier, a cold load reads the
  disk and fills the tier, the hot load after it is served by the tier, and a warm load is served
  by the page cache (into host memory it leaves the tier alone);
- ``peer:vllm-fs-tier`` and ``peer:lmcache-disk``: vLLM's file-system offload tier and LMCache's
  local-disk backend, each driven in its own virtualenv (``gdskv.peers``), left out with the
  reason where that cannot be had.

The report also says what direct I/O the directory's file system asks (``statx``'s memory
alignment) and where each torch pool started past a page boundary, so whether the torch pools'
pages moved in place or through a staging copy: peers that read into page-aligned memory of
their own never pay that copy.

Each subject saves (timed until the bytes are durable: ``syncfs`` of the directory's file system,
for every subject alike; each round in a directory of its own, placed apart from the ones removed
before it: ``spread_directories``), loads cold (page cache of its files dropped with
``posix_fadvise(DONTNEED)``) and loads warm (its files read once through the page cache first:
a subject that reads the cache when the bytes are there shows it). ``load_hot`` (a host-memory
tier, filled by the cold load) is measured right after the cold load for subjects that have one
(``supports_hot``: the service subject), which forget those pages again before the warm load. Every timed
load goes into cleared pages and is checked after. Subjects are
interleaved within a round and the order rotates between rounds; each figure is the median over
rounds, because disks drift by tens of percent from one run to the next (and more on a machine
shared with other work). Once the subjects are set up, the heap is frozen (``gc.freeze``), as
vLLM's engine core does after start-up: a full collection triggered by a load's allocations then
walks what the run allocated since, not the ~190k objects of torch and the imports (a 70-130 ms
pause inside one of every few timed loads here, unfrozen).
"""
from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "MAX_PAGE": "options",
    "MIN_PAGE": "options",
    "POOLS": "options",
    "BenchOptions": "options",
    "OneLineParser": "options",
    "parse_args": "options",
    "Subject": "subjects",
    "StoreSubject": "subjects",
    "ServiceSubject": "subjects",
    "bench_engine": "subjects",
    "engine_usable": "subjects",
    "RawFile": "baselines",
    "FilePerPage": "baselines",
    "DiskCeiling": "baselines",
    "TorchSave": "baselines",
    "sync_directory_fs": "disk",
    "spread_directories": "disk",
    "drop_page_cache": "disk",
    "fill_page_cache": "disk",
    "ChunkWriter": "disk",
    "page_pool": "disk",
    "measure": "rounds",
    "rates": "rounds",
    "sigterm_as_exit": "rounds",
    "TERMINATED_STATUS": "rounds",
    "run": "rounds",
    "main": "rounds",
    "KINDS": "report",
    "SAVE_TARGET": "report",
    "LOAD_TARGET": "report",
    "PEER_TARGET": "report",
    "WARM_TARGET": "report",
    "HOT_TARGET": "report",
    "add_ratios": "report",
    "format_report": "report",
    "size_label": "report",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    """``gdskv.bench.<name>``: imported from its module on first use."""
    if name not in _HOME:
        raise AttributeError(f"module 'gdskv.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gdskv.bench.{_HOME[name]}"), name)
