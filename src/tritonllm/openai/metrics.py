"""The front door's own Prometheus metrics (its `/metrics`), labelled by the caller's tier.

TTFT and ITL here are what a client of the front door sees (request received -> first token sent;
gaps between token-carrying responses), to compare with the engine's `tritonllm_*` series on Triton.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class FrontDoorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tritonllm_openai_requests",
            "Requests answered, by endpoint, HTTP status (499: the client went away) and key tier",
            ["endpoint", "status", "tier"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "tritonllm_openai_rejected",
            "Requests refused before generating, by reason (rate limits, queue, engine busy, invalid, ...)",
            ["reason", "tier"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "tritonllm_openai_requests_in_flight",
            "Requests being served (queued for a slot or generating)",
            ["tier"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tritonllm_openai_time_to_first_token_seconds",
            "Request received -> first token, as the caller sees it",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "tritonllm_openai_inter_token_latency_seconds",
            "Time between consecutive token-carrying responses",
            ["tier"],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "tritonllm_openai_e2e_request_latency_seconds",
            "Request received -> last token",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "tritonllm_openai_tokens",
            "Prompt and completion tokens served, by key tier",
            ["kind", "tier"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
