"""A real tritonserver (from the nvidia-pytriton wheel) serving the tiny model, shared by the whole session.

Loaded as a pytest plugin from `tests/conftest.py` so every test folder (Triton models, client,
load test, observability) talks to the same server instead of starting its own. Also the gRPC stream
client the Triton model tests share (`GrpcStream`, `engine_stream`).
"""

from __future__ import annotations

import queue
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonllm_client.transport import grpc_tensor

from tritonllm.triton.launcher import LaunchOptions, TritonServer

STREAM_TIMEOUT_S = 60.0  # a stream's next response
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


class GrpcStream:
    """One gRPC stream for one generation (cancelling a stream cancels every request on it)."""

    def __init__(
        self,
        server: TritonServer,
        model: str,
        inputs: dict[str, Any],
        request_id: str | None = None,
        tensors: list[grpcclient.InferInput] = (),
        outputs: list[str] | None = None,
        timeout_us: int | None = None,
    ):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))
        self.client.async_stream_infer(
            model,
            [grpc_tensor(k, v) for k, v in inputs.items()] + list(tensors),
            request_id=request_id or uuid.uuid4().hex,
            outputs=None if outputs is None else [grpcclient.InferRequestedOutput(o) for o in outputs],
            enable_empty_final_response=True,
            timeout=timeout_us,
        )

    def responses(self, limit: int | None = None):
        """Yield (outputs dict, error) until the final response (or `limit` data responses)."""
        count = 0
        while True:
            result, error = self.results.get(timeout=STREAM_TIMEOUT_S)
            if error is not None:
                yield None, str(error)
                return
            response = result.get_response()
            outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
            if outputs:
                count += 1
                yield outputs, None
            if response.parameters["triton_final_response"].bool_param:
                return
            if limit is not None and count >= limit:
                return

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def engine_stream(
    server: TritonServer,
    request_id: str,
    inputs: dict[str, Any],
    outputs: list[str] | None = None,
    timeout_us: int | None = None,
) -> GrpcStream:
    """A request straight to `tensorrt_llm` (token ids in, NVIDIA's engine tensor names)."""
    ids = np.array([[5, 6, 7, 8, 9]], dtype=np.int32)
    input_ids = grpcclient.InferInput("input_ids", list(ids.shape), "INT32")
    input_ids.set_data_from_numpy(ids)
    return GrpcStream(
        server,
        "tensorrt_llm",
        inputs,
        request_id=request_id,
        tensors=[input_ids],
        outputs=outputs,
        timeout_us=timeout_us,
    )
