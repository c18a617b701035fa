"""gdskv's counters as Prometheus metric families: one mapping, used by the exporter a serving
process runs (``gdskv.metrics.exporter``) and by ``gdskv stats --prometheus`` (the store's
counter files summed, for a node exporter's textfile collector).

Pure: counters in (``{counter name: total}`` per namespace, as ``Namespace.counters`` and the
store's ``stats/`` files hold them), ``prometheus_client`` families out. Every counter the store
keeps becomes a sample: the named ones below get their own metric (with ``result`` / ``reason``
labels), any other one goes to ``gdskv_events_total{event=...}``, so a counter added later is
exported without a change here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "gdskv"
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
"""Seconds; a 4 MiB page loads in ~1-5 ms from NVMe, a lookup in well under 1 ms."""


@dataclass(frozen=True)
class Labels:
    """Whose counters: one namespace (one model shard) of one engine. ``engine`` is None for the
    store's summed counter files, which do not say which engine wrote them."""

    namespace: str
    model: str
    tp_rank: int
    engine: Optional[str] = None

    def names(self) -> list[str]:
        return (["engine"] if self.engine is not None else []) + ["namespace", "model", "tp_rank"]

    def values(self) -> list[str]:
        return ([self.engine] if self.engine is not None else []) + [self.namespace, self.model, str(self.tp_rank)]


# store counter -> (metric, help); and -> (metric, extra label, its value)
_SIMPLE = {
    "lookups": ("lookups", "Prefix lookups (one per request an engine asked about)."),
    "lookup_tokens": ("requested_tokens", "Prompt tokens lookups were asked about."),
    "lookup_matched_tokens": ("served_tokens", "Prompt tokens lookups found in the store (served tokens / requested tokens = hit rate)."),
    "bytes_read": ("read_bytes", "Payload bytes loaded from the store into engine pages."),
    "bytes_written": ("written_bytes", "Payload bytes saved to the store."),
    "evicted": ("evictions", "Chunks removed by eviction (inline budget or gdskv evict)."),
    "evicted_bytes": ("evicted_bytes", "Bytes of chunks removed by eviction."),
    "eviction_errors": ("eviction_errors", "Inline evictions that failed (the save was then dropped)."),
    "quarantine_failed": ("quarantine_failed", "Bad chunks that could not be moved to the quarantine."),
    "host_hits": ("host_tier_hits", "Pages served from the host-memory tier (host_bytes) instead of the disk."),
    "host_hit_bytes": ("host_tier_hit_bytes", "Payload bytes served from the host-memory tier."),
    "host_misses": ("host_tier_misses", "Loads the host-memory tier did not hold (read from the disk)."),
    "host_fills": ("host_tier_fills", "Pages copied into the host-memory tier (saves published, loads verified)."),
    "host_evictions": ("host_tier_evictions", "Pages the host-memory tier dropped to stay within host_bytes."),
}
_LABELLED = {
    "loads_hit": ("loads", "result", "hit"),
    "loads_missing": ("loads", "result", "missing"),
    "loads_corrupt": ("loads", "result", "corrupt"),
    "loads_io_error": ("loads", "result", "io_error"),
    "loads_refused": ("loads", "result", "refused"),
    "loads_error": ("loads", "result", "error"),
    "saves_published": ("saves", "result", "published"),
    "saves_exists": ("saves", "result", "exists"),
    "saves_dropped": ("saves", "result", "dropped"),
    "saves_dropped_budget": ("saves_dropped", "reason", "budget"),
    "saves_dropped_disk_full": ("saves_dropped", "reason", "disk_full"),
    "saves_error": ("saves_dropped", "reason", "error"),
}
_HELP = {
    "loads": "Page loads by result (hit: verified and served; corrupt chunks are quarantined).",
    "saves": "Page saves by result (exists: already stored; dropped: see gdskv_saves_dropped_total).",
    "saves_dropped": "Dropped saves by reason (budget: over max_bytes / the free-space floor; other: the rest).",
    "corrupt_chunks": "Chunks that failed verification (loads and gdskv verify --repair), by reason; each was quarantined.",
    "events": "Any other counter the store keeps, by name.",
}
ALWAYS = ("lookups", "lookup_tokens", "lookup_matched_tokens", "bytes_read", "bytes_written", "evicted", "host_hits")
"""Counters exported as 0 before they first move, so a dashboard's query has a series."""


def counter_families(rows: Iterable[tuple[Labels, Mapping[str, int]]]) -> list[Metric]:
    """One family per metric, a sample per (labels, counter). Rows with the same labels are
    summed (two services of one process count into one namespace)."""
    summed: dict[Labels, dict[str, int]] = {}
    for labels, counters in rows:
        into = summed.setdefault(labels, {})
        for name, n in counters.items():
            into[name] = into.get(name, 0) + int(n)
    fams: dict[str, CounterMetricFamily] = {}

    def family(metric: str, help_text: str, names: list[str]) -> CounterMetricFamily:
        if metric not in fams:
            fams[metric] = CounterMetricFamily(f"{PREFIX}_{metric}", help_text, labels=names)
        return fams[metric]

    for labels, counters in summed.items():
        names, values = labels.names(), labels.values()
        full = {name: 0 for name in ALWAYS} | counters
        dropped_other = counters.get("saves_dropped", 0)
        for name, n in sorted(full.items()):
            if name in _SIMPLE:
                metric, help_text = _SIMPLE[name]
                family(metric, help_text, names).add_metric(values, n)
            elif name in _LABELLED:
                metric, label, value = _LABELLED[name]
                family(metric, _HELP[metric], names + [label]).add_metric(values + [value], n)
                if metric == "saves_dropped":
                    dropped_other -= n
            elif name.startswith("quarantined_"):
                family("corrupt_chunks", _HELP["corrupt_chunks"], names + ["reason"]).add_metric(values + [name.removeprefix("quarantined_")], n)
            elif name != "quarantined":
                family("events", _HELP["events"], names + ["event"]).add_metric(values + [name], n)
        if counters.get("saves_dropped"):
            family("saves_dropped", _HELP["saves_dropped"], names + ["reason"]).add_metric(values + ["other"], max(0, dropped_other))
    return list(fams.values())


def store_gauges(store_bytes: Optional[int], free_bytes: Optional[int], total_bytes: Optional[int], chunks: Optional[int] = None) -> list[Metric]:
    """The store's size and its file system's free space (what is known; None is left out)."""
    out: list[Metric] = []
    for name, help_text, value in (("store_bytes", "Bytes of chunks in the store.", store_bytes),
                                   ("store_chunks", "Chunk files in the store.", chunks),
                                   ("filesystem_free_bytes", "Free bytes on the store's file system.", free_bytes),
                                   ("filesystem_size_bytes", "Size of the store's file system.", total_bytes)):
        if value is not None:
            out.append(GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value))
    return out
