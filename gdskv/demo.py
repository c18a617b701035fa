"""The store round trip behind ``gdskv demo``: save pages in one process, load them in another.

Pages are synthetic KV for a few prompts: their bytes are derived from their block keys, so the
reading process can check every byte it loaded without sharing anything but the store.
Run as ``python -m gdskv.demo {save,load} --store PATH --json`` (the CLI starts the load phase in a
fresh process, which is the point: nothing but the store carries over).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

from gdskv.config import load_config
from gdskv.io import make_engine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus

TOKENS_PER_BLOCK = 64


@dataclass
class PhaseReport:
    phase: str
    engine: str
    pages: int
    hits: int
    misses: int
    mismatches: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def demo_prompts(n_prompts: int, blocks: int) -> list[list[int]]:
    """Prompts sharing a long system prefix (half the blocks), then diverging."""
    g = torch.Generator().manual_seed(1234)
    shared = torch.randint(0, 32000, (blocks // 2 * TOKENS_PER_BLOCK,), generator=g).tolist()
    return [shared + torch.randint(0, 32000, ((blocks - blocks // 2) * TOKENS_PER_BLOCK,), generator=g).tolist() for _ in range(n_prompts)]


def page_for(key: bytes, page_bytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    return torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=g)


def _namespace_spec(page_bytes: int) -> NamespaceSpec:
    return NamespaceSpec("gdskv-demo/synthetic", "float16", TOKENS_PER_BLOCK, (GroupSpec(0, page_bytes, tuple(range(8))),))


def run_phase(phase: str, store_path: str, n_prompts: int, blocks: int, page_bytes: int) -> PhaseReport:
    cfg = load_config(store_path=store_path)
    store = PageStore.open(cfg.store_path)
    ns = store.namespace(_namespace_spec(page_bytes))
    engine = make_engine(cfg)
    xfer = PageTransfer(ns, engine, threads=cfg.io_threads)
    keys: list[bytes] = []
    parents: list[bytes | None] = []
    for prompt in demo_prompts(n_prompts, blocks):
        chain = chain_keys(prompt, TOKENS_PER_BLOCK)
        for i, k in enumerate(chain):
            if k not in keys:
                keys.append(k)
                parents.append(chain[i - 1] if i else None)
    pool = torch.empty((len(keys), page_bytes), dtype=torch.uint8)
    hits = misses = mismatches = nbytes = 0
    if phase == "save":
        for i, k in enumerate(keys):
            pool[i] = page_for(k, page_bytes)
        t0 = time.perf_counter()
        futs = [xfer.save_page(0, k, p, [pool[i]]) for i, (k, p) in enumerate(zip(keys, parents))]
        statuses = [f.result() for f in futs]
        seconds = time.perf_counter() - t0
        hits = sum(s is SaveStatus.PUBLISHED for s in statuses)
        misses = sum(s is SaveStatus.DROPPED for s in statuses)
        nbytes = hits * page_bytes
    else:
        present = ns.contains_many(0, keys)
        t0 = time.perf_counter()
        futs = {i: xfer.load_page(0, k, [pool[i]]) for i, k in enumerate(keys) if present[i]}
        results = {i: f.result() for i, f in futs.items()}
        seconds = time.perf_counter() - t0
        for i, k in enumerate(keys):
            if results.get(i) is LoadStatus.LOADED:
                hits += 1
                nbytes += page_bytes
                mismatches += int(not torch.equal(pool[i], page_for(k, page_bytes)))
            else:
                misses += 1
    xfer.close()
    engine_desc = engine.describe()
    engine.close()
    return PhaseReport(phase, engine_desc, len(keys), hits, misses, mismatches, nbytes, seconds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gdskv.demo")
    ap.add_argument("phase", choices=["save", "load"])
    ap.add_argument("--store", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--page-bytes", type=int, default=1 << 20)
    args = ap.parse_args(argv)
    rep = run_phase(args.phase, args.store, args.prompts, args.blocks, args.page_bytes)
    print(json.dumps(asdict(rep) | {"gbps": rep.gbps}))
    return 0 if rep.mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
