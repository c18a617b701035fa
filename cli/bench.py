"""``gdskv bench``: the store benchmark (``gdskv.bench``) on the disk that holds the store.

``--dir``, ``--json`` and every other argument but ``--plot`` go to ``gdskv.bench``
(``gdskv bench -- --help`` lists the others); ``--dir`` defaults to the directory the store is in
(or would be created in), not the benchmark script's temp directory.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import click

from gdskv.cli._common import UsageProblem, config_of
from gdskv.cli.output import console


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


def _progress_log(options: Any, as_json: bool) -> Any:
    """The benchmark's log: each line on stderr as it comes (one per measurement: the periodic
    status off a terminal); on a terminal, above a bar of measurements done of those planned."""
    err = console(stderr=True)
    if not err.is_terminal or as_json:
        return lambda line: print(line, file=sys.stderr, flush=True)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    per_subject = len(options.page_sizes) * options.rounds
    planned = per_subject * (3 * options.baselines + len(options.engines))
    bar = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TextColumn("measurements"), TimeRemainingColumn(),
                   TimeElapsedColumn(), console=err, transient=True)
    task = bar.add_task("bench", total=planned)
    bar.start()

    def log(line: str) -> None:
        err.print(line, markup=False, highlight=False)
        if " left out: " in line:
            bar.update(task, total=bar.tasks[0].total - per_subject)
        elif ", round " in line:
            bar.advance(task)
        if bar.finished:
            bar.stop()

    return log


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
               epilog="Other options (--total, --page-size, --rounds, --engines, --no-baselines, ...) go to the benchmark: "
                      "gdskv bench -- --help lists them.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False), help="Also draw the results to this PNG (needs matplotlib: pip install 'gdskv[plot]').")
@click.option("--dir", "directory", default=None, help="Directory on the disk to measure (a temporary subdirectory is made and removed); "
                                                      "default: the directory that holds the store.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.argument("bench_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def bench(ctx: click.Context, plot_path: Optional[str], directory: Optional[str], as_json: bool, bench_args: tuple[str, ...]) -> None:
    """Save/load GB/s of the store against raw sequential I/O and torch.save, on the store's disk."""
    from gdskv.bench.options import parse_args  # a usage mistake is answered before torch is imported

    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageProblem("--plot needs matplotlib: pip install 'gdskv[plot]'") from None
    argv = list(bench_args) + ["--json"] * as_json
    if not any(a == "--dir" or a.startswith("--dir=") for a in argv):
        argv += ["--dir", directory or _store_dir(config_of(ctx).store_path)]
    try:
        options, as_json = parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        ctx.exit(int(e.code or 0))
    from gdskv import bench as store_bench

    report = store_bench.run(options, log=_progress_log(options, as_json))
    click.echo(json.dumps(report, indent=2) if as_json else store_bench.format_report(report))
    if plot_path is not None:
        plot(report, plot_path)
        click.echo(f"plot written to {os.path.abspath(plot_path)}", err=True)
