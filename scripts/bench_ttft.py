#!/usr/bin/env python3
"""Time to first token with the prompt's prefix served from the store vs computed, decode steps with
saves running vs without, and page loads from the host tier vs the disk, in one run.

    python scripts/bench_ttft.py [--dir DIR] [--lengths 1k,8k] [--full] [--json OUT]

On the CPU reference engine (``gdskv.engine``) with gdskv's TensorRT-LLM connector, default config
(host tier on) unless a row says otherwise. Per prompt length, in order, on one store:

1. ``computed``: the engine alone (a step clock for a connector, offering nothing) prefills the
   prompt and decodes ``--decode`` tokens: TTFT from scratch, and the decode steps' times;
2. ``computed+saving``: the same with gdskv on an empty store, whose saves of the prompt's blocks
   run while the engine decodes: TTFT, and the decode steps' times (which of them had saves in
   flight at their start is counted);
3. ``served cold``: a new connector (``host_bytes = 0``) after the page cache of every chunk file
   was dropped (``posix_fadvise(DONTNEED)``, as ``gdskv bench`` does); ``served warm``: again,
   from the page cache;
4. ``served cold+fill``: a connector with the host tier on, page cache dropped: its loads fill the
   tier; ``served hot``: again, from the host tier.

Every served run must give the computed run's first token and logits bit for bit (else the bench
fails). Then page loads through ``KvService`` on torch CPU tensor pools, per page size: cold (page
cache dropped), warm, cold with the tier filling, and hot (host tier), GB/s and ratios.

The model is large enough that prefill costs real time on a CPU (default: 8 layers, hidden 1024,
16 query heads, 2 KV heads of 64, fp32: 8 KiB of KV per token, 32-token blocks = 256 KiB pages).
Prefill is slow on the reference engine (it computes one token row at a time): the default run
measures 1k and 8k tokens; ``--full`` adds 2k, 4k, 16k and 32k (long).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from gdskv.bench import drop_page_cache
from gdskv.config import GdsKvConfig, parse_size
from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
from gdskv.engine import EngineConfig, ModelConfig, ReferenceEngine
from gdskv.service import KvService
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, SaveStatus

TOKENS_PER_BLOCK = 32
DEFAULT_LENGTHS = (1 << 10, 8 << 10)
FULL_LENGTHS = (1 << 10, 2 << 10, 4 << 10, 8 << 10, 16 << 10, 32 << 10)
TTFT_TARGET = 0.1  # served / computed TTFT at 8k tokens (issue 13)
DECODE_TARGET = 1.05  # decode step with saves running / without
HOT_TARGET = 5.0  # hot (host tier) / cold page loads


# --- step clocks ---------------------------------------------------------------------------------

class StepClock:
    """When each engine step began (``bind_connector_meta`` is called once per step) and how many
    of the service's transfers were in flight then."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.in_flight: list[int] = []

    def tick(self, in_flight: int) -> None:
        self.starts.append(time.perf_counter())
        self.in_flight.append(in_flight)

    def reset(self) -> None:
        self.starts.clear()
        self.in_flight.clear()

    def decode_steps(self, decode_tokens: int) -> tuple[list[float], list[int]]:
        """Durations of the steps after the prefill step (one step: chunk_size >= the prompt)
        that computed a token, and the transfers in flight at each one's start."""
        n = min(decode_tokens - 1, len(self.starts) - 2)
        return ([self.starts[i + 1] - self.starts[i] for i in range(1, n + 1)], self.in_flight[1:n + 1])


class ClockScheduler:
    """The scheduler half of a connector that offers nothing and saves nothing."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def build_connector_meta(self, scheduler_output: Any) -> None:
        return None

    def update_state_after_alloc(self, request: Any, block_ids: Any) -> None:
        pass

    def request_finished(self, request: Any, block_ids: Any) -> bool:
        return False


class ClockWorker:
    """The worker half: only the step clock."""

    def __init__(self) -> None:
        self.clock = StepClock()

    def register_kv_cache_layout(self, layout: Any) -> None:
        pass

    def bind_connector_meta(self, metadata: Any) -> None:
        self.clock.tick(0)

    def start_load_kv(self, stream: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        pass

    def wait_for_save(self, stream: Any) -> None:
        pass

    def get_finished(self, finished_gen: list[int], started_loading: list[int]) -> tuple[list[int], list[int]]:
        return [], []


class TimedWorker(GdsKvWorker):
    """gdskv's worker with a step clock."""

    def __init__(self, llm_args: Any, config: GdsKvConfig) -> None:
        super().__init__(llm_args, config=config)
        self.clock = StepClock()

    def bind_connector_meta(self, metadata: object) -> None:
        self.clock.tick(self.service.in_flight if self.service is not None else 0)
        super().bind_connector_meta(metadata)


