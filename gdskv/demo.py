"""What ``gdskv demo`` runs, one phase per process (``python -m gdskv.demo PHASE --store PATH``).

Phases (the CLI runs each in a fresh process, so nothing but the store carries over):
- ``save`` / ``load``: raw store round trip of synthetic KV pages for a few prompts that share a
  prefix. Page bytes derive from their block keys, so the loading process checks every byte it
  read without sharing anything but the store. Reports bytes and GB/s per I/O engine.
- ``engine``: the CPU reference engine generates from prompts that share a long system prompt,
  with the TensorRT-LLM connector attached. Run it twice: the first run computes and saves the
  prompts' KV, the second loads their prefix from the store. Reports tokens served from the
  store, time-to-first-token and the generated tokens (which must match).
Each phase prints one JSON object on its last line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gdskv.config import load_config
from gdskv.eviction import install_budget
from gdskv.io import make_engine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus

TOKENS_PER_BLOCK = 64
ENGINE_TOKENS_PER_BLOCK = 16


@dataclass
class PhaseReport:
    """One store phase's figures. ``misses``: saves the store refused (its capacity limits: byte
    budget, free-space floor, a full disk) or loads that did not come back; ``absent`` (load):
    pages the store does not hold, which it may have evicted or never kept; ``kept``: pages the
    store holds when the phase ends."""

    phase: str
    engine: str
    pages: int
    done: int
    already: int
    misses: int
    mismatches: int
    bytes: int
    seconds: float
    absent: int = 0
    kept: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


STORE_PROMPTS = 4
"""Synthetic prompts of the store phases (``gdskv demo`` sizes its pages by them)."""


def demo_prompts(n_prompts: int, blocks: int, vocab: int = 32000, tokens_per_block: int = TOKENS_PER_BLOCK) -> list[list[int]]:
    """Prompts sharing a long system prefix (half the blocks), then diverging."""
    g = torch.Generator().manual_seed(1234)
    shared = torch.randint(0, vocab, (blocks // 2 * tokens_per_block,), generator=g).tolist()
    return [shared + torch.randint(0, vocab, ((blocks - blocks // 2) * tokens_per_block,), generator=g).tolist() for _ in range(n_prompts)]


def page_for(key: bytes, page_bytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    return torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=g)


def run_store_phase(phase: str, store_path: str, n_prompts: int, blocks: int, page_bytes: int) -> PhaseReport:
    """The demo's ``save`` phase (synthetic pages of ``n_prompts`` prompts written, each chunk
    rewritten) or ``load`` phase (read back and every byte checked), in a process of its own
    (``gdskv demo`` runs ``python -m gdskv.demo``)."""
    cfg = load_config(store_path=store_path)
    store = PageStore.from_config(cfg)
    install_budget(store, cfg)
    ns = store.namespace(NamespaceSpec("gdskv-demo/synthetic", "float16", TOKENS_PER_BLOCK, (GroupSpec(0, page_bytes, tuple(range(8))),)))
    engine = make_engine(cfg)
    xfer = PageTransfer(ns, engine, threads=cfg.io_threads, auth_key=cfg.auth_key())
    parent_of: dict[bytes, bytes | None] = {}
    for prompt in demo_prompts(n_prompts, blocks):
        chain = chain_keys(prompt, TOKENS_PER_BLOCK)
        for i, k in enumerate(chain):
            parent_of.setdefault(k, chain[i - 1] if i else None)
    keys = list(parent_of)
    pool = torch.empty((len(keys), page_bytes), dtype=torch.uint8)
    done = already = misses = mismatches = 0
    if phase == "save":
        for i, k in enumerate(keys):
            ns.remove(0, k)  # the demo owns this namespace: measure a real write every time
            pool[i] = page_for(k, page_bytes)
        t0 = time.perf_counter()
        statuses = [f.result() for f in [xfer.save_page(0, k, parent_of[k], [pool[i]]) for i, k in enumerate(keys)]]
        seconds = time.perf_counter() - t0
        done = statuses.count(SaveStatus.PUBLISHED)
        already = statuses.count(SaveStatus.EXISTS)
        misses = statuses.count(SaveStatus.DROPPED)
        absent = 0
    else:
        present = ns.contains_many(0, keys)
        t0 = time.perf_counter()
        futs = {i: xfer.load_page(0, k, [pool[i]]) for i, k in enumerate(keys) if present[i]}
        results = {i: f.result() for i, f in futs.items()}
        seconds = time.perf_counter() - t0
        for i, k in enumerate(keys):
            if results.get(i) is LoadStatus.LOADED:
                done += 1
                mismatches += int(not torch.equal(pool[i], page_for(k, page_bytes)))
            else:
                misses += 1
        absent = present.count(False)
    xfer.close()
    kept = sum(ns.contains_many(0, keys))
    desc = engine.describe()
    engine.close()
    return PhaseReport(phase, desc, len(keys), done, already, misses, mismatches, done * page_bytes, seconds, absent, kept)


def run_engine_phase(store_path: str, cache_salt: str, n_prompts: int, system_tokens: int, question_tokens: int, max_new_tokens: int) -> dict[str, Any]:
    """Generate with the reference engine + TensorRT-LLM connector on ``store_path``."""
    from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
    from gdskv.engine import EngineConfig, ModelConfig, ReferenceEngine

    cfg = load_config(store_path=store_path)
    model = ModelConfig(vocab_size=512, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16, intermediate_size=256, seed=7)
    engine_cfg = EngineConfig(tokens_per_block=ENGINE_TOKENS_PER_BLOCK, num_slots=256, chunk_size=256)
    name = model.fingerprint()
    scheduler = GdsKvScheduler(StandaloneLlmArgs.build(name, ENGINE_TOKENS_PER_BLOCK), config=cfg)
    worker = GdsKvWorker(StandaloneLlmArgs.build(name, ENGINE_TOKENS_PER_BLOCK), config=cfg)
    engine = ReferenceEngine(model, engine_cfg, scheduler, [worker])
    g = torch.Generator().manual_seed(99)
    system = torch.randint(0, model.vocab_size, (system_tokens,), generator=g).tolist()
    prompts = [system + torch.randint(0, model.vocab_size, (question_tokens,), generator=g).tolist() for _ in range(n_prompts)]
    t0 = time.perf_counter()
    results = engine.generate(prompts, max_new_tokens, cache_salts=[cache_salt] * n_prompts)
    wall = time.perf_counter() - t0
    worker.close()
    return {
        "phase": "engine",
        "model": name,
        "prompt_tokens": [len(p) for p in prompts],
        "served_tokens": [r.prefill_tokens_loaded for r in results],
        "ttft_s": [r.ttft_s for r in results],
        "outputs": [r.tokens for r in results],
        "wall_s": wall,
        "worker": vars(worker.counters),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gdskv.demo")
    ap.add_argument("phase", choices=["save", "load", "engine"])
    ap.add_argument("--store", required=True)
    ap.add_argument("--prompts", type=int, default=STORE_PROMPTS)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--page-bytes", type=int, default=1 << 20)
    ap.add_argument("--salt", default="gdskv-demo")
    ap.add_argument("--system-tokens", type=int, default=480)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    if args.phase == "engine":
        print(json.dumps(run_engine_phase(args.store, args.salt, 2, args.system_tokens, args.question_tokens, args.new_tokens)))
        return 0
    rep = run_store_phase(args.phase, args.store, args.prompts, args.blocks, args.page_bytes)
    print(json.dumps(asdict(rep) | {"gbps": rep.gbps}))
    return 0 if rep.mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
