"""Every metric the dashboard and the rules use exists on the real server (or the load-test exporter)."""

from __future__ import annotations

import requests
from observability_helpers import (
    GPU_ONLY_SERIES,
    LOADTEST_SERIES,
    dashboard_expressions,
    exposed_series,
    front_door_series,
    metric_names,
    recorded_names,
    recording_rule_references,
    rule_expressions,
)


def served_series(triton_server) -> set[str]:
    """Series on the test server's /metrics after a request (histograms appear once observed)."""
    url = f"http://{triton_server.http_url}/v2/models/tensorrt_llm_bls/generate"
    assert requests.post(url, json={"text_input": "names", "max_tokens": 2}, timeout=120).status_code == 200
    return exposed_series(requests.get(triton_server.metrics_url, timeout=10).text)


def test_dashboard_and_rules_use_only_real_metric_names(triton_server) -> None:
    served = served_series(triton_server)
    used = metric_names(dashboard_expressions() + rule_expressions())
    assert {"tritonllm_time_to_first_token_seconds_bucket", "tritonllm_kv_cache_usage_ratio"} <= used
    unknown = used - served - LOADTEST_SERIES - GPU_ONLY_SERIES - front_door_series()
    assert not unknown, (
        f"not on the server's, the load test's or the front door's /metrics: {sorted(unknown)}"
    )


def test_dashboard_covers_server_and_load_test_series(triton_server) -> None:
    """Each engine metric family and the load test's figures have a panel."""
    used = metric_names(dashboard_expressions())
    engine_families = {
        name.removesuffix("_bucket")
        for name in served_series(triton_server)
        if name.startswith("tritonllm_") and not name.endswith(("_sum", "_count"))
    }
    missing = {
        family
        for family in engine_families
        if not any(name == family or name == f"{family}_bucket" for name in used)
    }
    # Block counts are shown through the usage ratio; e2e and queue time beside requests per second.
    assert missing <= {
        "tritonllm_kv_cache_blocks_free",
        "tritonllm_kv_cache_blocks_used",
        "tritonllm_kv_cache_blocks_total",
    }
    assert {"tritonllm_loadtest_ttft_seconds_bucket", "tritonllm_loadtest_output_tokens_total"} <= used


def test_recording_rules_used_are_defined() -> None:
    referenced = recording_rule_references(dashboard_expressions() + rule_expressions())
    assert referenced, "the alerts are expected to read the recording rules"
    assert referenced <= recorded_names()