# --- the TTFT and decode runs ----------------------------------------------------------------------

@dataclass
class Options:
    directory: str = field(default_factory=tempfile.gettempdir)
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    decode: int = 16
    layers: int = 8
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 2
    intermediate: int = 1024
    page_sizes: tuple[int, ...] = (256 << 10, 1 << 20, 4 << 20)
    load_bytes: int = 256 << 20
    rounds: int = 3


def model_config(o: Options) -> ModelConfig:
    return ModelConfig(vocab_size=4096, hidden_size=o.hidden, num_layers=o.layers, num_heads=o.heads,
                       num_kv_heads=o.kv_heads, head_dim=o.hidden // o.heads, intermediate_size=o.intermediate, seed=13)


def chunk_files(store_path: str) -> list[str]:
    return [e.path for _, _, e in PageStore.open(store_path, create=False).iter_chunk_files()]


class Stack:
    """One reference engine with its connector (none: the step clock alone)."""

    def __init__(self, model: ModelConfig, engine_cfg: EngineConfig, cfg: Optional[GdsKvConfig]) -> None:
        if cfg is None:
            self.worker: Any = ClockWorker()
            scheduler: Any = ClockScheduler()
        else:
            args = StandaloneLlmArgs.build(model.fingerprint(), TOKENS_PER_BLOCK)
            self.worker = TimedWorker(args, cfg)
            scheduler = GdsKvScheduler(args, config=cfg)
        self.engine = ReferenceEngine(model, engine_cfg, scheduler, [self.worker])

    def run(self, prompt: list[int], salt: str, new_tokens: int) -> Any:
        self.worker.clock.reset()
        [result] = self.engine.generate([prompt], new_tokens, cache_salts=[salt])
        return result

    def close(self) -> None:
        if isinstance(self.worker, GdsKvWorker):
            self.worker.close()


def ttft_section(o: Options, store_path: str) -> tuple[list[dict], list[dict]]:
    model = model_config(o)
    longest = max(o.lengths)
    engine_cfg = EngineConfig(tokens_per_block=TOKENS_PER_BLOCK, num_slots=longest // TOKENS_PER_BLOCK + o.decode // TOKENS_PER_BLOCK + 4,
                              chunk_size=longest, max_batch=1)
    base = dict(store_path=store_path, stats_flush_seconds=60.0)
    stacks = {
        "computed": Stack(model, engine_cfg, None),
        "computed+saving": Stack(model, engine_cfg, GdsKvConfig(**base)),
        "disk": Stack(model, engine_cfg, GdsKvConfig(**base, host_bytes=0)),
        "tier": Stack(model, engine_cfg, GdsKvConfig(**base)),
    }
    ttft, decode = [], []
    try:
        for length in o.lengths:
            g = torch.Generator().manual_seed(length)
            prompt = torch.randint(0, model.vocab_size, (length,), generator=g).tolist()
            salt = f"bench-ttft-{length}"
            row: dict[str, Any] = {"tokens": length}
            ref = stacks["computed"].run(prompt, salt, o.decode)
            row["computed"] = ref.ttft_s
            base_steps, _ = stacks["computed"].worker.clock.decode_steps(o.decode)
            saving = stacks["computed+saving"].run(prompt, salt, o.decode)
            row["computed+saving"] = saving.ttft_s
            save_steps, in_flight = stacks["computed+saving"].worker.clock.decode_steps(o.decode)
            overlapped = [i for i, n in enumerate(in_flight) if n > 0]
            decode.append({
                "tokens": length, "steps": len(save_steps),
                "without_ms": 1e3 * statistics.median(base_steps), "with_saves_ms": 1e3 * statistics.median(save_steps),
                "steps_with_saves_in_flight": len(overlapped),
                "overlapped_without_ms": 1e3 * statistics.fmean([base_steps[i] for i in overlapped]) if overlapped else None,
                "overlapped_with_ms": 1e3 * statistics.fmean([save_steps[i] for i in overlapped]) if overlapped else None,
            })
            if saving.tokens != ref.tokens:
                raise RuntimeError(f"{length} tokens: the run with gdskv generated other tokens than the engine alone")
            for name, stack, kind in (("served cold", "disk", "cold"), ("served warm", "disk", "warm"),
                                      ("served cold+fill", "tier", "cold"), ("served hot", "tier", "warm")):
                if kind == "cold":
                    drop_page_cache(chunk_files(store_path))
                r = stacks[stack].run(prompt, salt, 1)
                served = (length - 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
                if r.prefill_tokens_loaded != served or r.tokens[0] != ref.tokens[0] or not torch.equal(r.logits[0], ref.logits[0]):
                    raise RuntimeError(f"{length} tokens, {name}: {r.prefill_tokens_loaded} of {served} tokens served, "
                                       f"first token {r.tokens[0]} vs {ref.tokens[0]} computed (logits must be equal)")
                row[name] = r.ttft_s
            hits = stacks["tier"].worker.service.snapshot()["host_hits"]
            row["host_hits_so_far"] = hits
            ttft.append(row)
            print(f"  {length} tokens: computed {row['computed']:.2f} s, served cold {row['served cold']:.3f} s, "
                  f"hot {row['served hot']:.3f} s", file=sys.stderr, flush=True)
    finally:
        for s in stacks.values():
            s.close()
    return ttft, decode


# --- page loads: cold, warm, hot -------------------------------------------------------------------

def _load_all(svc: KvService, keys: list[bytes], pool: torch.Tensor) -> float:
    t0 = time.perf_counter()
    futs = [svc.load(0, k, [pool[i]]) for i, k in enumerate(keys)]
    statuses = [f.result() for f in futs]
    seconds = time.perf_counter() - t0
    if statuses.count(LoadStatus.LOADED) != len(keys):
        raise RuntimeError(f"{len(keys) - statuses.count(LoadStatus.LOADED)} of {len(keys)} page loads failed")
    return seconds


def loads_section(o: Options, directory: str) -> list[dict]:
    rows = []
    for page in o.page_sizes:
        n = max(8, o.load_bytes // page)
        path = os.path.join(directory, f"loads-{page}")
        base = dict(store_path=path, stats_flush_seconds=60.0)
        spec = NamespaceSpec(model="bench-ttft/loads", dtype="uint8", tokens_per_block=TOKENS_PER_BLOCK,
                             groups=(GroupSpec(0, page, (0,)),))
        g = torch.Generator().manual_seed(page)
        pages = torch.randint(0, 256, (n, page), dtype=torch.uint8, generator=g)
        writer = KvService(GdsKvConfig(**base, host_bytes=0), spec)
        keys = writer.keys(list(range(n * TOKENS_PER_BLOCK + 1)), f"loads-{page}")
        futs = [writer.save(0, k, keys[i - 1] if i else None, [pages[i]]) for i, k in enumerate(keys)]
        if any(f.result() is not SaveStatus.PUBLISHED for f in futs):
            raise RuntimeError("a save was not published")
        writer.close()
        files = chunk_files(path)
        pool = torch.empty_like(pages)
        times: dict[str, list[float]] = {"cold": [], "warm": [], "cold+fill": [], "hot": []}
        for _ in range(o.rounds):
            disk = KvService(GdsKvConfig(**base, host_bytes=0), spec)
            drop_page_cache(files)
            times["cold"].append(_load_all(disk, keys, pool))
            times["warm"].append(_load_all(disk, keys, pool))
            disk.close()
            tier = KvService(GdsKvConfig(**base, host_bytes=2 * n * page), spec)
            drop_page_cache(files)
            times["cold+fill"].append(_load_all(tier, keys, pool))
            times["hot"].append(_load_all(tier, keys, pool))
            if tier.snapshot()["host_hits"] != n:
                raise RuntimeError("the hot loads were not all served from the host tier")
            tier.close()
            if not torch.equal(pool, pages):
                raise RuntimeError("loaded pages differ from the saved ones")
        gbps = {k: n * page / statistics.median(v) / 1e9 for k, v in times.items()}
        rows.append({"page": page, "pages": n, **{f"{k}_gbps": v for k, v in gbps.items()},
                     "hot_vs_cold": gbps["hot"] / gbps["cold"], "fill_cost": gbps["cold+fill"] / gbps["cold"]})
        shutil.rmtree(path, ignore_errors=True)
    return rows


# --- report ----------------------------------------------------------------------------------------

def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _tokens(n: int) -> str:
    return f"{n >> 10}k" if n % 1024 == 0 else str(n)


def report(o: Options, ttft: list[dict], decode: list[dict], loads: list[dict]) -> str:
    m = model_config(o)
    kv = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4
    lines = [f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads / {m.num_kv_heads} KV heads of "
             f"{m.head_dim}, MLP {m.intermediate_size}, fp32; KV {kv >> 10} KiB/token, pages of {TOKENS_PER_BLOCK} tokens = "
             f"{_size(kv * TOKENS_PER_BLOCK)}", "",
             "TTFT (s); ratio = served / computed; target at 8k: hot and cold <= "
             f"{TTFT_TARGET}",
             "| prompt | computed | computed+saving | served cold | served warm | served cold+fill | served hot | cold ratio | hot ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in ttft:
        c = r["computed"]
        lines.append(f"| {_tokens(r['tokens'])} | {c:.2f} | {r['computed+saving']:.2f} | {r['served cold']:.3f} | "
                     f"{r['served warm']:.3f} | {r['served cold+fill']:.3f} | {r['served hot']:.3f} | "
                     f"{r['served cold'] / c:.4f} | {r['served hot'] / c:.4f} |")
    lines += ["", f"decode step (ms, median over the steps after prefill); target: with saves <= {DECODE_TARGET} x without",
              "| prompt | steps | without | with saves | ratio | steps with saves in flight | those steps without | with | ratio |",
              "|---|---|---|---|---|---|---|---|---|"]
    for d in decode:
        ov = (f"{d['overlapped_without_ms']:.1f} | {d['overlapped_with_ms']:.1f} | "
              f"{d['overlapped_with_ms'] / d['overlapped_without_ms']:.3f}") if d["steps_with_saves_in_flight"] else "– | – | –"
        lines.append(f"| {_tokens(d['tokens'])} | {d['steps']} | {d['without_ms']:.1f} | {d['with_saves_ms']:.1f} | "
                     f"{d['with_saves_ms'] / d['without_ms']:.3f} | {d['steps_with_saves_in_flight']} | {ov} |")
    lines += ["", f"page loads through KvService, torch CPU tensor pool (GB/s, median of {o.rounds}); target: hot >= "
              f"{HOT_TARGET} x cold",
              "| page | pages | cold | warm | cold+fill | hot | hot / cold | cold+fill / cold |", "|---|---|---|---|---|---|---|---|"]
    for r in loads:
        lines.append(f"| {_size(r['page'])} | {r['pages']} | {r['cold_gbps']:.2f} | {r['warm_gbps']:.2f} | "
                     f"{r['cold+fill_gbps']:.2f} | {r['hot_gbps']:.2f} | {r['hot_vs_cold']:.1f} | {r['fill_cost']:.2f} |")
    return "\n".join(lines)


def _usage(message: str) -> SystemExit:
    """One line on stderr, exit code 2 (unusable input)."""
    print(f"bench_ttft: {message}", file=sys.stderr)
    return SystemExit(2)


def _parse_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(parse_size(v.strip()) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise _usage(f"{what}: {e}") from None
    if not values or min(values) < 1:
        raise _usage(f"{what}: give positive values, e.g. 1k,8k")
    return values


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the bench's stores are made (and removed)")
    ap.add_argument("--lengths", help="prompt lengths in tokens (default 1k,8k; k = 1024)")
    ap.add_argument("--full", action="store_true", help="1k, 2k, 4k, 8k, 16k and 32k tokens (long)")
    ap.add_argument("--decode", type=int, default=16, help="tokens decoded after each prefill")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--page-sizes", default="256K,1M,4M", help="page sizes of the load section")
    ap.add_argument("--load-bytes", default="256M", help="bytes loaded per page size and kind")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-ttft", action="store_true", help="only the page-load section")
    ap.add_argument("--json", help="also write the figures as JSON to this file")
    a = ap.parse_args(argv)
    lengths = FULL_LENGTHS if a.full else (_parse_list(a.lengths, "--lengths") if a.lengths else DEFAULT_LENGTHS)
    if a.decode < 2:
        raise _usage("--decode must be at least 2")
    o = Options(a.dir, lengths, a.decode, a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate,
                _parse_list(a.page_sizes, "--page-sizes"), _parse_list(a.load_bytes, "--load-bytes")[0], a.rounds)
    workdir = tempfile.mkdtemp(prefix="gdskv-bench-ttft-", dir=o.directory)
    try:
        ttft, decode = ([], []) if a.skip_ttft else ttft_section(o, os.path.join(workdir, "store"))
        loads = loads_section(o, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(report(o, ttft, decode, loads))
    if a.json:
        Path(a.json).write_text(json.dumps({"options": asdict(o), "ttft": ttft, "decode": decode, "loads": loads}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
