"""The nginx front (docker/nginx/nginx.conf) on a real nginx, in front of the shared test Triton.

The shipped config is rendered with loopback ports and the test server's address in place of the
compose name `triton`; everything else (HTTP/2 gRPC proxying, unbuffered SSE, timeouts) is as shipped.
Balancing over several replicas is nginx's round robin over the addresses Docker's DNS returns for
`triton`: it needs the compose network and is not exercised here.
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from observability_helpers import DOCKER_DIR
from triton_fixture import free_ports

NGINX_CONF = DOCKER_DIR / "nginx" / "nginx.conf"
TIMEOUT_S = 120.0


def nginx() -> str:
    path = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(path).exists():
        pytest.fail("nginx not found: `make venv` installs the Debian package nginx")
    return path


def render(workdir: Path, http_port: int, grpc_port: int, triton_server) -> Path:
    text = NGINX_CONF.read_text()
    replacements = {
        "listen 8000;": f"listen 127.0.0.1:{http_port};",
        "listen 8001 http2;": f"listen 127.0.0.1:{grpc_port} http2;",
        "triton:8000": triton_server.http_url,
        "triton:8001": triton_server.grpc_url,
        "/tmp/": f"{workdir}/",
        "access_log /dev/stdout;": f"access_log {workdir}/access.log;",
    }
    for old, new in replacements.items():
        assert old in text, f"{old!r} is no longer in {NGINX_CONF}: update this test"
        text = text.replace(old, new)
    path = workdir / "nginx.conf"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def front(triton_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    workdir = tmp_path_factory.mktemp("nginx")
    http_port, grpc_port = free_ports(2)
    conf = render(workdir, http_port, grpc_port, triton_server)
    base = [nginx(), "-e", "stderr", "-p", str(workdir), "-c", str(conf)]
    tested = subprocess.run([*base, "-t"], capture_output=True, text=True, timeout=30)
    assert tested.returncode == 0, tested.stderr
    process = subprocess.Popen([*base, "-g", "daemon off;"], stderr=open(workdir / "error.log", "wb"))  # noqa: SIM115
    url = f"127.0.0.1:{http_port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if requests.get(f"http://{url}/v2/health/ready", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert process.poll() is None, (workdir / "error.log").read_text()
        assert time.monotonic() < deadline, "nginx did not proxy /v2/health/ready within 30 s"
        time.sleep(0.2)
    try:
        yield url, f"127.0.0.1:{grpc_port}", workdir
    finally:
        process.terminate()
        process.wait(15)


def test_sse_stream_passes_through(front: tuple[str, str, Path]) -> None:
    http_url, _, _ = front
    body = {"text_input": "through nginx", "max_tokens": 6, "stream": True}
    events = []
    with requests.post(
        f"http://{http_url}/v2/models/tensorrt_llm_bls/generate_stream",
        json=body,
        stream=True,
        timeout=TIMEOUT_S,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: ") :]))
    assert len(events) >= 6
    assert events[-1]["finish_reason"] == "length"


def stream_over_grpc(client: grpcclient.InferenceServerClient, prompt: str) -> list[str]:
    """One generation on its own stream; the text pieces of its responses."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        inputs = []
        for name, value, dtype in (
            ("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
            ("max_tokens", np.array([[5]], dtype=np.int32), "INT32"),
            ("stream", np.array([[True]], dtype=bool), "BOOL"),
        ):
            tensor = grpcclient.InferInput(name, list(value.shape), dtype)
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        client.async_stream_infer(
            "ensemble", inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True
        )
        pieces = []
        while True:
            result, error = results.get(timeout=TIMEOUT_S)
            assert error is None, error
            response = result.get_response()
            if any(o.name == "text_output" for o in response.outputs):
                pieces.append(result.as_numpy("text_output").reshape(-1)[0].decode())
            if response.parameters["triton_final_response"].bool_param:
                return pieces
    finally:
        client.stop_stream()


def test_grpc_streams_pass_through_http2_proxy(front: tuple[str, str, Path]) -> None:
    """Several streams on one client connection, each proxied (and so balanced) as its own call."""
    _, grpc_url, workdir = front
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        assert client.is_server_ready()
        for i in range(3):
            pieces = stream_over_grpc(client, f"stream {i}")
            assert len(pieces) >= 5
    finally:
        client.close()
    calls = [
        line for line in (workdir / "access.log").read_text().splitlines() if "/ModelStreamInfer " in line
    ]
    assert len(calls) == 3
