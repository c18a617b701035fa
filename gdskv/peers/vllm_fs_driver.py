"""Drives vLLM's file-system offload tier (``vllm.v1.kv_offload.tiering.fs``) for ``gdskv bench``.

Run by ``gdskv.peers.PeerSubject`` with the python of a virtualenv that has vLLM (never imports
gdskv): commands arrive as JSON lines on stdin, each answered by one JSON line on stdout. The tier
is driven through its own manager, ``FileSystemTierManager``: ``submit_store`` / ``submit_load``
of one ``TransferJob`` per block (its best case: every block on its own pool thread, 16 read and
16 write threads, O_DIRECT where the file system allows), ``get_finished_jobs`` polled until all
are done. Its primary tier is the page-aligned CPU memory vLLM's CPU tier allocates, so the
same buffer layout: ``[source pages | target pages]``.
"""
from __future__ import annotations

import gc
import hashlib
import mmap
import os
import time
from types import SimpleNamespace

import numpy as np


class Driver:
    def __init__(self) -> None:
        from vllm.v1.kv_offload.base import make_offload_key
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        self.make_key, self.Job, self.Manager = make_offload_key, TransferJob, FileSystemTierManager
        self.tier = None
        self.mem: mmap.mmap | None = None  # the round's pool, mapped by prepare, closed by end_round
        self.arr = None
        self.job = 0

    def prepare(self, dir: str, pages: int, page_bytes: int, seed: int, threads: int = 16) -> dict:
        self.n, self.page = pages, page_bytes
        self.mem = mmap.mmap(-1, 2 * pages * page_bytes)
        arr = np.frombuffer(self.mem, dtype=np.uint8).reshape(2 * pages, page_bytes)
        arr[:pages] = np.random.default_rng(seed).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
        arr[pages:] = 0  # touched here: first-touch faults are not the load's
        self.arr = arr
        view = memoryview(self.mem).cast("B", (2 * pages, page_bytes))
        cfg = SimpleNamespace(
            groups=[SimpleNamespace(tokens_per_block=16, layer_names=["layer.0"])],
            parallel=SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, is_parallelism_agnostic=True),
            model=SimpleNamespace(name="gdskv-bench", dtype="uint8"), cache=SimpleNamespace(tokens_per_hash=16),
            canonical_layout=False, kv_cache_layout=None, replicated_layout=False)
        spec = SimpleNamespace(config=cfg, blocks_per_chunk=1, kv_events_config=SimpleNamespace(enable_kv_cache_events=False))
        self.tier = self.Manager(spec, view, "fs", root_dir=os.path.join(dir, "vllm"), n_read_threads=threads,
                                 n_write_threads=threads)
        self.keys = [self.make_key(hashlib.sha256(f"{seed}/{i}".encode()).digest(), 0) for i in range(pages)]
        return {"o_direct": bool(self.tier._use_o_direct)}

    def _run(self, submit, first_slot: int) -> None:
        want = set()
        for i, key in enumerate(self.keys):
            self.job += 1
            want.add(self.job)
            submit(self.Job(job_id=self.job, keys=[key], chunk_ids=np.array([first_slot + i]), is_promotion=False,
                            req_context=None))
        failed = 0
        while want:
            for r in self.tier.get_finished_jobs():
                want.discard(r.job_id)
                failed += not r.success
            if want:
                time.sleep(0.002)
        if failed:
            raise RuntimeError(f"{failed} vLLM tier jobs failed")

    def save(self) -> dict:
        self._run(self.tier.submit_store, 0)
        return {}

    def clear(self) -> dict:
        self.arr[self.n:] = 0
        return {}

    def load(self) -> dict:
        self._run(self.tier.submit_load, self.n)
        return {}

    def check(self) -> dict:
        if not np.array_equal(self.arr[self.n:], self.arr[:self.n]):
            raise RuntimeError("vLLM tier: pages read back differ from the pages saved")
        return {}

    def files(self) -> dict:
        return {"files": [self.tier.file_mapper.get_file_name(k) for k in self.keys]}

    def end_round(self) -> dict:
        """The tier shut down and the round's pool given back: a pool left mapped (the tier's
        view and ``arr`` pin it) added 2x the round's bytes of shared memory a round, until the
        kernel's OOM killer ended the driver on a 24 GiB machine."""
        if self.tier is not None:
            self.tier.shutdown()
            self.tier = None
        if self.mem is not None:
            self.arr = None
            gc.collect()  # the tier's threads and jobs hold the view in reference cycles
            try:
                self.mem.close()
            except BufferError:  # a view still exported: unmapped once it is collected
                pass
            self.mem = None
        return {}


if __name__ == "__main__":
    from driver_loop import serve

    serve(Driver, "vLLM's fs tier")
