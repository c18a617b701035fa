#!/usr/bin/env python3
"""Decode latency of N requests while another request's long prefix is restored from the store.

    python scripts/bench_decode_under_load.py [--prefix 4096,32768] [--decoders 4] [--rounds 3] [--dir DIR]
                                              [--pin-engine] [--json]

On the reference engine with gdskv's TensorRT-LLM connector and a real store: N short requests
decode; at step ``--arrive`` a request whose prompt has a ``--prefix``-token stored prefix arrives
and is restored, with

- ``async``: ``async_load_min_bytes = 0`` (``is_async=True``: the request waits outside the batch
  until ``get_finished`` reports its pages in place);
- ``hot``: as ``async``, the prefix served by the worker's host tier (loaded once from the disk
  before the run: a prefix this worker restored before, the common case of a shared system prompt);
- ``sync``: ``async_load_min_bytes = None`` (the load runs inside the forward pass of the step
  that admits it, as TensorRT-LLM's ``is_async=False`` does);
- ``none``: no such request at all (the baseline).

``--pin-engine`` runs the engine's thread on one CPU and every thread started after it (the
transfer threads, and the native threads they start) on the others: a diagnostic of how much of
the decoders' slowdown is the load's CPU work landing on the engine's CPU (on the 2-vCPU
development VM it took the window's p50 from 1.8-2.4x to 1.0-1.16x the no-load one; the p99, set
by the admitting step and a few slow early steps, stayed 1.7-2.8x).

Printed per prefix and mode: p50 / p99 of the decoders' step time over the *load window* (the
steps between the restored request's arrival and its joining the batch: in ``async`` the steps it
was held out while loading, in ``sync`` the admitting step that carried the load, in ``none`` as
many steps at the same point), the same over every decode step of the run, the step in which
the restored request first computes ("join", which attends over its whole prefix and so is slow
in any mode), the load's bytes, the restored request's TTFT and the share of the machine's CPU
time its hypervisor took meanwhile (steal: on a shared VM, what no process inside can change);
then a ratio line per prefix: async p99 / none p99 over the load window (target <= 1.2 at 32k
tokens), hot's and sync's.

The engine runs as a serving process would: its heap frozen for the collector and kept steady
for the C allocator (``EngineConfig.freeze_heap``, ``steady_heap``: without the latter, every
step's heap trims flushed the TLB of the CPU the transfers ran on, and the decoders' steps were
1.5-2x slower while a prefix loaded). The stored prefix is random KV published under the
prompt's real block keys (a benchmark of the load path, not of the model). Cold reads: every
chunk file's page cache is dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before each run
(no root needed), and the store reads with O_DIRECT (``o_direct = "all"``, gdskv's default)
anyway.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gdskv.bench import OneLineParser, sigterm_as_exit  # noqa: E402
from gdskv.config import GdsKvConfig  # noqa: E402
from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs  # noqa: E402
from gdskv.engine import EngineConfig, ModelConfig, ReferenceEngine  # noqa: E402
from gdskv.transfer import LoadStatus, page_segments  # noqa: E402

TPB = 64
MODEL = ModelConfig(vocab_size=97, hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=128,
                    intermediate_size=256, seed=7)
MODES = {"async": 0, "hot": 0, "sync": None, "none": None}


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, MODEL.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stack(store: str, threshold: Optional[int], slots: int, decoders: int) -> tuple[ReferenceEngine, GdsKvWorker]:
    cfg = GdsKvConfig(store_path=store, async_load_min_bytes=threshold)
    args = StandaloneLlmArgs.build(MODEL.fingerprint(), TPB)
    scheduler, worker = GdsKvScheduler(args, config=cfg), GdsKvWorker(args, config=cfg)
    ecfg = EngineConfig(tokens_per_block=TPB, num_slots=slots, chunk_size=1 << 20, max_batch=decoders + 1,
                        async_timeout_s=300.0, freeze_heap=True, steady_heap=True)
    return ReferenceEngine(MODEL, ecfg, scheduler, [worker]), worker


def publish_prefix(store: str, tokens: list[int], slots: int) -> int:
    """Publish random KV under every full block key of ``tokens``; the bytes published."""
    engine, worker = stack(store, None, slots, 1)
    service = worker.service
    keys = service.keys(tokens)
    group = engine.layouts[0].group(0)
    segments = page_segments(group, 0)
    gen = torch.Generator().manual_seed(1)
    futures = []
    for i, key in enumerate(keys):
        for s in segments:
            s.view(torch.uint8).copy_(torch.randint(0, 256, s.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
        futures.append(service.save(0, key, keys[i - 1] if i else None, segments))
        futures[-1].result()  # the page is reused for the next block
    worker.close()
    return len(keys) * service.bytes_per_page(0)


def warm_tier(engine: ReferenceEngine, worker: GdsKvWorker, tokens: list[int]) -> None:
    """``hot``: every stored block of ``tokens`` loaded once from the disk into a page slot the run
    has not used yet, so the worker's host tier holds the prefix (untimed)."""
    service = worker.service
    segments = page_segments(engine.layouts[0].group(0), 0)
    for key in service.keys(tokens):
        if service.load(0, key, segments).result() is not LoadStatus.LOADED:
            raise RuntimeError("hot: a block of the stored prefix did not load")


