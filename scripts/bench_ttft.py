#!/usr/bin/env python3
"""Time to first token with the prompt's prefix served from the store vs computed, decode steps with
saves running vs without, and page loads from the host tier vs the disk, in one run.

    python scripts/bench_ttft.py [--dir DIR] [--lengths 1k,8k] [--full] [--json OUT]

On the CPU reference engine (``gdskv.engine``) with gdskv's TensorRT-LLM connector, default config
(host tier on) unless a row says otherwise.

TTFT, per prompt length, in order, on one store:

1. ``computed``: the engine alone prefills the prompt (TTFT from scratch);
2. ``computed+saving``: the same with gdskv on an empty store, saving the prompt's blocks;
3. ``served cold``: a new connector (``host_bytes = 0``) after the page cache of every chunk file
   was dropped (``posix_fadvise(DONTNEED)``, as ``gdskv bench`` does); ``served warm``: again,
   from the page cache;
4. ``served cold+fill``: a connector with the host tier on, page cache dropped: its loads fill the
   tier; ``served hot``: again, from the host tier.

Every run must give the computed run's first token and logits bit for bit (else the bench fails).

Decode: a batch of requests decodes on one engine with gdskv; rounds rotate between no saves and,
per ``--save-rates``, a saver that saves fresh pages through the same ``KvService`` (its I/O
threads, checksums, host tier write-through) at that rate for the whole round (up to
``SAVER_DEPTH`` in flight; 0: as fast as they go), posted from the serving loop at every step's
start as a connector posts the offload of other requests' KV between forward passes (a saver
thread of its own, blocking on each result, was itself a Python thread competing with the
engine's), keeping its last 2 GiB of chunks on disk and removing older ones as it goes
(unbounded, rounds at disk speed once left 45 GB behind, the disk full, and the next section
failed). A step counts as
a decode step when every request it schedules computes one token; its time runs from its
``build_connector_meta`` to the next one. A mode's ratio is paired: the median, over the
rounds, of its median step over the median step without saves in the same rotation (a rotation
runs its modes back to back, so the machine's drift between rotations cancels: on the dev VM
the median step without saves moved 47-51 ms between runs of the same code); the report gives
the rounds' range beside it.

Page loads through ``KvService`` on torch CPU tensor pools, per page size, every page posted in
one ``load_many`` as the connectors post a restored prefix: cold (page cache dropped), warm (the
files read into the page cache first), cold with the tier filling, and hot (host tier), GB/s and
ratios.

MAX (``scripts/max_ttft.py``): the same TTFT comparison on Modular MAX, ``max serve`` on CPU
with gdskv's connector (computed, computed+saving, served cold), with a random Llama of this
model's geometry, from MAX's own virtualenv (``--max-python``; default: the one
``tests/test_max_integration.py`` makes); skipped with the reason when there is none.

The model is large enough that prefill costs real time on a CPU (default: 8 layers, hidden 1024,
16 query heads, 2 KV heads of 64, fp32: 8 KiB of KV per token, 32-token blocks = 256 KiB pages).
Prefill is slow on the reference engine (it computes one token row at a time): the default run
measures 1k and 8k tokens; ``--full`` adds 2k, 4k, 16k and 32k (long).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from gdskv.bench import OneLineParser, drop_page_cache, fill_page_cache, sigterm_as_exit, spread_directories
from gdskv.config import GdsKvConfig, parse_size
from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
from gdskv.engine import EngineConfig, ModelConfig, ReferenceEngine
from gdskv.service import KvService
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, SaveStatus
from max_ttft import MaxUnavailable, max_python, max_section  # scripts/, beside this file

TOKENS_PER_BLOCK = 32
DEFAULT_LENGTHS = (1 << 10, 8 << 10)
FULL_LENGTHS = (1 << 10, 2 << 10, 4 << 10, 8 << 10, 16 << 10, 32 << 10)
TTFT_TARGET = 0.1  # served / computed TTFT at 8k tokens (issue 13)
DECODE_TARGET = 1.05  # decode step with saves running / without
HOT_TARGET = 5.0  # hot (host tier) / cold page loads
SECTIONS = ("ttft", "decode", "loads", "max")


# --- step clock and saver ------------------------------------------------------------------------

class TimedScheduler(GdsKvScheduler):
    """gdskv's scheduler, noting when each step began (``build_connector_meta`` is called once per
    step), the tokens it scheduled per request, and the service's transfers in flight then; with
    a ``saver``, posting its saves there."""

    def __init__(self, llm_args: Any, config: GdsKvConfig) -> None:
        super().__init__(llm_args, config=config)
        self.steps: list[tuple[float, list[int], int]] = []
        self.worker: Optional[GdsKvWorker] = None
        self.saver: Optional[Saver] = None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        scheduled = [d.num_scheduled_tokens for d in scheduler_output.new_requests + scheduler_output.cached_requests]
        service = self.worker.service if self.worker is not None else None
        self.steps.append((time.perf_counter(), [n for n in scheduled if n], service.in_flight if service else 0))
        if self.saver is not None:
            self.saver.tick()
        return super().build_connector_meta(scheduler_output)

    def decode_steps(self) -> tuple[list[float], list[int]]:
        """Durations of the steps where every scheduled request computed one token, and the
        transfers in flight at each one's start."""
        out, flight = [], []
        for (t, scheduled, n), (t_next, _, _) in zip(self.steps, self.steps[1:]):
            if scheduled and all(k == 1 for k in scheduled):
                out.append(t_next - t)
                flight.append(n)
        return out, flight


