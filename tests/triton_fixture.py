"""A real tritonserver (from the nvidia-pytriton wheel) serving the tiny model, shared by the whole session.

Loaded as a pytest plugin from `tests/conftest.py` so every test folder (Triton models, client,
load test, observability) talks to the same server instead of starting its own.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from tritonllm.triton.launcher import LaunchOptions, TritonServer

READY_TIMEOUT_S = 300.0  # a loaded 2-core machine takes minutes to import torch in 4 stubs
ADMIN_KEY = "test-admin-key"


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0, step_s: float = 0.05) -> bool:
    """Poll until true or the deadline passes (the server refreshes its metrics every 0.25 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def metric_values(metrics_url: str, pattern: str) -> list[float]:
    """Values of the series whose name matches `pattern` (a regex; labels optional) on `/metrics`."""
    text = requests.get(metrics_url, timeout=10).text
    return [float(v) for v in re.findall(rf"^{pattern}(?:{{[^}}]*}})? (\S+)$", text, re.M)]


def metric_sum(metrics_url: str, pattern: str) -> float:
    return sum(metric_values(metrics_url, pattern))


def start_server(options: LaunchOptions, log_file: Path) -> TritonServer:
    """Start and wait for a server; on failure the error carries the server log's tail."""
    server = TritonServer(options, log_file=log_file)
    server.start()
    try:
        server.wait_ready(READY_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as exc:
        server.stop(timeout_s=10)
        tail = log_file.read_text(errors="replace")[-6000:] if log_file.exists() else ""
        raise RuntimeError(f"{exc}\n--- tritonserver log tail ---\n{tail}") from None
    server.log_path = log_file  # type: ignore[attr-defined]
    return server


def tiny_server_options(model_dir: Path, **overrides: object) -> LaunchOptions:
    """Launch options for the tiny model on free loopback ports, one engine thread."""
    http, grpc, metrics = free_ports(3)
    values: dict[str, object] = dict(
        model=str(model_dir),
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        max_batch_size=64,
        max_num_seqs=32,
        num_kv_blocks=512,
        tokens_per_block=4,
        num_threads=1,
        exit_timeout_s=10,
        admin_key=ADMIN_KEY,
    )
    values.update(overrides)
    return LaunchOptions(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def triton_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    log_file = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    server = start_server(tiny_server_options(tiny_llama_dir), log_file)
    try:
        # The first decode step may build the C++ attention kernel (cached afterwards): warm up once.
        url = f"http://{server.http_url}/v2/models/tensorrt_llm_bls/generate"
        requests.post(url, json={"text_input": "warm up", "max_tokens": 2}, timeout=READY_TIMEOUT_S)
        yield server
    finally:
        server.stop(timeout_s=30)
