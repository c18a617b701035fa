"""Drives LMCache's local-disk backend (``lmcache`` 0.5.6, ``LMCacheEngine``) for ``gdskv bench``.

Run by ``gdskv.peers.PeerSubject`` with the python of LMCache's own virtualenv (never imports
gdskv), JSON lines in and out like ``vllm_fs_driver``. One "page" is one LMCache chunk of
``CHUNK`` tokens; a small CPU connector of ours (LMCache's ``MockGPUConnector`` copies nothing)
copies each chunk's bytes between the engine's memory objects and a page of a plain CPU tensor
pool ``[source pages | target pages]``. Local CPU cache off, so every retrieve reads the disk
backend; O_DIRECT as its ``use_odirect`` setting says.
"""
from __future__ import annotations

import os
import time

CHUNK = 256


def make_connector(base, pool, chunk: int):
    class PoolConnector(base):
        """Copies chunk ``start // chunk`` of the active half of ``pool`` to and from memory objects."""

        def __init__(self) -> None:
            self.pool, self.offset = pool, 0

        def _page(self, start: int):
            return self.pool[self.offset + start // chunk]

        def from_gpu(self, memory_obj, start, end, **kwargs):
            memory_obj.tensor.view(-1).view(self.pool.dtype).copy_(self._page(start))

        def to_gpu(self, memory_obj, start, end, **kwargs):
            self._page(start).copy_(memory_obj.tensor.view(-1).view(self.pool.dtype))

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for m, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(m, s, e)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
            for m, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(m, s, e)

        def get_shape(self, num_tokens):
            import torch
            return torch.Size([1, 2, num_tokens, 1, self.pool.shape[1] // (2 * chunk)])

    return PoolConnector()


class Driver:
    def __init__(self) -> None:
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector import GPUConnectorInterface
        from lmcache.v1.metadata import LMCacheMetadata

        self.torch, self.Builder, self.Config, self.Meta, self.Base = (
            torch, LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheMetadata, GPUConnectorInterface)
        self.engine, self.rounds = None, 0

    def prepare(self, dir: str, pages: int, page_bytes: int, seed: int, o_direct: bool = True) -> dict:
        torch = self.torch
        if page_bytes % (2 * CHUNK):
            raise ValueError(f"page size {page_bytes} is not a whole number of {CHUNK}-token chunks")
        self.n, self.dir = pages, os.path.join(dir, "lmcache")
        os.makedirs(self.dir, exist_ok=True)
        self.pool = torch.empty((2 * pages, page_bytes), dtype=torch.uint8)
        self.pool[:pages] = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(seed))
        self.pool[pages:] = 0  # touched here: first-touch faults are not the load's
        cfg = self.Config.from_defaults(chunk_size=CHUNK, local_cpu=False, local_disk=self.dir,
                                        max_local_disk_size=max(1, 4 * pages * page_bytes / 2**30),
                                        extra_config={"use_odirect": o_direct})
        meta = self.Meta(model_name="gdskv-bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                         kv_dtype=torch.uint8, kv_shape=(1, 2, CHUNK, 1, page_bytes // (2 * CHUNK)), role="worker")
        self.conn = make_connector(self.Base, self.pool, CHUNK)
        self.rounds += 1
        self.engine = self.Builder.get_or_create(f"bench{self.rounds}", cfg, meta, self.conn, None, None)
        self.engine.post_init()
        self.tokens = torch.arange(pages * CHUNK, dtype=torch.long) + self.rounds * 10**9 + seed
        return {}

    def save(self) -> dict:
        self.conn.offset = 0
        self.engine.store(self.tokens)
        self._settle()
        return {}

    def _settle(self) -> None:
        """Wait for the disk backend's writes (LMCache stores to disk in the background)."""
        deadline, want = time.monotonic() + 600, self.n * self.pool.shape[1]
        while time.monotonic() < deadline:
            names = [os.path.join(r, f) for r, _, fs in os.walk(self.dir) for f in fs]
            if len(names) >= self.n and not any(n.endswith(".tmp") for n in names) \
                    and sum(os.path.getsize(n) for n in names) >= want:
                return
            time.sleep(0.005)
        raise RuntimeError("LMCache disk backend never wrote every chunk")

    def clear(self) -> dict:
        self.pool[self.n:] = 0
        return {}

    def load(self) -> dict:
        self.conn.offset = self.n
        self.got = self.engine.retrieve(self.tokens)
        return {}

    def check(self) -> dict:
        if int(self.got.sum()) != len(self.tokens) or not self.torch.equal(self.pool[self.n:], self.pool[:self.n]):
            raise RuntimeError(f"LMCache: {int(self.got.sum())} of {len(self.tokens)} tokens retrieved, or pages differ")
        return {}

    def files(self) -> dict:
        return {"files": [os.path.join(r, f) for r, _, fs in os.walk(self.dir) for f in fs]}

    def end_round(self) -> dict:
        if self.engine is not None:
            self.Builder.destroy(f"bench{self.rounds}")
            self.engine = None
        return {}


if __name__ == "__main__":
    from driver_loop import serve

    serve(Driver, "LMCache")
