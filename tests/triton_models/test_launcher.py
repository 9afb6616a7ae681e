"""Launcher pieces that need no server: templates render completely; paths and flags are right."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from pathlib import Path

import requests

from tritonllm.triton.launcher import (
    MODELS,
    LaunchOptions,
    TritonServer,
    build_backend_dir,
    pytriton_paths,
    render_repository,
    server_command,
)


def test_render_fills_every_placeholder(tmp_path: Path) -> None:
    options = LaunchOptions(model=str(tmp_path / "engine"), max_batch_size=8, num_threads=1)
    repo = render_repository(tmp_path / "repo", options)
    for model in MODELS:
        config = (repo / model / "config.pbtxt").read_text()
        assert "${" not in config, model
        assert re.search(r"max_batch_size: 8\b", config), model
        assert (repo / model / "1").is_dir()
    engine = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert str((tmp_path / "engine").resolve()) in engine and "decoupled: true" in engine
    assert list((repo / "tensorrt_llm" / "1" / "__pycache__").glob("model.*.pyc")), "precompiled"


def test_backend_dir_and_command(tmp_path: Path) -> None:
    paths = pytriton_paths()
    backend = build_backend_dir(tmp_path / "b", paths)
    names = sorted(p.name for p in (backend / "python").iterdir())
    assert names == ["libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    options = LaunchOptions(model="m", admin_key="k")
    cmd = server_command(options, tmp_path / "repo", backend, paths)
    assert "--http-address=127.0.0.1" in cmd and "--grpc-address=127.0.0.1" in cmd
    assert any(c.startswith("--http-restricted-api=") and c.endswith("=k") for c in cmd)
    assert not any(
        "restricted" in c
        for c in server_command(LaunchOptions(model="m", restrict_admin=False), tmp_path, backend, paths)
    )


def test_server_stops_cleanly_with_a_request_in_flight(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """SIGTERM with a streaming HTTP request open: the server is gone within the bound, stubs included.

    Triton 2.51 stops delivering responses on shutdown and waits for open HTTP connections until
    --exit-timeout-secs, then exits with status 1 ("Exit timeout expired"); idle, it exits with 0.
    Runs before the session's shared server (test_server.py): one tritonserver at a time.
    """
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    log_file = tmp_path / "tritonserver.log"
    options = LaunchOptions(
        model=str(tiny_llama_dir),
        http_port=ports[0],
        grpc_port=ports[1],
        metrics_port=ports[2],
        num_kv_blocks=256,
        tokens_per_block=4,
        num_threads=1,
        exit_timeout_s=3,
        drain_timeout_s=1,
    )
    # No C++ kernel build inside this short-lived server: killing a stub mid-build leaves torch's
    # build lock behind, which blocks every later load of the kernel.
    options.disable_kernels = True
    server = TritonServer(options, log_file=log_file)
    server.start()
    try:
        server.wait_ready(180)
        url = f"http://{server.http_url}/v2/models/tensorrt_llm_bls/generate_stream"
        body = {"text_input": "The quick brown fox", "max_tokens": 480, "min_tokens": 480, "stream": True}
        events: list[bytes] = []

        def read() -> None:
            with (
                contextlib.suppress(requests.RequestException),
                requests.post(url, json=body, stream=True, timeout=120) as response,
            ):
                events.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 60
        while not events and reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events, "the stream did not start"
        started = time.monotonic()
        pid = server.process.pid
        rc = server.stop()
        reader.join(30)
        assert rc in (0, 1) and not reader.is_alive()
        assert time.monotonic() - started < options.exit_timeout_s + options.drain_timeout_s + 15
    finally:
        server.stop()
    deadline = time.monotonic() + 5  # SIGKILLed stubs may take a moment to go
    while live_processes_in_group(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not live_processes_in_group(pid), "no stub outlived the server"


def live_processes_in_group(pgid: int) -> list[int]:
    """Processes of a process group that are still running (zombies waiting for init do not count)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live
