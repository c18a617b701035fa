"""Prometheus metrics: a serving process's ``/metrics`` endpoint (``exporter``, off unless
``metrics_port`` is set) and the mapping of gdskv's counters to metric families (``families``),
shared with ``gdskv stats --prometheus``. ``config/grafana-dashboard.json`` charts them."""
from gdskv.metrics.exporter import ServiceMetrics, attach, serving_port
from gdskv.metrics.families import Labels, counter_families, store_gauges

__all__ = ["Labels", "ServiceMetrics", "attach", "counter_families", "serving_port", "store_gauges"]
