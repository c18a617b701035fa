"""``gdskv demo``: the product in one command, on the default store."""
from __future__ import annotations

import json
import subprocess
import sys

import click
from rich.console import Console

from gdskv.config import load_config


@click.command()
@click.option("--prompts", default=4, show_default=True, help="Synthetic prompts (they share a prefix).")
@click.option("--blocks", default=16, show_default=True, help="Blocks per prompt.")
@click.option("--page-bytes", default=1 << 20, show_default=True, help="Bytes per KV page.")
@click.pass_context
def demo(ctx: click.Context, prompts: int, blocks: int, page_bytes: int) -> None:
    """Save KV pages of a few prompts, reload them in a new process, verify every byte."""
    console = Console()
    cfg = load_config(store_path=(ctx.obj or {}).get("store_path"))
    console.print(f"[bold]gdskv demo[/] store: {cfg.store_path}")
    reports = []
    for phase in ("save", "load"):
        out = subprocess.run(
            [sys.executable, "-m", "gdskv.demo", phase, "--store", cfg.store_path, "--prompts", str(prompts),
             "--blocks", str(blocks), "--page-bytes", str(page_bytes)],
            capture_output=True, text=True,
        )
        if out.returncode not in (0, 1) or not out.stdout.strip():
            console.print(out.stderr)
            raise click.ClickException(f"demo {phase} process failed (exit {out.returncode})")
        rep = json.loads(out.stdout.strip().splitlines()[-1])
        reports.append(rep)
        verb = "saved" if phase == "save" else "loaded"
        console.print(
            f"  {phase:4s} (process {len(reports)}): {rep['pages']} pages, {rep['hits']} {verb}, {rep['misses']} missed, "
            f"{rep['bytes'] / 2**20:.1f} MiB in {rep['seconds'] * 1e3:.1f} ms = {rep['gbps']:.2f} GB/s  [{rep['engine']}]"
        )
    load = reports[1]
    if load["mismatches"] or load["hits"] != load["pages"]:
        console.print(f"[red]FAILED[/]: {load['mismatches']} pages differ, {load['misses']} missing")
        ctx.exit(1)
    console.print(f"[green]OK[/]: every byte of {load['hits']} pages read back in a new process matches")