SAVER_DEPTH = 64
"""Saves the decode section's saver keeps in flight at most: it posts only between steps, and
the steps here are long (100+ ms), so a few in flight would cap it far below its rate."""
SAVER_KEEP_BYTES = 2 << 30
"""Bytes of the decode section saver's chunks kept on disk at most (see ``Saver``)."""


class Saver:
    """Saves fresh pages through ``service`` from the serving loop: at every step's start
    (``TimedScheduler.build_connector_meta``) it takes the saves that finished and posts as
    many new ones as ``rate`` bytes per second allows, with up to ``depth`` in flight (``rate``
    0: as fast as they go), as a connector posts other requests' saves between forward passes;
    the service finishes them there too (``KvService.reap``, from the worker's ``get_finished``).
    The chunks it published beyond the last ``keep_bytes`` are removed as it goes (the oldest
    first, as a budget would evict them), so a long round at disk speed cannot fill the disk."""

    def __init__(self, service: KvService, depth: int, rate: int, keep_bytes: int = SAVER_KEEP_BYTES) -> None:
        self.service, self.depth, self.rate = service, depth, rate
        self.group = service.group_ids[0]
        self.page = torch.randint(0, 256, (service.bytes_per_page(self.group),), dtype=torch.uint8)
        self.keep = max(1, keep_bytes // self.page.numel())
        self.published = self.posted = 0
        self.start_s = time.perf_counter()
        self._inflight: deque = deque()
        self._kept: deque = deque()

    def start(self) -> None:
        self.start_s = time.perf_counter()

    def tick(self) -> None:
        """One step's share: settle what finished, post what is due, forget old chunks."""
        while self._inflight and self._inflight[0][1].done():
            self._settle(*self._inflight.popleft())
        n = self.depth - len(self._inflight)
        if self.rate:
            n = min(n, int(self.rate * (time.perf_counter() - self.start_s)) // self.page.numel() - self.posted)
        if n > 0:
            keys = [os.urandom(32) for _ in range(n)]
            self._inflight.extend(zip(keys, self.service.save_many(self.group, [(k, None, [self.page]) for k in keys])))
            self.posted += n
        self._forget()

    def _settle(self, key: bytes, fut: Any) -> None:
        if fut.result() is SaveStatus.PUBLISHED:
            self.published += 1
            self._kept.append(key)

    def _forget(self) -> None:
        while len(self._kept) > self.keep:
            try:
                os.unlink(self.service.namespace.chunk_path(self.group, self._kept.popleft()))
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        """After the round: wait for the saves still in flight."""
        while self._inflight:
            self._settle(*self._inflight.popleft())
        self._forget()


# --- the TTFT and decode runs ----------------------------------------------------------------------

@dataclass
class Options:
    directory: str = field(default_factory=tempfile.gettempdir)
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    layers: int = 8
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 2
    intermediate: int = 1024
    decode: int = 32
    decode_prompt: int = 512
    decode_batch: int = 4
    save_rates: tuple[int, ...] = (64 << 20, 0)
    decode_host_bytes: Optional[int] = None
    max_python: Optional[str] = None
    page_sizes: tuple[int, ...] = (256 << 10, 1 << 20, 4 << 20)
    load_bytes: int = 256 << 20
    rounds: int = 3


def model_config(o: Options) -> ModelConfig:
    return ModelConfig(vocab_size=4096, hidden_size=o.hidden, num_layers=o.layers, num_heads=o.heads,
                       num_kv_heads=o.kv_heads, head_dim=o.hidden // o.heads, intermediate_size=o.intermediate, seed=13)


def chunk_files(store_path: str) -> list[str]:
    return [e.path for _, _, e in PageStore.open(store_path, create=False).iter_chunk_files()]


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class Stack:
    """One reference engine with gdskv's connector (``cfg`` None: the engine alone)."""

    def __init__(self, model: ModelConfig, engine_cfg: EngineConfig, cfg: Optional[GdsKvConfig]) -> None:
        self.scheduler: Optional[TimedScheduler] = None
        self.worker: Optional[GdsKvWorker] = None
        if cfg is not None:
            args = StandaloneLlmArgs.build(model.fingerprint(), TOKENS_PER_BLOCK)
            self.scheduler = TimedScheduler(args, cfg)
            self.worker = self.scheduler.worker = GdsKvWorker(args, config=cfg)
        self.engine = ReferenceEngine(model, engine_cfg, self.scheduler, None if self.worker is None else [self.worker])

    def run(self, prompts: list[list[int]], salt: str, new_tokens: int) -> list[Any]:
        if self.scheduler is not None:
            self.scheduler.steps.clear()
        return self.engine.generate(prompts, new_tokens, cache_salts=[salt] * len(prompts))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def ttft_section(o: Options, store_path: str) -> list[dict]:
    model = model_config(o)
    longest = max(o.lengths)
    engine_cfg = EngineConfig(tokens_per_block=TOKENS_PER_BLOCK, num_slots=longest // TOKENS_PER_BLOCK + 4,
                              chunk_size=longest, max_batch=1, freeze_heap=True, steady_heap=True)
    base = dict(store_path=store_path, stats_flush_seconds=60.0)
    stacks = {
        "computed": Stack(model, engine_cfg, None),
        "computed+saving": Stack(model, engine_cfg, GdsKvConfig(**base)),
        "disk": Stack(model, engine_cfg, GdsKvConfig(**base, host_bytes=0)),
        "tier": Stack(model, engine_cfg, GdsKvConfig(**base)),
    }
    rows = []
    try:
        for length in o.lengths:
            prompt = random_prompt(length, model.vocab_size, length)
            salt = f"bench-ttft-{length}"
            row: dict[str, Any] = {"tokens": length}
            [ref] = stacks["computed"].run([prompt], salt, 1)
            served = (length - 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
            for name, stack, cold in (("computed", "computed", False), ("computed+saving", "computed+saving", False),
                                      ("served cold", "disk", True), ("served warm", "disk", False),
                                      ("served cold+fill", "tier", True), ("served hot", "tier", False)):
                if cold:
                    drop_page_cache(chunk_files(store_path))
                [r] = [ref] if name == "computed" else stacks[stack].run([prompt], salt, 1)
                loaded = 0 if name.startswith("computed") else served
                if r.prefill_tokens_loaded != loaded or r.tokens != ref.tokens or not torch.equal(r.logits[0], ref.logits[0]):
                    raise RuntimeError(f"{length} tokens, {name}: {r.prefill_tokens_loaded} of {loaded} tokens served, "
                                       f"first token {r.tokens[0]} vs {ref.tokens[0]} computed (logits must be equal)")
                row[name] = r.ttft_s
            row["host_hits_so_far"] = stacks["tier"].worker.service.snapshot()["host_hits"]
            rows.append(row)
            print(f"  {length} tokens: computed {row['computed']:.2f} s, served cold {row['served cold']:.3f} s, "
                  f"hot {row['served hot']:.3f} s", file=sys.stderr, flush=True)
    finally:
        for s in stacks.values():
            s.close()
    return rows


def decode_section(o: Options, store_path: str) -> list[dict]:
    model = model_config(o)
    engine_cfg = EngineConfig(tokens_per_block=TOKENS_PER_BLOCK, chunk_size=o.decode_prompt, max_batch=o.decode_batch,
                              num_slots=o.decode_batch * ((o.decode_prompt + o.decode) // TOKENS_PER_BLOCK + 2) + 4,
                              freeze_heap=True, steady_heap=True)
    cfg = GdsKvConfig(store_path=store_path, stats_flush_seconds=60.0, host_bytes=o.decode_host_bytes)
    stack = Stack(model, engine_cfg, cfg)
    prompts = [random_prompt(o.decode_prompt, model.vocab_size, 7000 + i) for i in range(o.decode_batch)]
    modes: list[Optional[int]] = [None, *o.save_rates]  # None: no saver
    times: dict[Optional[int], list[float]] = {m: [] for m in modes}
    round_ms: dict[Optional[int], list[float]] = {m: [] for m in modes}  # each round's median step
    in_flight: dict[Optional[int], list[int]] = {m: [] for m in modes}
    published: dict[Optional[int], int] = {m: 0 for m in modes}
    seconds: dict[Optional[int], float] = {m: 0.0 for m in modes}
    try:
        reference = [r.tokens for r in stack.run(prompts, "bench-decode", o.decode)]  # computes, saves the prompts
        for i in range(o.rounds):
            for mode in modes[i % len(modes):] + modes[:i % len(modes)]:  # the order rotates between rounds
                saver = Saver(stack.worker.service, SAVER_DEPTH, mode) if mode is not None else None
                t0 = time.perf_counter()
                if saver is not None:
                    saver.start()
                stack.scheduler.saver = saver
                try:
                    results = stack.run(prompts, "bench-decode", o.decode)
                finally:
                    stack.scheduler.saver = None
                    if saver is not None:
                        saver.stop()
                        published[mode] += saver.published
                seconds[mode] += time.perf_counter() - t0
                if [r.tokens for r in results] != reference:
                    raise RuntimeError("decode: a round generated other tokens")
                steps, flight = stack.scheduler.decode_steps()
                times[mode] += steps
                round_ms[mode].append(statistics.median(steps))
                in_flight[mode] += flight
        page = stack.worker.service.bytes_per_page(stack.worker.service.group_ids[0])
    finally:
        stack.close()
    paired = {m: [a / b for a, b in zip(round_ms[m], round_ms[None])] for m in modes}
    return [{"context": o.decode_prompt, "batch": o.decode_batch, "saves": "none" if m is None else ("as fast as they go" if m == 0 else f"{m >> 20} MiB/s"),
             "steps": len(times[m]), "step_ms": 1e3 * statistics.median(times[m]), "ratio": statistics.median(paired[m]),
             "round_ratios": paired[m],
             "mean_saves_in_flight": statistics.fmean(in_flight[m]) if in_flight[m] else 0.0,
             "saved_mb_per_s": published[m] * page / seconds[m] / 1e6 if seconds[m] else 0.0} for m in modes]


# --- page loads: cold, warm, hot -------------------------------------------------------------------

def _load_all(svc: KvService, keys: list[bytes], pool: torch.Tensor) -> float:
    """Seconds to load every key's page into ``pool``, posted at once as the connectors post a
    restored prefix (``load_many``)."""
    t0 = time.perf_counter()
    futs = svc.load_many(0, [(k, [pool[i]]) for i, k in enumerate(keys)])
    statuses = [f.result() for f in futs]
    seconds = time.perf_counter() - t0
    if statuses.count(LoadStatus.LOADED) != len(keys):
        raise RuntimeError(f"{len(keys) - statuses.count(LoadStatus.LOADED)} of {len(keys)} page loads failed")
    return seconds


def loads_section(o: Options, directory: str) -> list[dict]:
    rows = []
    for page in o.page_sizes:
        n = max(8, o.load_bytes // page)
        path = tempfile.mkdtemp(prefix=f"loads-{page}-", dir=directory)
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
            fill_page_cache(files)  # cold loads read with O_DIRECT: they leave the page cache empty
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


def max_section_of(o: Options, workdir: Path) -> tuple[list[dict], Optional[str]]:
    """The MAX section's rows (``scripts/max_ttft.py``), or why it was skipped."""
    try:
        python = max_python(o.max_python)
    except MaxUnavailable as e:
        return [], str(e)
    return max_section(python, workdir, o.lengths, o.layers, o.heads, o.kv_heads, o.hidden // o.heads, o.intermediate,
                       lambda store: drop_page_cache(chunk_files(store)),
                       log=lambda line: print(line, file=sys.stderr, flush=True)), None


# --- report ----------------------------------------------------------------------------------------

def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _tokens(n: int) -> str:
    return f"{n >> 10}k" if n % 1024 == 0 else str(n)


def report(o: Options, ttft: list[dict], decode: list[dict], loads: list[dict], max_rows: list[dict],
           max_skipped: Optional[str]) -> str:
    m = model_config(o)
    kv = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4
    lines = [f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads / {m.num_kv_heads} KV heads of "
             f"{m.head_dim}, MLP {m.intermediate_size}, fp32; KV {kv >> 10} KiB/token, pages of {TOKENS_PER_BLOCK} tokens = "
             f"{_size(kv * TOKENS_PER_BLOCK)}", ""]
    if ttft:
        lines += [f"TTFT (s); ratio = served / computed; target at 8k: <= {TTFT_TARGET}",
                  "| prompt | computed | computed+saving | served cold | served warm | served cold+fill | served hot | "
                  "cold ratio | hot ratio |", "|---|---|---|---|---|---|---|---|---|"]
        for r in ttft:
            c = r["computed"]
            lines.append(f"| {_tokens(r['tokens'])} | {c:.2f} | {r['computed+saving']:.2f} | {r['served cold']:.3f} | "
                         f"{r['served warm']:.3f} | {r['served cold+fill']:.3f} | {r['served hot']:.3f} | "
                         f"{r['served cold'] / c:.4f} | {r['served hot'] / c:.4f} |")
        lines.append("")
    if decode:
        d0 = decode[0]
        lines += [f"decode step (ms, median), {d0['batch']} requests at {_tokens(d0['context'])} tokens of context, "
                  f"{o.rounds} rounds of each, rotating; target: with saves <= {DECODE_TARGET} x without",
                  "| saves running | steps | step | ratio | rounds' ratios | saves in flight per step | saved (MB/s) |",
                  "|---|---|---|---|---|---|---|"]
        for d in decode:
            spread = f"{min(d['round_ratios']):.3f}-{max(d['round_ratios']):.3f}"
            lines.append(f"| {d['saves']} | {d['steps']} | {d['step_ms']:.1f} | {d['ratio']:.3f} | {spread} | "
                         f"{d['mean_saves_in_flight']:.1f} | {d['saved_mb_per_s']:.0f} |")
        lines.append("")
    if max_rows:
        lines += [f"MAX (max serve on CPU, the same model as a random Llama, pages of 128 tokens): TTFT (s) at the "
                  "client, first streamed token; ratio = served / computed",
                  "| prompt tokens | computed | computed+saving | served cold | ratio |", "|---|---|---|---|---|"]
        lines += [f"| {r['prompt_tokens']} | {r['computed_s']:.2f} | {r['computed+saving_s']:.2f} | {r['served_cold_s']:.3f} | "
                  f"{r['served_over_computed']:.4f} |" for r in max_rows]
        lines.append("")
    if max_skipped:
        lines += [f"MAX: skipped ({max_skipped})", ""]
    if loads:
        lines += [f"page loads through KvService, torch CPU tensor pool (GB/s, median of {o.rounds}); target: hot >= "
                  f"{HOT_TARGET} x cold", "| page | pages | cold | warm | cold+fill | hot | hot / cold | cold+fill / cold |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {_size(r['page'])} | {r['pages']} | {r['cold_gbps']:.2f} | {r['warm_gbps']:.2f} | {r['cold+fill_gbps']:.2f} | "
                  f"{r['hot_gbps']:.2f} | {r['hot_vs_cold']:.1f} | {r['fill_cost']:.2f} |" for r in loads]
    return "\n".join(lines)


def _usage(message: str) -> SystemExit:
    """One line on stderr, exit code 2 (unusable input)."""
    print(f"bench_ttft: {message}", file=sys.stderr)
    return SystemExit(2)


def _size_arg(text: str, what: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise _usage(f"{what}: {e}") from None


def _parse_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(parse_size(v.strip()) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise _usage(f"{what}: {e}") from None
    if not values or min(values) < 1:
        raise _usage(f"{what}: give positive values, e.g. 1k,8k")
    return values


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = OneLineParser(prog="bench_ttft", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the bench's stores are made (and removed)")
    ap.add_argument("--lengths", help="prompt lengths in tokens (default 1k,8k; k = 1024)")
    ap.add_argument("--full", action="store_true", help="1k, 2k, 4k, 8k, 16k and 32k tokens (long)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=32, help="tokens each request decodes in the decode section")
    ap.add_argument("--decode-prompt", type=int, default=512, help="prompt tokens of each request there")
    ap.add_argument("--decode-batch", type=int, default=4, help="requests decoding together there")
    ap.add_argument("--save-rates", default="64M,0", help="bytes per second the decode section's saver saves at, "
                    "one set of rounds each (0: as fast as the saves go)")
    ap.add_argument("--decode-host-bytes", help="host_bytes of the decode section's connector (default: the config's)")
    ap.add_argument("--page-sizes", default="256K,1M,4M", help="page sizes of the load section")
    ap.add_argument("--load-bytes", default="256M", help="bytes loaded per page size and kind")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=list(SECTIONS), action="append", help="run only these sections")
    ap.add_argument("--max-python", help="python of a virtualenv with MAX and this checkout of gdskv (MAX section; "
                    "default: ~/.cache/gdskv-test/venv-max, made by tests/test_max_integration.py)")
    ap.add_argument("--json", help="also write the figures as JSON to this file")
    a = ap.parse_args(argv)
    lengths = FULL_LENGTHS if a.full else (_parse_list(a.lengths, "--lengths") if a.lengths else DEFAULT_LENGTHS)
    if a.decode < 2 or a.decode_prompt < 1 or a.decode_batch < 1 or a.rounds < 1:
        raise _usage("--decode must be at least 2; --decode-prompt, --decode-batch and --rounds at least 1")
    rates = tuple(_size_arg(v.strip(), "--save-rates") for v in a.save_rates.split(",") if v.strip())
    o = Options(directory=a.dir, lengths=lengths, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                intermediate=a.intermediate, decode=a.decode, decode_prompt=a.decode_prompt, decode_batch=a.decode_batch,
                save_rates=rates, page_sizes=_parse_list(a.page_sizes, "--page-sizes"),
                load_bytes=_parse_list(a.load_bytes, "--load-bytes")[0], rounds=a.rounds,
                decode_host_bytes=None if a.decode_host_bytes is None else _size_arg(a.decode_host_bytes, "--decode-host-bytes"),
                max_python=a.max_python)
    sections = set(a.only or SECTIONS)
    workdir = tempfile.mkdtemp(prefix="gdskv-bench-ttft-", dir=o.directory)
    # Each section's store lands apart from the files a run before removed (gdskv.bench.spread_directories):
    # on ext4 without a journal, creating files beside them costs the saves, and so the decode steps, CPU.
    spread_directories(Path(workdir))
    try:
        ttft = ttft_section(o, tempfile.mkdtemp(prefix="ttft-", dir=workdir)) if "ttft" in sections else []
        decode = decode_section(o, tempfile.mkdtemp(prefix="decode-", dir=workdir)) if "decode" in sections else []
        loads = loads_section(o, workdir) if "loads" in sections else []
        max_rows, max_skipped = max_section_of(o, Path(workdir)) if "max" in sections else ([], None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(report(o, ttft, decode, loads, max_rows, max_skipped))
    if a.json:
        Path(a.json).write_text(json.dumps({"options": asdict(o), "ttft": ttft, "decode": decode, "loads": loads,
                                            "max": max_rows, "max_skipped": max_skipped}, indent=2))
    return 0


if __name__ == "__main__":
    with sigterm_as_exit():
        sys.exit(main())
