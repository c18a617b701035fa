"""``gdskv demo``: the product in one command, on the default store.

Four fresh processes share nothing but the store: two move synthetic KV pages through the store
(raw I/O speed), two run the CPU reference engine with the TensorRT-LLM connector attached (the
second serves the prompts' prefix from the store and must generate the same tokens). Exit codes:
0 ok, 1 a check failed (or a phase did), 2 a store path that is not a gdskv store and cannot be one.
A failing phase is one line (its last error line); its whole stderr is logged with ``-v``.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

import click
from rich.markup import escape

from gdskv.cli._common import UsageProblem, capacity_limits, config_of, human_bytes, print_json
from gdskv.config import GdsKvConfig
from gdskv.demo import ENGINE_TOKENS_PER_BLOCK, STORE_PROMPTS
from gdskv.cli.output import console as make_console
from gdskv.cli.prewarm import check_store

MAX_PAGE_BYTES = 64 << 20
"""The largest ``--page-bytes``."""
MAX_DEMO_BYTES = 4 << 30
"""The most the synthetic pages may take (4 prompts of ``--pages-per-prompt`` pages): the demo
writes them to the store and holds them in memory."""

log = logging.getLogger(__name__)


def _phase(store: str, phase: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run([sys.executable, "-m", "gdskv.demo", phase, "--store", store, *args], capture_output=True, text=True, env=env)
    try:
        if out.returncode in (0, 1) and out.stdout.strip():
            return json.loads(out.stdout.strip().splitlines()[-1])
    except ValueError:
        pass
    log.info("demo phase %s stderr:\n%s", phase, out.stderr)
    last = next((line.strip() for line in reversed(out.stderr.splitlines()) if line.strip()), "no error output")
    raise click.ClickException(f"demo phase {phase!r} failed (exit {out.returncode}): {last}")


def _round_trip_verdict(save: dict[str, Any], load: dict[str, Any], cfg: GdsKvConfig, page_bytes: int) -> tuple[str, str]:
    """(problem, note) of the store round trip: a page that differs, one the store holds but did
    not load, or one the save left in the store and the load did not find is a problem; pages the
    store did not keep (its capacity limits refused or evicted them) are a note, unless it kept
    none, which leaves nothing to check."""
    pages = save["pages"]
    failed = load["pages"] - load["absent"] - load["done"]
    not_kept = pages - save["kept"]
    if load["mismatches"] or failed:
        return f"{load['mismatches']} pages differ, {failed} held by the store did not load", ""
    if load["absent"] > not_kept:
        return f"{load['absent'] - not_kept} pages the save left in the store were missing at load", ""
    if not not_kept:
        return "", ""
    why = (f"the store's capacity limits ({capacity_limits(cfg)}) refused or evicted {not_kept} of {pages} pages; "
           f"the demo's pages need {human_bytes(pages * page_bytes)}")
    return (f"no page kept, nothing to check: {why}", "") if not save["kept"] else ("", why)


@click.command()
@click.option("--pages-per-prompt", "blocks", type=click.IntRange(min=1), default=16, show_default=True,
              help="Synthetic KV pages per prompt.")
@click.option("--page-bytes", type=click.IntRange(1, MAX_PAGE_BYTES), default=1 << 20, show_default=True,
              help="Bytes per synthetic KV page (at most 64 MiB).")
@click.option("--system-tokens", type=click.IntRange(min=ENGINE_TOKENS_PER_BLOCK), default=480, show_default=True,
              help=f"Length of the shared system prompt the engine serves (one {ENGINE_TOKENS_PER_BLOCK}-token block at least).")
@click.option("--json", "as_json", is_flag=True, help="Print every phase's figures as JSON instead.")
@click.pass_context
def demo(ctx: click.Context, blocks: int, page_bytes: int, system_tokens: int, as_json: bool) -> None:
    """Round-trip KV through the store in new processes; serve a prompt prefix from it."""
    if STORE_PROMPTS * blocks * page_bytes > MAX_DEMO_BYTES:
        raise UsageProblem(f"--pages-per-prompt {blocks} of --page-bytes {page_bytes}: the demo's {STORE_PROMPTS} prompts would "
                           f"take {human_bytes(STORE_PROMPTS * blocks * page_bytes)} (at most {human_bytes(MAX_DEMO_BYTES)})")
    cfg = config_of(ctx)
    check_store(cfg)  # one line, exit 2, for a path that is not a store and cannot be one
    store = cfg.store_path
    console = make_console(quiet=as_json)
    report: dict[str, Any] = {"store": store}
    console.print(f"[bold]gdskv demo[/] — store {escape(store)}", markup=True)
    ok = True

    console.print("[bold]1. Store round trip[/] (4 prompts sharing a prefix; each phase in a new process)", markup=True)
    for phase in ("save", "load"):
        r = report[phase] = _phase(store, phase, "--blocks", str(blocks), "--page-bytes", str(page_bytes))
        what = (f"{r['done']} saved, {r['already']} already stored" + (f", {r['misses']} refused" if r["misses"] else "")
                if phase == "save" else f"{r['done']} loaded and verified, {r['misses']} missed")
        console.print(
            f"   {phase:4s}: {r['pages']} pages of {page_bytes / 2**20:g} MiB: {what}; "
            f"{r['bytes'] / 2**20:.0f} MiB in {r['seconds'] * 1e3:.0f} ms = {r['gbps']:.2f} GB/s  engine: {r['engine']}"
        )
    problem, note = _round_trip_verdict(report["save"], report["load"], cfg, page_bytes)
    if note:
        console.print(f"   {note}", style="yellow")
    if problem:
        console.print(f"   {problem}", style="red")
        ok = False

    console.print("[bold]2. Reference engine + TensorRT-LLM connector[/] (2 prompts sharing a system prompt; two processes)", markup=True)
    salt = f"demo-{time.time_ns()}"  # a fresh salt, so run 1 computes even when the store is warm
    runs = []
    for n in (1, 2):
        r = _phase(store, "engine", "--salt", salt, "--system-tokens", str(system_tokens))
        runs.append(r)
        w = r["worker"]
        console.print(
            f"   run {n}: prompt tokens {r['prompt_tokens']}, served from the store {r['served_tokens']}, "
            f"TTFT {max(r['ttft_s']) * 1e3:.0f} ms; pages saved {w['saves_published']}, loaded {w['loads_loaded']}, failed loads {w['loads_failed']}"
        )
    same = runs[0]["outputs"] == runs[1]["outputs"]
    served = sum(runs[1]["served_tokens"])
    console.print(
        f"   TTFT {max(runs[0]['ttft_s']) * 1e3:.0f} ms → {max(runs[1]['ttft_s']) * 1e3:.0f} ms; "
        f"outputs {'[green]identical[/]' if same else '[red]DIFFER[/]'}", markup=True
    )
    ok = ok and same and served > 0
    report |= {"engine_runs": runs, "outputs_identical": same, "served_tokens": served, "ok": ok}
    if as_json:
        print_json(report)
    if not ok:
        console.print("FAILED", style="red")
        ctx.exit(1)
    console.print(f"[green]OK[/]: pages verified byte for byte; {served} prompt tokens served from the store with identical output", markup=True)
