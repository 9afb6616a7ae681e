"""Paths of the deploy files and the metric names they use, shared by the observability tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

DOCKER_DIR = Path(__file__).resolve().parents[2] / "docker"
PROMETHEUS_CONFIG = DOCKER_DIR / "prometheus" / "prometheus.yml"
RULES_DIR = DOCKER_DIR / "prometheus" / "rules"
RULE_TESTS = DOCKER_DIR / "prometheus" / "tests" / "tritonllm_test.yml"
DASHBOARD = DOCKER_DIR / "grafana" / "dashboards" / "tritonllm.json"
GRAFANA_PROVISIONING = DOCKER_DIR / "grafana" / "provisioning"
COMPOSE_FILE = DOCKER_DIR / "docker-compose.yml"
DOCKERFILES = (DOCKER_DIR / "Dockerfile.cpu", DOCKER_DIR / "Dockerfile.gpu")

# The load-test exporter's series (loadtest/tritonllm_loadtest/exporter.py), as Prometheus exposes them.
LOADTEST_HISTOGRAMS = (
    "tritonllm_loadtest_ttft_seconds",
    "tritonllm_loadtest_itl_seconds",
    "tritonllm_loadtest_e2e_seconds",
)
LOADTEST_SERIES = frozenset(
    [f"{h}{suffix}" for h in LOADTEST_HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")]
    + [
        "tritonllm_loadtest_output_tokens_total",
        "tritonllm_loadtest_requests_total",
        "tritonllm_loadtest_users",
    ]
)
# Triton exports these only where it sees GPUs (with --allow-gpu-metrics), so a CPU server cannot show
# them; names as in Triton's metrics documentation.
GPU_ONLY_SERIES = frozenset({"nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"})


def front_door_series() -> frozenset[str]:
    """The OpenAI front door's series (its own /metrics: `tritonllm/openai/metrics.py`)."""
    from tritonllm.openai.metrics import FrontDoorMetrics

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return frozenset(f.name + s for f in FrontDoorMetrics().registry.collect() for s in suffixes[f.type])


_METRIC = re.compile(r"\b((?:tritonllm|nv)_[a-z0-9_]+)\b")
_RECORDED = re.compile(r"\b([a-z_]+:[a-z0-9_]+:[a-z0-9_]+)\b")


def rule_groups() -> list[dict]:
    groups: list[dict] = []
    for path in sorted(RULES_DIR.glob("*.yml")):
        groups += yaml.safe_load(path.read_text())["groups"]
    return groups


def rule_expressions() -> list[str]:
    return [rule["expr"] for group in rule_groups() for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_expressions() -> list[str]:
    board = dashboard()
    exprs = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    exprs += [var["definition"] for var in board["templating"]["list"]]
    return exprs


def metric_names(exprs: list[str]) -> set[str]:
    """Exported series names (`tritonllm_*`, `nv_*`) in PromQL expressions, recording rules left out."""
    return {name for expr in exprs for name in _METRIC.findall(_RECORDED.sub(" ", expr))}


def recording_rule_references(exprs: list[str]) -> set[str]:
    return {name for expr in exprs for name in _RECORDED.findall(expr)}


def exposed_series(metrics_text: str) -> set[str]:
    """Series names in a Prometheus text exposition."""
    return {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in metrics_text.splitlines()
        if line and not line.startswith("#")
    }
