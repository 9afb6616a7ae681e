"""A real tritonserver (from the nvidia-pytriton wheel) serving the tiny model, shared by the session."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tritonllm.triton.launcher import LaunchOptions, TritonServer

READY_TIMEOUT_S = 180.0


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="session")
def triton_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    http, grpc, metrics = free_ports(3)
    options = LaunchOptions(
        model=str(tiny_llama_dir),
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        max_batch_size=64,
        max_num_seqs=32,
        num_kv_blocks=512,
        tokens_per_block=4,
        num_threads=1,
        exit_timeout_s=10,
        admin_key="test-admin-key",
    )
    log_file = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    server = TritonServer(options, log_file=log_file)
    try:
        server.start()
        try:
            server.wait_ready(READY_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            tail = log_file.read_text(errors="replace")[-6000:] if log_file.exists() else ""
            raise RuntimeError(f"{exc}\n--- tritonserver log tail ---\n{tail}") from None
        # The first decode step may build the C++ attention kernel (cached afterwards): warm up once.
        url = f"http://{server.http_url}/v2/models/tensorrt_llm_bls/generate"
        requests.post(url, json={"text_input": "warm up", "max_tokens": 2}, timeout=READY_TIMEOUT_S)
        server.log_path = log_file  # type: ignore[attr-defined]
        yield server
    finally:
        server.stop(timeout_s=30)