def drop_cache(store: str) -> int:
    """``POSIX_FADV_DONTNEED`` on every file under the store; how many files."""
    n = 0
    for root, _, files in os.walk(store):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def stolen_ticks() -> Optional[int]:
    """Clock ticks the hypervisor took from this machine's CPUs so far (``/proc/stat``'s steal),
    or None where there is no such count."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return None


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run(store: str, mode: str, long_prompt: list[int], decoders: int, steps: int, arrive: int, slots: int) -> dict[str, Any]:
    drop_cache(store)
    engine, worker = stack(store, MODES[mode], slots, decoders)
    if mode == "hot":
        warm_tier(engine, worker, long_prompt)
    prompts = [prompt(16, 100 + i) for i in range(decoders)]
    arrivals, news = [0] * decoders, [steps] * decoders
    if mode != "none":
        prompts.append(long_prompt)
        arrivals.append(arrive)
        news.append(2)
    stolen, t0 = stolen_ticks(), time.monotonic()
    results = engine.generate(prompts, news, arrival_steps=arrivals)
    seconds, stolen_after = time.monotonic() - t0, stolen_ticks()
    worker.close()
    steal = (float("nan") if stolen is None or stolen_after is None else
             100.0 * (stolen_after - stolen) / os.sysconf("SC_CLK_TCK") / (seconds * (os.cpu_count() or 1)))
    log = engine.step_log
    decoding = [i for i, s in enumerate(log) if len(s.decoding) >= decoders and not s.prefilling]
    restored = results[-1] if mode != "none" else None
    if restored is not None:
        rid = restored.request_id
        joined = next(i for i, s in enumerate(log) if rid in s.prefilling + s.decoding)
        window = [i for i, s in enumerate(log) if rid in s.loading] if mode != "sync" else [joined]
        join_s = log[joined].seconds
    else:
        window, join_s = [], float("nan")
    return {"log": [s.seconds for s in log], "decode_steps": decoding, "window": window, "join_s": join_s,
            "ttft_s": restored.ttft_s if restored is not None else float("nan"),
            "loaded": restored.prefill_tokens_loaded if restored is not None else 0,
            "bytes_loaded": worker.counters.loads_loaded, "host_hits": worker.service.snapshot()["host_hits"],
            "steal_pct": steal}


def summary(r: dict[str, Any]) -> dict[str, float]:
    """One run's figures (ms): the decoders' step time over the load window and over every
    decode step, the joining step, the restored request's TTFT, its tokens served and the pages
    of them the host tier served."""
    win = [r["log"][i] for i in r["window"]]
    every = [r["log"][i] for i in r["decode_steps"]]
    return {"window_steps": len(win), "win_p50_ms": pct(win, .5) * 1e3, "win_p99_ms": pct(win, .99) * 1e3,
            "all_p50_ms": pct(every, .5) * 1e3, "all_p99_ms": pct(every, .99) * 1e3,
            "join_ms": r["join_s"] * 1e3, "ttft_ms": r["ttft_s"] * 1e3, "loaded": r["loaded"], "host_hits": r["host_hits"],
            "steal_pct": r["steal_pct"]}


def pin_engine_thread() -> Optional[str]:
    """``--pin-engine``: this (the engine's) thread on the first CPU it may use, every thread
    started from now on on the others; None, or why it cannot be done here."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return "this platform cannot set CPU affinity"
    if len(cpus) < 2:
        return f"needs at least 2 CPUs, this process may use {len(cpus)}"
    others = set(cpus[1:])
    run = threading.Thread.run

    def placed(thread: threading.Thread) -> None:
        os.sched_setaffinity(0, others)
        run(thread)

    threading.Thread.run = placed  # type: ignore[method-assign]
    os.sched_setaffinity(0, {cpus[0]})
    return None


def _prefixes(text: str) -> list[int]:
    """``--prefix``: positive token counts, comma-separated."""
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"give positive token counts, comma-separated (e.g. 4096,32768), not {text!r}")
    return values


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="bench_decode_under_load", description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=_prefixes, default=[4096, 32768], help="prefix lengths in tokens, comma-separated")
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--steps", type=int, default=160, help="tokens each decoder generates")
    ap.add_argument("--arrive", type=int, default=20, help="step at which the restored request arrives")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of every mode, interleaved (the order rotates); figures are medians over rounds")
    ap.add_argument("--dir", default=None, help="store directory (default: a temporary one, removed after)")
    ap.add_argument("--pin-engine", action="store_true",
                    help="the engine's thread on one CPU, every other thread of the run on the rest (a diagnostic)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.pin_engine:
        refused = pin_engine_thread()
        if refused is not None:
            ap.error(f"--pin-engine: {refused}")
    prefixes = a.prefix
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="gdskv-bench-dul-"))
    rows: list[dict[str, Any]] = []
    ratios: dict[int, list[float]] = {}
    try:
        for prefix in prefixes:
            store = str(root / f"store-{prefix}")
            long_prompt = prompt(prefix + 1, 9)  # every prefix token servable, one left to compute
            slots = prefix // TPB + a.decoders * (-(-(16 + a.steps) // TPB)) + 8
            nbytes = publish_prefix(store, long_prompt, slots)
            by_round = []
            modes = ["none", "async", "hot", "sync"]
            for rnd in range(a.rounds):
                order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
                per_mode = {mode: run(store, mode, long_prompt, a.decoders, a.steps, a.arrive, slots) for mode in order}
                # the no-load baseline's window: as many decode steps as async's, from the same step on
                n = max(1, len(per_mode["async"]["window"]))
                per_mode["none"]["window"] = [i for i in per_mode["none"]["decode_steps"] if i >= a.arrive][:n]
                by_round.append({mode: summary(r) for mode, r in per_mode.items()})
            for mode in modes:
                rounds = [rd[mode] for rd in by_round]
                row = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
                row.update(prefix=prefix, mode=mode, bytes=nbytes if mode != "none" else 0,
                           win_p99_rounds_ms=[r["win_p99_ms"] for r in rounds])
                rows.append(row)
            ratios[prefix] = {m: [rd[m]["win_p99_ms"] / rd["none"]["win_p99_ms"] for rd in by_round] for m in ("async", "hot")}
            shutil.rmtree(store, ignore_errors=True)
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    if a.json:
        print(json.dumps({"rows": rows, "over_none_p99_by_round": ratios, "pinned": a.pin_engine}, indent=1))
        return 0
    print(f"reference engine: {MODEL.num_layers} layers, {MODEL.num_kv_heads} KV heads x {MODEL.head_dim}, fp32 KV "
          f"({2 * MODEL.num_layers * MODEL.num_kv_heads * MODEL.head_dim * 4 // 1024} KiB/token), {TPB} tokens/block; "
          f"{a.decoders} decoders; restored request arrives at step {a.arrive}; page cache dropped (fadvise) + O_DIRECT reads"
          + ("; the engine's thread pinned to one CPU, the others' threads to the rest" if a.pin_engine else ""))
    head = (f"{'prefix':>7} {'mode':>5} {'MiB':>6} {'win steps':>9} {'win p50':>8} {'win p99':>8} {'all p50':>8} {'all p99':>8} "
            f"{'join':>8} {'TTFT':>8} {'loaded':>7} {'steal':>6}")
    print(head)
    for r in rows:
        print(f"{r['prefix']:>7} {r['mode']:>5} {r['bytes'] / 2**20:>6.0f} {r['window_steps']:>9.0f} {r['win_p50_ms']:>7.2f}m "
              f"{r['win_p99_ms']:>7.2f}m {r['all_p50_ms']:>7.2f}m {r['all_p99_ms']:>7.2f}m {r['join_ms']:>7.1f}m {r['ttft_ms']:>7.1f}m {r['loaded']:>7.0f} "
              f"{r['steal_pct']:>5.1f}%")
    for prefix in prefixes:
        by = {r["mode"]: r for r in rows if r["prefix"] == prefix}
        base = by["none"]["win_p99_ms"]
        print(f"ratio prefix={prefix}: async p99 / no-load p99 = {by['async']['win_p99_ms'] / base:.2f} (target <= 1.2; "
              f"per round, each against its own no-load run: {', '.join(f'{x:.2f}' for x in ratios[prefix]['async'])}); "
              f"hot {by['hot']['win_p99_ms'] / base:.2f} ({', '.join(f'{x:.2f}' for x in ratios[prefix]['hot'])}); "
              f"sync {by['sync']['win_p99_ms'] / base:.2f}")
    print(f"figures are medians over {a.rounds} rounds; the modes of a round run one after another, in an order that rotates; "
          "steal: the share of the machine's CPU time its hypervisor took during the runs (a shared VM's noise)")
    return 0


if __name__ == "__main__":
    with sigterm_as_exit():
        sys.exit(main())
