"""The load test's own transports against the real tritonserver (plain threads, no gevent here)."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tritonllm_loadtest.transports import GrpcStreamTransport, HttpTransport
from tritonllm_loadtest.workload import GenerationRequest

MODELS = ["ensemble", "tensorrt_llm_bls"]
REQUEST = GenerationRequest("The quick brown fox", input_tokens=5, max_tokens=6)


def counter(model_dir: Path):
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("model", MODELS)
def test_streams_time_every_token(triton_server, tiny_llama_dir: Path, model: str) -> None:
    http = HttpTransport(triton_server.http_url, model, True, 60, counter(tiny_llama_dir))
    grpc = GrpcStreamTransport(triton_server.grpc_url, model, 60)
    try:
        for transport in (http, grpc):
            arrived = itertools.count()
            result = transport.generate(REQUEST, on_token=arrived.__next__)
            assert result.ok, result.error_message
            assert result.output_tokens == 6 == len(result.token_times) == next(arrived)  # min = max tokens
            assert 0 < result.ttft_s <= result.e2e_s
            assert len(result.itls_s) == 5 and all(gap >= 0 for gap in result.itls_s)
            assert result.text
    finally:
        grpc.close()


@pytest.mark.parametrize("model", MODELS)
def test_whole_reply_counts_tokens_with_the_tokenizer(triton_server, tiny_llama_dir, model: str) -> None:
    count = counter(tiny_llama_dir)
    result = HttpTransport(triton_server.http_url, model, False, 60, count).generate(REQUEST)
    assert result.ok, result.error_message
    assert result.output_tokens == count(result.text) > 0
    assert result.ttft_s is None and result.e2e_s > 0


def test_errors_are_classified(triton_server, tiny_llama_dir: Path) -> None:
    count = counter(tiny_llama_dir)
    empty = GenerationRequest("", 0, 4)
    sse = HttpTransport(triton_server.http_url, "ensemble", True, 60, count).generate(empty)
    assert sse.error_kind == "http_400" and "text_input" in sse.error_message  # rejected before streaming
    grpc = GrpcStreamTransport(triton_server.grpc_url, "ensemble", 60)
    try:
        result = grpc.generate(empty)
        assert result.error_kind == "server_error" and "text_input" in result.error_message
    finally:
        grpc.close()
    missing = HttpTransport(triton_server.http_url, "no_such_model", True, 60, count).generate(REQUEST)
    assert missing.error_kind in ("http_400", "http_404"), missing
    slow = HttpTransport(triton_server.http_url, "ensemble", True, 0.001, count).generate(
        GenerationRequest("x", 1, 200)
    )
    assert slow.error_kind == "timeout"


def test_closed_port_is_a_connection_error(tiny_llama_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening
        http = HttpTransport(f"127.0.0.1:{port}", "ensemble", True, 5, counter(tiny_llama_dir))
        assert http.generate(REQUEST).error_kind == "connection"
        grpc = GrpcStreamTransport(f"127.0.0.1:{port}", "ensemble", 5)
        try:
            assert grpc.generate(REQUEST).error_kind == "connection"
        finally:
            grpc.close()
