"""``gdskv stats --plot``: the store's counters over time, drawn with matplotlib (the ``plot``
extra). The history is the store's counter files: each is one process's totals at its last
flush, so running through them in the order they were last updated gives the store's running
totals at those moments (a process still running counts at its latest flush)."""
from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Sequence

from gdskv.cli._common import UsageProblem


def need_matplotlib(option: str) -> None:
    """A one-line usage error (exit 2) when matplotlib is missing; called before any work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageProblem(f"{option} needs matplotlib: pip install 'gdskv[plot]'") from None


def running_totals(history: Sequence[tuple[float, dict[str, Counter[str]]]]) -> dict[str, list[tuple[float, Counter[str]]]]:
    """Per namespace, ``(time, totals so far)`` after each counter file, in update order."""
    out: dict[str, list[tuple[float, Counter[str]]]] = {}
    so_far: dict[str, Counter[str]] = {}
    for updated, part in sorted(history, key=lambda h: h[0]):
        for ns_id, counters in part.items():
            total = so_far.setdefault(ns_id, Counter())
            total.update(counters)
            out.setdefault(ns_id, []).append((updated, Counter(total)))
    return out


def plot_stats(history: Sequence[tuple[float, dict[str, Counter[str]]]], models: dict[str, str], out: str) -> int:
    """Token hit rate (served / requested prompt tokens) and GiB read / written over time, a line
    per namespace; how many points were drawn."""
    import matplotlib
    import matplotlib.dates

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, bytes_ax) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    points = 0
    for ns_id, series in sorted(running_totals(history).items()):
        when = [datetime.fromtimestamp(t) for t, _ in series]
        label = f"{models.get(ns_id, 'unknown model')} ({ns_id[:8]})"
        asked = [c["lookup_tokens"] for _, c in series]
        rate_ax.plot(when, [c["lookup_matched_tokens"] / a if a else float("nan") for (_, c), a in zip(series, asked)], marker="o", label=label)
        bytes_ax.plot(when, [c["bytes_read"] / 2**30 for _, c in series], marker="o", label=f"read, {label}")
        bytes_ax.plot(when, [c["bytes_written"] / 2**30 for _, c in series], marker="x", linestyle="--", label=f"written, {label}")
        points += len(series)
    rate_ax.set_ylabel("token hit rate (served / requested)")
    rate_ax.set_ylim(0, 1)
    bytes_ax.set_ylabel("GiB (running total)")
    bytes_ax.set_xlabel("counter file last updated")
    for ax in (rate_ax, bytes_ax):
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    locator = matplotlib.dates.AutoDateLocator()
    bytes_ax.xaxis.set_major_locator(locator)
    bytes_ax.xaxis.set_major_formatter(matplotlib.dates.ConciseDateFormatter(locator))
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return points
