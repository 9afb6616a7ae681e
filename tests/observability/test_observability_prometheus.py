"""The real Prometheus (Debian package) on the shipped config and rules, scraping the shared test Triton."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
import yaml
from observability_helpers import PROMETHEUS_CONFIG, RULE_TESTS, RULES_DIR, rule_groups
from triton_fixture import free_ports

DEADLINE_S = 90.0


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` not found: `make venv` installs the Debian package prometheus")
    return path


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=60)


def test_shipped_config_and_rules_pass_promtool() -> None:
    checked = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for rules in RULES_DIR.glob("*.yml"):
        checked = promtool("check", "rules", str(rules))
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_alert_rules_unit_tests_pass() -> None:
    """Each SLO alert fires on a bad series and not on a healthy one (docker/prometheus/tests/)."""
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def render_config(dest: Path, metrics_target: str) -> Path:
    """The shipped config with the Triton job pointed at one loopback target and 1 s intervals."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(RULES_DIR / "*.yml")]
    config["scrape_configs"] = [{"job_name": "triton", "static_configs": [{"targets": [metrics_target]}]}]
    path = dest / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    checked = promtool("check", "config", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    return path


@pytest.fixture(scope="module")
def prometheus_url(triton_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("prometheus")
    target = triton_server.metrics_url.removeprefix("http://").removesuffix("/metrics")
    config = render_config(workdir, target)
    (port,) = free_ports(1)
    log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 -- closed after the process
    process = subprocess.Popen(
        [
            tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        poll(lambda: process.poll() is None and ready(url), "Prometheus ready", workdir / "prometheus.log")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/-/ready", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


def poll(check: Callable[[], object], what: str, log: Path | None = None) -> object:
    """`check()`'s first truthy result, polled every 0.25 s until DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.25)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise AssertionError(f"no {what} within {DEADLINE_S}s\n{tail}")


def query(url: str, promql: str) -> list[dict]:
    response = requests.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def generate(triton_server, n: int) -> None:
    url = f"http://{triton_server.http_url}/v2/models/ensemble/generate"
    for i in range(n):
        reply = requests.post(url, json={"text_input": f"metrics {i}", "max_tokens": 4}, timeout=120)
        assert reply.status_code == 200, reply.text


def test_scrapes_ttft_histogram_and_kv_usage(prometheus_url: str, triton_server) -> None:
    generate(triton_server, 2)
    counts = poll(
        lambda: [
            s
            for s in query(prometheus_url, "tritonllm_time_to_first_token_seconds_count")
            if float(s["value"][1]) >= 2
        ],
        "TTFT histogram count >= 2",
    )
    assert counts[0]["metric"]["model"] == "tensorrt_llm"
    buckets = query(prometheus_url, 'tritonllm_time_to_first_token_seconds_bucket{le="+Inf"}')
    assert buckets and float(buckets[0]["value"][1]) >= 2
    usage = poll(lambda: query(prometheus_url, "tritonllm_kv_cache_usage_ratio"), "KV usage series")
    assert 0.0 <= float(usage[0]["value"][1]) <= 1.0
    total = query(prometheus_url, "tritonllm_kv_cache_blocks_total")
    assert float(total[0]["value"][1]) == 512  # the fixture's num_kv_blocks


def test_recording_rules_compute_p95_ttft_from_live_traffic(prometheus_url: str, triton_server) -> None:
    """Requests between two scrapes give the 1-minute rate a value, so the p95 rule yields a number."""
    poll(lambda: query(prometheus_url, 'up{job="triton"} == 1'), "Triton target up")
    generate(triton_server, 3)

    def p95() -> list[dict]:
        result = query(prometheus_url, "model:tritonllm_time_to_first_token_seconds:p95_1m")
        return [s for s in result if math.isfinite(float(s["value"][1]))]

    series = poll(p95, "p95 TTFT from the recording rule")
    assert series[0]["metric"]["model"] == "tensorrt_llm"
    assert 0.0 < float(series[0]["value"][1]) <= 60.0


def test_rules_load_and_evaluate_without_errors(prometheus_url: str) -> None:
    def groups() -> list[dict]:
        body = requests.get(f"{prometheus_url}/api/v1/rules", timeout=10).json()
        found = body["data"]["groups"]
        evaluated = found and all(
            rule.get("lastEvaluation", "").startswith("20") for g in found for rule in g["rules"]
        )
        return found if evaluated else []

    found = poll(groups, "evaluated rule groups")
    rules = [rule for group in found for rule in group["rules"]]
    shipped = rule_groups()
    assert {group["name"] for group in found} == {group["name"] for group in shipped}
    assert len(rules) == sum(len(group["rules"]) for group in shipped)
    broken = [(rule["name"], rule.get("lastError")) for rule in rules if rule["health"] != "ok"]
    assert not broken
