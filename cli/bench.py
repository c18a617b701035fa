"""``gdskv bench``: the store benchmark (``gdskv.bench``) on the disk that holds the store.

Every argument but ``--plot`` goes to ``gdskv.bench`` (``gdskv bench -- --help`` lists them);
``--dir`` defaults to the directory the store is in (or would be created in).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import click

from gdskv.cli._common import UsageProblem, config_of


def plot(report: dict[str, Any], out: str) -> None:
    """Bars of GB/s per subject and kind (save, cold load, warm load), one panel per page size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = (("save", "save"), ("load_cold", "load (cold)"), ("load_warm", "load (warm)"))
    sizes = sorted({r["page_bytes"] for r in report["results"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        rows = [r for r in report["results"] if r["page_bytes"] == size]
        width = 0.8 / max(1, len(rows))
        for i, row in enumerate(rows):
            ax.bar([k + i * width for k in range(len(kinds))], [row[f"{k}_gbps"] for k, _ in kinds], width, label=row["subject"])
        ax.set_xticks([k + width * (len(rows) - 1) / 2 for k in range(len(kinds))], [label for _, label in kinds])
        ax.set_title(f"{size >> 20} MiB pages" if size >= 1 << 20 else f"{size >> 10} KiB pages")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out)


def _store_dir(store_path: str) -> str:
    """The nearest existing directory above the store: same disk, outside the store's tree."""
    p = Path(store_path).resolve().parent
    while not p.exists():
        p = p.parent
    return str(p)


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False), help="Also draw the results to this PNG (needs matplotlib: pip install 'gdskv[plot]').")
@click.argument("bench_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def bench(ctx: click.Context, plot_path: Optional[str], bench_args: tuple[str, ...]) -> None:
    """Save/load GB/s of the store against raw sequential I/O and torch.save, on the store's disk."""
    from gdskv import bench as store_bench

    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageProblem("--plot needs matplotlib: pip install 'gdskv[plot]'") from None
    argv = list(bench_args)
    if not any(a == "--dir" or a.startswith("--dir=") for a in argv):
        argv += ["--dir", _store_dir(config_of(ctx).store_path)]
    try:
        options, as_json = store_bench.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        ctx.exit(int(e.code or 0))
    report = store_bench.run(options, log=lambda line: print(line, file=sys.stderr))
    click.echo(json.dumps(report, indent=2) if as_json else store_bench.format_report(report))
    if plot_path is not None:
        plot(report, plot_path)
        click.echo(f"plot written to {os.path.abspath(plot_path)}", err=True)
