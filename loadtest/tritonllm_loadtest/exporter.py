"""Live Prometheus metrics of the load generator, to sit beside Triton's on one dashboard.

Each Locust process (local, or each worker) serves its own ``/metrics``; every series carries ``model``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tritonllm_loadtest.transports import GenerationResult

DEFAULT_PORT = 9464
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class LoadTestMetrics:
    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.model = model
        self.registry = registry or CollectorRegistry()
        labels = ["model"]
        r = self.registry
        self.ttft = Histogram(
            "tritonllm_loadtest_ttft_seconds", "Time to first token", labels, registry=r, buckets=TTFT_BUCKETS
        )
        self.itl = Histogram(
            "tritonllm_loadtest_itl_seconds", "Time between tokens", labels, registry=r, buckets=ITL_BUCKETS
        )
        self.e2e = Histogram(
            "tritonllm_loadtest_e2e_seconds", "Request latency", labels, registry=r, buckets=E2E_BUCKETS
        )
        self.output_tokens = Counter(
            "tritonllm_loadtest_output_tokens", "Output tokens received", labels, registry=r
        )
        self.requests = Counter(
            "tritonllm_loadtest_requests", "Finished requests by outcome", [*labels, "outcome"], registry=r
        )
        self.users = Gauge("tritonllm_loadtest_users", "Locust users running", labels, registry=r)
        self.in_flight = Gauge(
            "tritonllm_loadtest_requests_in_flight", "Requests sent, not yet finished", labels, registry=r
        )

    def record(self, result: GenerationResult) -> None:
        """A finished request: its outcome and latencies."""
        model = self.model
        self.requests.labels(model=model, outcome=result.error_kind or "success").inc()
        if not result.ok:
            return
        self.e2e.labels(model=model).observe(result.e2e_s)
        if result.ttft_s is not None:
            self.ttft.labels(model=model).observe(result.ttft_s)
        itl = self.itl.labels(model=model)
        for gap in result.itls_s:
            itl.observe(gap)

    def tokens_received(self, n: int = 1) -> None:
        """Counted as tokens arrive (streaming) or when a whole reply does, not per finished request."""
        self.output_tokens.labels(model=self.model).inc(n)

    def track(self, users: Callable[[], float], in_flight: Callable[[], float]) -> None:
        """Gauges read at scrape time."""
        self.users.labels(model=self.model).set_function(users)
        self.in_flight.labels(model=self.model).set_function(in_flight)

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        start_http_server(port, addr=address, registry=self.registry)
