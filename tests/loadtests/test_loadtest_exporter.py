"""The Prometheus exporter: the metric names and labels the dashboards rely on."""

from __future__ import annotations

from prometheus_client import generate_latest
from tritonllm_loadtest.exporter import LoadTestMetrics
from tritonllm_loadtest.transports import GenerationResult


def test_results_become_labelled_series() -> None:
    metrics = LoadTestMetrics("ensemble")
    metrics.track(lambda: 3, lambda: 2)
    metrics.record(GenerationResult(start=0.0, end=1.0, token_times=[0.2, 0.3, 0.5], output_tokens=3))
    metrics.tokens_received(3)
    metrics.record(GenerationResult(start=0.0).fail("timeout", "too slow"))
    metrics.record(GenerationResult(start=0.0).fail("dropped", "max in-flight requests reached"))
    text = generate_latest(metrics.registry).decode()
    expected = [
        'tritonllm_loadtest_ttft_seconds_bucket{le="0.25",model="ensemble"} 1.0',
        'tritonllm_loadtest_itl_seconds_count{model="ensemble"} 2.0',
        'tritonllm_loadtest_e2e_seconds_sum{model="ensemble"} 1.0',
        'tritonllm_loadtest_output_tokens_total{model="ensemble"} 3.0',
        'tritonllm_loadtest_requests_total{model="ensemble",outcome="success"} 1.0',
        'tritonllm_loadtest_requests_total{model="ensemble",outcome="timeout"} 1.0',
        'tritonllm_loadtest_requests_total{model="ensemble",outcome="dropped"} 1.0',
        'tritonllm_loadtest_users{model="ensemble"} 3.0',
        'tritonllm_loadtest_requests_in_flight{model="ensemble"} 2.0',
    ]
    for line in expected:
        assert line in text
    # A failed request adds no latency observations.
    assert 'tritonllm_loadtest_e2e_seconds_count{model="ensemble"} 1.0' in text
