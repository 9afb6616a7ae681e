"""Launcher pieces that need no server: templates render completely; paths and flags are right."""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from pathlib import Path

import pytest
import requests
from triton_fixture import READY_TIMEOUT_S, engine_stream, metric_sum, tiny_server_options, wait_for

from tritonllm.triton.launcher import (
    MODELS,
    LaunchOptions,
    TritonServer,
    add_arguments,
    build_backend_dir,
    options_from_args,
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
    assert 'key: "max_engine_restarts" value: { string_value: "3" }' in engine
    assert 'key: "stream_interval" value: { string_value: "1" }' in engine
    assert list((repo / "tensorrt_llm" / "1" / "__pycache__").glob("model.*.pyc")), "precompiled"


@pytest.mark.parametrize(
    ("address", "url"),
    [("127.0.0.1", "127.0.0.1:9001"), ("0.0.0.0", "127.0.0.1:9001"), ("::", "127.0.0.1:9001"),
     ("10.1.2.3", "10.1.2.3:9001"), ("::1", "[::1]:9001")],
)  # fmt: skip
def test_render_points_the_bls_at_this_servers_grpc_port(tmp_path: Path, address: str, url: str) -> None:
    """The BLS streams from tensorrt_llm over the server's own gRPC endpoint (`engine_link`)."""
    options = LaunchOptions(model=str(tmp_path), address=address, grpc_port=9001)
    repo = render_repository(tmp_path / "repo", options)
    bls = (repo / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    assert f'key: "engine_grpc_url" value: {{ string_value: "{url}" }}' in bls


def test_render_non_decoupled_for_unary_clients(tmp_path: Path) -> None:
    repo = render_repository(tmp_path / "repo", LaunchOptions(model=str(tmp_path), decoupled=False))
    for model in ("tensorrt_llm", "tensorrt_llm_bls"):
        assert "model_transaction_policy { decoupled: false }" in (repo / model / "config.pbtxt").read_text()
    args = argparse.ArgumentParser()
    add_arguments(args)
    assert (
        options_from_args(args.parse_args(["--model", str(tmp_path), "--decoupled", "false"])).decoupled
        is False
    )
    restarts = args.parse_args(["--model", str(tmp_path), "--max-engine-restarts", "0"])
    assert options_from_args(restarts).max_engine_restarts == 0
    interval = args.parse_args(["--model", str(tmp_path), "--stream-interval", "4"])
    assert options_from_args(interval).stream_interval == 4
    with pytest.raises(ValueError, match="stream_interval"):
        LaunchOptions(model=str(tmp_path), stream_interval=0)


def launch_options(tmp_path: Path, *argv: str) -> LaunchOptions:
    """What `tritonllm launch --model <tmp_path> <argv>` would serve with."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return options_from_args(parser.parse_args(["--model", str(tmp_path), *argv]))


def engine_config(tmp_path: Path, *argv: str) -> str:
    """The engine model's config.pbtxt that `tritonllm launch <argv>` renders (as a launch does, over the
    last one)."""
    repository = render_repository(tmp_path / "repository", launch_options(tmp_path, *argv))
    return (repository / "tensorrt_llm" / "config.pbtxt").read_text()


def test_launch_renders_the_step_token_budget(tmp_path: Path) -> None:
    """`--max-num-batched-tokens` reaches the engine model's config."""
    engine = engine_config(tmp_path, "--max-num-batched-tokens", "128")
    assert 'key: "max_num_batched_tokens" value: { string_value: "128" }' in engine


def test_launch_renders_the_kv_block_size(tmp_path: Path) -> None:
    """`--tokens-per-block` reaches the engine model's config; left out, it is left to the engine."""
    for argv, rendered in (([], ""), (["--tokens-per-block", "64"], "64")):
        engine = engine_config(tmp_path, *argv)
        assert f'key: "tokens_per_block" value: {{ string_value: "{rendered}" }}' in engine


def test_launch_renders_the_send_stall_timeout_and_rejects_a_non_positive_one(tmp_path: Path) -> None:
    """`--send-stall-timeout` reaches the engine model's config (default 60); 0 is refused up front."""
    for argv, rendered in (([], "60.0"), (["--send-stall-timeout", "7.5"], "7.5")):
        engine = engine_config(tmp_path, *argv)
        assert f'key: "send_stall_timeout_s" value: {{ string_value: "{rendered}" }}' in engine
    with pytest.raises(ValueError, match="send_stall_timeout_s must be positive"):
        launch_options(tmp_path, "--send-stall-timeout", "0")


def test_launch_serves_auto_quantization_and_dtype_by_default(tmp_path: Path) -> None:
    """`tritonllm launch` asks the engine for auto (int8 on the CPU kernels, else as built or none), an auto
    dtype and an auto KV cache; an explicit choice renders as given."""
    for argv, quantization, kv in (
        ([], "auto", "auto"),
        (["--quantization", "none", "--kv-cache-dtype", "int8"], "none", "int8"),
    ):
        options = launch_options(tmp_path, *argv)
        assert (options.quantization, options.dtype, options.kv_cache_dtype) == (quantization, "auto", kv)
        engine = engine_config(tmp_path, *argv)
        assert f'key: "quantization" value: {{ string_value: "{quantization}" }}' in engine
        assert f'key: "kv_cache_dtype" value: {{ string_value: "{kv}" }}' in engine


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


def test_server_streams_in_intervals_rejects_when_busy_and_stops_cleanly(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """One small server (one running, one waiting request at most, `--stream-interval 3`) for three checks:

    - a streamed request gets its first token alone, then three tokens a response;
    - a request beyond the queue gets a "busy" error at once while the others carry on;
    - stopping it (as on SIGTERM) drains the engine first, so every open request, streamed or not,
      gets its final response (finished or aborted), and the server is gone within the bound with
      no stub outliving it.

    Triton 2.51 keeps counting an HTTP connection for every `/generate` call to a decoupled model
    after its response, waits `--exit-timeout-secs` for it and exits with 1 (measured: after one
    such call, idle, the exit status is 1 after the full timeout; with only SSE streams it is 0).
    """
    options = tiny_server_options(
        tiny_llama_dir,
        num_kv_blocks=256,
        max_num_seqs=1,
        max_waiting=1,
        drain_timeout_s=1,
        exit_timeout_s=5,
        # No C++ kernel build inside this short-lived server: killing a stub mid-build leaves torch's
        # build lock behind, which blocks every later load of the kernel.
        disable_kernels=True,
        stream_interval=3,
    )
    log_file = tmp_path / "tritonserver.log"
    server = TritonServer(options, log_file=log_file)
    server.start()
    base = f"http://{server.http_url}/v2/models/tensorrt_llm_bls"
    try:
        server.wait_ready(READY_TIMEOUT_S)
        seven = {"input_lengths": 5, "request_output_len": 7, "min_tokens": 7, "streaming": True}
        stream = engine_stream(server, "interval", seven)
        try:
            chunks = [out["output_ids"].size for out, error in stream.responses() if error is None and out]
        finally:
            stream.close()
        assert chunks == [1, 3, 3], chunks
        body = {"text_input": "The quick brown fox", "max_tokens": 480, "min_tokens": 480, "stream": True}
        events: list[dict] = []
        waiting: list[requests.Response] = []

        def stream() -> None:
            with requests.post(f"{base}/generate_stream", json=body, stream=True, timeout=120) as response:
                events.extend(json.loads(line[6:]) for line in response.iter_lines() if line)

        def queued() -> None:
            waiting.append(
                requests.post(f"{base}/generate", json={"text_input": "hi", "max_tokens": 4}, timeout=120)
            )

        reader = threading.Thread(target=stream)
        reader.start()
        assert wait_for(lambda: bool(events) or not reader.is_alive(), 60) and events, "the stream started"
        second = threading.Thread(target=queued)
        second.start()
        assert wait_for(lambda: metric_sum(server.metrics_url, "tritonllm_num_requests_waiting") >= 1, 30)
        started = time.monotonic()
        busy = requests.post(f"{base}/generate", json={"text_input": "hi", "max_tokens": 4}, timeout=60)
        assert time.monotonic() - started < 10, "rejected at once"
        # Triton 2.51's /generate answers every error a model sends with 400; the text says "busy".
        assert busy.status_code == 400 and "server busy" in busy.json()["error"], busy.text
        assert reader.is_alive() and second.is_alive(), "the others carry on"

        started = time.monotonic()
        pid = server.process.pid
        rc = server.stop()
        reader.join(30)
        second.join(30)
        assert rc in (0, 1), log_file.read_text(errors="replace")[-3000:]
        assert time.monotonic() - started < options.drain_timeout_s + options.exit_timeout_s + 15
        assert events[-1].get("finish_reason") in ("abort", "length"), events[-1]
        assert len(waiting) == 1 and waiting[0].status_code == 200, "the queued request got its answer"
        assert waiting[0].json()["finish_reason"] in ("abort", "length")
    finally:
        server.stop()
    assert wait_for(lambda: not live_processes_in_group(pid), 5), "no stub outlived the server"
    log = log_file.read_text(errors="replace")
    # The stubs enable faulthandler: a crash on the way out (it was the engine's teardown) shows here.
    assert "Fatal Python error" not in log, log[log.find("Fatal Python error") :][:2000]


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
