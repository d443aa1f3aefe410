"""The Prometheus metrics of one server (its own registry, so that servers in one process, as
in the tests, do not share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "m31_http_requests", "HTTP calls by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "m31_http_latency_seconds",
            "HTTP call latency by route",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.batch_size = Histogram(
            "m31_batch_requests",
            "requests per device call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=r,
        )
        self.batch_seconds = Histogram(
            "m31_batch_seconds",
            "time of one device call (encode, masks, score and top-K)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.device_calls = Counter("m31_device_calls", "batches run on the device", registry=r)
        self.ads_scored = Counter(
            "m31_ads_scored", "(request, ad) pairs scored exhaustively", registry=r
        )
        self.queue_depth = Gauge("m31_queue_depth", "requests waiting to be batched", registry=r)
        self.index_ads = Gauge("m31_index_ads", "live ads in the index", registry=r)
        self.index_rows = Gauge("m31_index_rows", "rows scored per request", registry=r)
        self.index_version = Gauge("m31_index_version", "index version", registry=r)
        self.ready = Gauge("m31_ready", "1 once the index is loaded", registry=r)

    def index_gauges(self, backend) -> None:
        """Size, rows and version of the served index, as the backend last knew them."""
        self.index_ads.set(backend.ads)
        self.index_rows.set(backend.rows)
        self.index_version.set(backend.version)
