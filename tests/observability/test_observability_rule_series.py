"""The alert-rule unit tests feed series the server really produces: same names, same label keys.

`promtool test rules` proves the rules fire on the series the test file invents; this checks each of
those series against the live `/metrics` of the shared test server, so a renamed metric or label (or
a reason the server never reports) fails here instead of leaving an alert blind.
"""

from __future__ import annotations

import re

import requests
import yaml
from observability_helpers import RULE_TESTS

# Labels Prometheus adds when it scrapes, not the server.
SCRAPE_LABELS = {"instance", "job"}
# Series Prometheus itself makes.
PROMETHEUS_SERIES = {"up"}
# Label values that must exist exactly as in the test (others, like model names, are invented).
EXACT_LABELS = {"reason"}


def parse_series(selector: str) -> tuple[str, dict[str, str]]:
    name, _, labels = selector.partition("{")
    return name, dict(re.findall(r'(\w+)="([^"]*)"', labels))


def live_series(metrics_text: str) -> dict[str, list[dict[str, str]]]:
    series: dict[str, list[dict[str, str]]] = {}
    for line in metrics_text.splitlines():
        if line and not line.startswith("#"):
            name, labels = parse_series(line.rsplit(" ", 1)[0])
            series.setdefault(name, []).append(labels)
    return series


def test_rule_test_series_exist_on_the_server(triton_server) -> None:
    live = live_series(requests.get(triton_server.metrics_url, timeout=10).text)
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    used = [parse_series(s["series"]) for t in tests for s in t.get("input_series", [])]
    checked = 0
    for name, labels in used:
        if name in PROMETHEUS_SERIES:
            continue
        assert name in live, f"{name} is in the rule tests but not on /metrics"
        keys = set(labels) - SCRAPE_LABELS
        matching = [s for s in live[name] if set(s) == keys]
        assert matching, (
            f"{name}: the rule tests use labels {sorted(keys)}, the server {sorted(live[name][0])}"
        )
        for key in EXACT_LABELS & keys:
            assert any(s[key] == labels[key] for s in matching), (
                f'{name}{{{key}="{labels[key]}"}} never appears'
            )
        checked += 1
    assert checked >= 8
