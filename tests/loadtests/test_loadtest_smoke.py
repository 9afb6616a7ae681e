"""End to end: ``tritonllm-loadtest run`` against the shared tritonserver, one process and distributed.

Short and bounded (a few users, seconds, loopback); checks the reports exist and are sane.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import requests
from triton_fixture import free_ports

RUN_TIMEOUT_S = 240.0


def loadtest_command(server, model_dir: Path, out: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "tritonllm_loadtest.cli", "run",
        "--host", f"http://{server.http_url}", "--out", str(out), "--run-timeout", str(RUN_TIMEOUT_S),
        "--llm-grpc-host", server.grpc_url, "--llm-tokenizer", str(model_dir),
        "--llm-input-tokens", "normal:32,8", "--llm-max-tokens", "uniform:4,8", *args,
    ]  # fmt: skip


def check_reports(out: Path, model: str, request_type: str) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    m = summary["metrics"]
    assert m["requests"] > 0 and m["failures"] == 0 and summary["errors_by_kind"] == {}
    # min_tokens = max_tokens = 4..8; tokens of requests cut off by the end of the run count too.
    assert 4 * m["requests"] <= m["output_tokens"] <= 8 * (m["requests"] + m["peak_in_flight"])
    for name in ("ttft", "itl", "e2e"):
        values = [m[f"{name}_p{p}_ms"] for p in (50, 90, 95, 99)]
        assert None not in values and values == sorted(values), (name, values)
    assert m["ttft_p50_ms"] <= m["e2e_p50_ms"]
    assert summary["config"]["model"] == model
    with open(out / "locust_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    # Locust rewrites its CSV every second: its last rows may miss the final second's requests.
    assert 0.5 * m["requests"] <= int(rows[(request_type, model)]["Request Count"]) <= m["requests"]
    assert 0 < int(rows[("TTFT", model)]["Request Count"]) <= m["requests"]
    for name in ("locust.html", "summary.md", "latency.png", "throughput.png", "errors.png"):
        assert (out / name).stat().st_size > 0
    return summary


def test_constant_users_over_sse_meet_their_slos(triton_server, tiny_llama_dir: Path, tmp_path: Path) -> None:
    (metrics_port,) = free_ports(1)
    command = loadtest_command(
        triton_server, tiny_llama_dir, tmp_path,
        "--metrics-port", str(metrics_port), "--llm-shape", "constant", "--llm-users", "2",
        "--llm-duration", "6", "--llm-sample-interval", "1",
        "--slo", "error_rate<=0", "--slo", "output_tokens_per_s>=1",
    )  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 30)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = check_reports(tmp_path, "ensemble", "SSE")
    assert summary["metrics"]["peak_users"] == 2
    assert [r["passed"] for r in summary["slos"]] == [True, True]
    assert "output tokens/s" in done.stdout
    # The same run against an SLO it cannot meet: exit status 1, for CI pipelines.
    rebuilt = subprocess.run(
        [sys.executable, "-m", "tritonllm_loadtest.cli", "report", str(tmp_path), "--slo", "ttft_p50_ms<=0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert rebuilt.returncode == 1 and "**MISSED**" in rebuilt.stdout


def scrape_until(urls: list[str], series: str, process: subprocess.Popen, deadline: float) -> list[str]:
    """Poll the workers' /metrics in turn until ``series`` is positive at every one (or the run ends). Polled
    one after the other, a late first worker left no time for the second: its endpoint ends with the run."""
    texts: dict[str, str] = {}
    while time.monotonic() < deadline and process.poll() is None and len(texts) < len(urls):
        for url in (u for u in urls if u not in texts):
            try:
                text = requests.get(url, timeout=5).text
            except requests.ConnectionError:
                text = ""
            for line in text.splitlines():
                if line.startswith(series) and float(line.rsplit(" ", 1)[1]) > 0:
                    texts[url] = text
        if len(texts) < len(urls):
            time.sleep(0.5)  # polling interval, bounded by the deadline
    missing = [url for url in urls if url not in texts]
    if missing:
        raise AssertionError(f"{series} never became positive at {', '.join(missing)}")
    return [texts[url] for url in urls]


def test_master_and_two_workers_poisson_over_grpc(triton_server, tiny_llama_dir, tmp_path) -> None:
    base = free_ports(1)[0]
    command = loadtest_command(
        triton_server, tiny_llama_dir, tmp_path,
        "--workers", "2", "--metrics-port", str(base),
        "--llm-transport", "grpc-stream", "--llm-model", "tensorrt_llm_bls",
        "--llm-shape", "poisson", "--llm-rate", "4", "--llm-arrival-users", "2",
        "--llm-duration", "10", "--llm-sample-interval", "1",
    )  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        # A finished request (tokens are counted earlier, as they arrive).
        series = 'tritonllm_loadtest_requests_total{model="tensorrt_llm_bls",outcome="success"}'
        urls = [f"http://127.0.0.1:{port}/metrics" for port in (base, base + 1)]  # one /metrics a worker
        for text in scrape_until(urls, series, process, deadline):
            lines = [line for line in text.splitlines() if 'model="tensorrt_llm_bls"' in line]
            for name in ("ttft_seconds_bucket", "itl_seconds_bucket", "e2e_seconds_count", "users"):
                assert any(line.startswith(f"tritonllm_loadtest_{name}{{") for line in lines), name
            assert 'tritonllm_loadtest_output_tokens_total{model="tensorrt_llm_bls"}' in text
        stdout, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert "2 workers connected" in stderr
    summary = check_reports(tmp_path, "tensorrt_llm_bls", "gRPC")
    assert summary["config"]["shape"] == "poisson" and summary["metrics"]["peak_users"] == 2


def test_spike_of_non_streaming_users(triton_server, tiny_llama_dir, tmp_path) -> None:
    command = loadtest_command(
        triton_server, tiny_llama_dir, tmp_path,
        "--metrics-port", "0", "--llm-transport", "http", "--llm-prompts", "bundled",
        "--llm-shape", "spike", "--llm-users", "1", "--llm-spike-users", "4", "--llm-spike-at", "3",
        "--llm-spike-duration", "4", "--llm-duration", "10", "--llm-sample-interval", "1",
    )  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 30)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    m = summary["metrics"]
    assert m["requests"] > 0 and m["failures"] == 0 and m["peak_users"] == 4
    assert m["ttft_p50_ms"] is None and m["e2e_p50_ms"] > 0  # no tokens streamed, no TTFT
    assert [stage["users"] for stage in summary["stages"]] == [1, 4, 1]
    with open(tmp_path / "locust_stats.csv") as f:
        assert {r["Type"] for r in csv.DictReader(f)} == {"HTTP", ""}  # "" is the Aggregated row
