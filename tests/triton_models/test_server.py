"""Integration tests against a real tritonserver: ensemble and BLS, HTTP and gRPC, streaming or not."""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from triton_fixture import GrpcStream, engine_stream, metric_sum, wait_for
from tritonllm_client.transport import grpc_tensor

from tritonllm.engine import EngineConfig, LLMEngine, SamplingParams
from tritonllm.model.cpu_kernels import load_kernels
from tritonllm.triton.launcher import TritonServer
from tritonllm.triton.text import CONTEXT_TOKENS, TextCodec

MODELS = ("ensemble", "tensorrt_llm_bls")
TIMEOUT_S = 60
PROMPTS = [
    "The quick brown fox",
    "A paged key-value cache",
    "Triton Inference Server runs models",
    "Il était une fois",
    "Grouped-query attention lets",
    "0123456789 + 42 =",
]


# Reference: the engine itself, greedy, decoded like postprocessing does.


@lru_cache(maxsize=1)
def _reference_engine(model: str) -> tuple[LLMEngine, TextCodec]:
    config = EngineConfig(model=model, tokens_per_block=4, num_kv_blocks=512, num_threads=1)
    return LLMEngine(config), TextCodec(model)


def reference_tokens(model: str, text: str, max_tokens: int, bad_words: tuple[str, ...] = ()) -> list[int]:
    engine, codec = _reference_engine(model)
    params = SamplingParams(max_tokens=max_tokens, top_k=1, bad_token_ids=codec.encode_words(list(bad_words)))
    engine.add_request(uuid.uuid4().hex, codec.encode(text), params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@lru_cache(maxsize=256)
def reference(model: str, text: str, max_tokens: int, bad_words: tuple[str, ...] = ()) -> str:
    _, codec = _reference_engine(model)
    tokens = reference_tokens(model, text, max_tokens, bad_words)
    return codec.delta(codec.encode(text)[-CONTEXT_TOKENS:], tokens)


# Clients.


def http_generate(server: TritonServer, model: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"http://{server.http_url}/v2/models/{model}/generate", json=body, timeout=TIMEOUT_S)


def sse_generate(server: TritonServer, model: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    url = f"http://{server.http_url}/v2/models/{model}/generate_stream"
    events = []
    with requests.post(url, json=body, stream=True, timeout=TIMEOUT_S) as response:
        for line in response.iter_lines():
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: ") :]))
    return events


def grpc_generate(server: TritonServer, model: str, inputs: dict[str, Any]) -> tuple[list[str], str | None]:
    stream = GrpcStream(server, model, inputs)
    try:
        texts, error = [], None
        for outputs, err in stream.responses():
            if err is not None:
                error = err
            else:
                texts.append(outputs["text_output"].reshape(-1)[0].decode())
        return texts, error
    finally:
        stream.close()


def kv_blocks_used(server: TritonServer) -> float:
    return metric_sum(server.metrics_url, "tritonllm_kv_cache_blocks_used")


def aborted(server: TritonServer) -> float:
    return metric_sum(server.metrics_url, r'tritonllm_requests_finished_total\{[^}]*reason="abort"[^}]*\}')


# Generation.


@pytest.mark.parametrize("model", MODELS)
def test_http_generate_equals_engine_output(
    triton_server: TritonServer, tiny_llama_dir: Path, model: str
) -> None:
    for prompt in PROMPTS[:3]:
        r = http_generate(
            triton_server, model, {"text_input": prompt, "max_tokens": 12, "exclude_input_in_output": True}
        )
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == reference(str(tiny_llama_dir), prompt, 12)


@pytest.mark.parametrize("model", MODELS)
def test_http_generate_includes_prompt_by_default(triton_server: TritonServer, model: str) -> None:
    r = http_generate(triton_server, model, {"text_input": "The quick brown fox", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"].startswith("The quick brown fox")


@pytest.mark.parametrize("model", MODELS)
def test_sse_stream_equals_non_streamed(
    triton_server: TritonServer, tiny_llama_dir: Path, model: str
) -> None:
    prompt = PROMPTS[3]
    events = sse_generate(triton_server, model, {"text_input": prompt, "max_tokens": 16, "stream": True})
    assert all("error" not in e for e in events), events
    assert len(events) > 1, "streamed in pieces"
    whole = http_generate(
        triton_server, model, {"text_input": prompt, "max_tokens": 16, "exclude_input_in_output": True}
    ).json()["text_output"]
    assert "".join(e["text_output"] for e in events) == whole == reference(str(tiny_llama_dir), prompt, 16)


@pytest.mark.parametrize("model", MODELS)
def test_grpc_streaming_equals_engine_output(
    triton_server: TritonServer, tiny_llama_dir: Path, model: str
) -> None:
    prompt = PROMPTS[4]
    texts, error = grpc_generate(
        triton_server, model, {"text_input": prompt, "max_tokens": 16, "stream": True}
    )
    assert error is None and len(texts) > 1
    assert "".join(texts) == reference(str(tiny_llama_dir), prompt, 16)
    # stream=False over a gRPC stream: exactly one response with the whole text.
    texts, error = grpc_generate(
        triton_server, model, {"text_input": prompt, "max_tokens": 16, "exclude_input_in_output": True}
    )
    assert error is None and texts == [reference(str(tiny_llama_dir), prompt, 16)]


@pytest.mark.parametrize("model", MODELS)
def test_bad_words_are_never_generated(triton_server: TritonServer, tiny_llama_dir: Path, model: str) -> None:
    model_dir = str(tiny_llama_dir)
    prompt = PROMPTS[1]
    _, codec = _reference_engine(model_dir)
    plain = reference_tokens(model_dir, prompt, 12)
    # A generated token whose text encodes back to exactly that token, so banning the word bans it.
    word = next(w for t in plain if codec.encode_words([w := codec.decode([t])]) == [[t]])
    expected = reference(model_dir, prompt, 12, (word,))
    assert expected != reference(model_dir, prompt, 12)
    body = {"text_input": prompt, "max_tokens": 12, "bad_words": [word], "exclude_input_in_output": True}
    r = http_generate(triton_server, model, body)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == expected


@pytest.mark.parametrize("model", MODELS)
def test_16_concurrent_grpc_streams(triton_server: TritonServer, tiny_llama_dir: Path, model: str) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(16)]

    def run(prompt: str) -> tuple[str, str | None]:
        texts, error = grpc_generate(
            triton_server, model, {"text_input": prompt, "max_tokens": 24, "stream": True}
        )
        return "".join(texts), error

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, prompts))
    for prompt, (text, error) in zip(prompts, results, strict=True):
        assert error is None
        assert text == reference(str(tiny_llama_dir), prompt, 24)


# Bad input: a specific error for that request only.

BAD_INPUTS = [
    ({"text_input": "", "max_tokens": 8}, "text_input"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 100_000}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 8, "top_p": 1.5}, "top_p"),
    ({"text_input": "hi", "max_tokens": 8, "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "max_tokens": 8, "beam_width": 2}, "beam_width"),
    ({"text_input": "hi", "max_tokens": 8, "lora_task_id": 3}, "lora_task_id"),
    ({"text_input": "hi", "max_tokens": 8, "num_return_sequences": 2}, "num_return_sequences"),
    ({"text_input": "hi", "max_tokens": 8, "no_such_input": 1}, "no_such_input"),
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": "fox " * 600, "max_tokens": 8}, "input_ids"),  # longer than the model's limit
]


@pytest.mark.parametrize("model", MODELS)
def test_bad_inputs_fail_alone(triton_server: TritonServer, tiny_llama_dir: Path, model: str) -> None:
    good: dict[str, Any] = {}
    prompt = PROMPTS[0]

    def run_good() -> None:
        good["result"] = grpc_generate(
            triton_server, model, {"text_input": prompt, "max_tokens": 48, "min_tokens": 48, "stream": True}
        )

    thread = threading.Thread(target=run_good)
    thread.start()
    for body, tensor in BAD_INPUTS:
        r = http_generate(triton_server, model, body)
        assert r.status_code >= 400, (body, r.text)
        assert tensor in r.json()["error"], (body, r.text)
    texts, error = grpc_generate(
        triton_server, model, {"text_input": "hi", "max_tokens": 8, "top_p": 1.5, "stream": True}
    )
    assert error is not None and "top_p" in error and texts == []
    thread.join(TIMEOUT_S)
    texts, error = good["result"]
    assert error is None and len(texts) >= 40


def test_wrong_dtype_names_the_input(triton_server: TritonServer) -> None:
    wrong = grpcclient.InferInput("max_tokens", [1, 1], "FP32")
    wrong.set_data_from_numpy(np.array([[8.0]], dtype=np.float32))
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("ensemble", [grpc_tensor("text_input", "hi"), wrong])
        _, error = results.get(timeout=TIMEOUT_S)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None and "max_tokens" in str(error) and "FP32" in str(error), error


def test_malformed_json_is_rejected(triton_server: TritonServer) -> None:
    url = f"http://{triton_server.http_url}/v2/models/ensemble/generate"
    r = requests.post(url, data=b'{"text_input": "hi", "max_tokens": ', timeout=TIMEOUT_S)
    assert r.status_code >= 400 and "error" in r.json()  # Triton answers 500 here


# Cancellation and metrics.


# The cancellation tests cancel as soon as the first responses arrive: the tiny model writes its 480
# tokens in ~0.4 s, so waiting first (e.g. for the 0.25 s metrics refresh) races the natural end. The
# abort counter moving proves the request was still running when the cancel reached the engine.


def test_bls_cancellation_frees_kv_blocks(triton_server: TritonServer) -> None:
    aborted_before = aborted(triton_server)
    stream = GrpcStream(
        triton_server,
        "tensorrt_llm_bls",
        {"text_input": "The quick brown fox", "max_tokens": 480, "min_tokens": 480, "stream": True},
    )
    try:
        received = list(stream.responses(limit=3))
        assert len(received) == 3 and all(err is None for _, err in received)
    finally:
        stream.close(cancel=True)
    assert wait_for(lambda: kv_blocks_used(triton_server) == 0, timeout_s=3)
    assert wait_for(lambda: aborted(triton_server) == aborted_before + 1, timeout_s=3)


def test_bls_sse_disconnect_frees_kv_blocks(triton_server: TritonServer) -> None:
    """A client that drops its HTTP SSE connection mid-stream cancels the engine request."""
    url = f"http://{triton_server.http_url}/v2/models/tensorrt_llm_bls/generate_stream"
    body = {"text_input": "A paged key-value cache", "max_tokens": 480, "min_tokens": 480, "stream": True}
    aborted_before = aborted(triton_server)
    with requests.post(url, json=body, stream=True, timeout=TIMEOUT_S) as response:
        lines = response.iter_lines()
        events = [line for line in itertools.islice(lines, 6) if line.startswith(b"data: ")]
        assert events and b"error" not in events[0]
    # Leaving the block closed the connection.
    assert wait_for(lambda: aborted(triton_server) == aborted_before + 1, timeout_s=5)
    assert wait_for(lambda: kv_blocks_used(triton_server) == 0, 3)


def test_the_engine_stub_maps_the_kernel_build_this_process_loads(triton_server: TritonServer) -> None:
    """One build of the CPU kernels serves every process (no second ~25 s build at a server's start),
    and none rebuilt it under the other (a replaced library shows in the maps as deleted)."""
    kernels = load_kernels()
    assert kernels is not None
    maps = Path(f"/proc/{triton_server.stub_pids()['tensorrt_llm']}/maps").read_text()
    mapped = {line.split(maxsplit=5)[-1] for line in maps.splitlines() if "tritonllm_cpu_" in line}
    assert mapped == {kernels.__file__}


def test_engine_model_sends_the_outputs_asked_for(triton_server: TritonServer) -> None:
    """Every output when the client names none; exactly those it names otherwise, with the same tokens."""
    inputs = {"input_lengths": 5, "request_output_len": 4, "min_tokens": 4, "streaming": True}

    def stream(outputs: list[str] | None) -> list[dict[str, np.ndarray]]:
        s = engine_stream(triton_server, uuid.uuid4().hex, inputs, outputs)
        try:
            replies = list(s.responses())
        finally:
            s.close()
        assert all(err is None for _, err in replies), replies
        return [out for out, _ in replies]

    everything, asked = stream(None), stream(["output_ids"])
    default_outputs = {"output_ids", "sequence_length", "output_context_ids", "finish_reason"}
    assert all(set(out) == default_outputs for out in everything), [set(o) for o in everything]
    assert all(set(out) == {"output_ids"} for out in asked), [set(o) for o in asked]
    tokens = [[int(t) for t in out["output_ids"].reshape(-1)] for out in asked]
    assert tokens == [[int(t) for t in out["output_ids"].reshape(-1)] for out in everything]
    assert len(tokens) == 4


def test_stop_input_cancels_the_request_with_that_id(triton_server: TritonServer) -> None:
    """NVIDIA's `stop` input: a second request with the same id ends the first within a step."""
    rid = f"stop-me-{uuid.uuid4().hex}"
    long = {"input_lengths": 5, "request_output_len": 400, "min_tokens": 400, "streaming": True}
    stream = engine_stream(triton_server, rid, long)
    try:
        assert len(list(stream.responses(limit=3))) == 3
        stopper = engine_stream(
            triton_server, rid, {"input_lengths": 5, "request_output_len": 1, "stop": True}
        )
        stop_replies = list(stopper.responses())
        stopper.close()
        assert all(err is None for _, err in stop_replies), stop_replies
        started = time.monotonic()
        rest = list(stream.responses())
        assert time.monotonic() - started < 10
        assert len(rest) < 400 - 3, "the request was cut short"
        outputs, error = rest[-1]
        assert error is None and outputs["finish_reason"].reshape(-1)[0] == b"abort", "the last says why"
    finally:
        stream.close()
    assert wait_for(lambda: kv_blocks_used(triton_server) == 0, 3)


# Time limits: Triton passes a gRPC request's `timeout` to the model and enforces nothing itself for a
# Python model; HTTP /generate passes a `timeout` key as a parameter (both microseconds).

LONG_TEXT = {"text_input": "The quick brown fox", "max_tokens": 480, "min_tokens": 480, "stream": True}


def timed_out(server: TritonServer) -> float:
    return metric_sum(server.metrics_url, r'tritonllm_requests_finished_total\{[^}]*reason="timeout"[^}]*\}')


def test_a_grpc_timeout_ends_an_engine_request_with_reason_timeout(triton_server: TritonServer) -> None:
    long = {"input_lengths": 5, "request_output_len": 480, "min_tokens": 480, "streaming": True}
    before = timed_out(triton_server)
    stream = engine_stream(triton_server, uuid.uuid4().hex, long, timeout_us=100_000)
    try:
        replies = list(stream.responses())
    finally:
        stream.close()
    outputs, error = replies[-1]
    assert error is None and outputs["finish_reason"].reshape(-1)[0] == b"timeout", replies[-1]
    assert len(replies) < 480, "the request was cut short"
    assert wait_for(lambda: timed_out(triton_server) == before + 1, timeout_s=3)
    assert wait_for(lambda: kv_blocks_used(triton_server) == 0, 3)


@pytest.mark.parametrize("transport", ["grpc", "sse"])
@pytest.mark.parametrize("model", MODELS)
def test_text_models_pass_their_timeout_to_the_engine(
    triton_server: TritonServer, model: str, transport: str
) -> None:
    """gRPC `timeout=` and the HTTP `timeout` key both end the generation early, named as a timeout."""
    before = timed_out(triton_server)
    if transport == "grpc":
        stream = GrpcStream(triton_server, model, LONG_TEXT, timeout_us=100_000)
        try:
            replies = list(stream.responses())
        finally:
            stream.close()
        assert all(err is None for _, err in replies), replies[-1]
        texts = [out["text_output"] for out, _ in replies]
    else:
        events = sse_generate(triton_server, model, {**LONG_TEXT, "timeout": 100_000})
        assert all("error" not in e for e in events), events[-1]
        texts = [e["text_output"] for e in events]
    assert 0 < len(texts) < 480, "the request was cut short"
    assert wait_for(lambda: timed_out(triton_server) == before + 1, timeout_s=3)
    assert wait_for(lambda: kv_blocks_used(triton_server) == 0, 3)


@pytest.mark.parametrize("model", MODELS)
def test_a_bad_timeout_parameter_fails_that_request_only(triton_server: TritonServer, model: str) -> None:
    response = http_generate(triton_server, model, {**LONG_TEXT, "stream": False, "timeout": -5})
    assert response.status_code == 400 and "timeout" in response.json()["error"], response.text
    ok = http_generate(triton_server, model, {"text_input": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_metrics_have_ttft_histogram_and_move(triton_server: TritonServer) -> None:
    before = metric_sum(triton_server.metrics_url, "tritonllm_time_to_first_token_seconds_count")
    r = http_generate(triton_server, "ensemble", {"text_input": "hello", "max_tokens": 4})
    assert r.status_code == 200
    assert wait_for(
        lambda: metric_sum(triton_server.metrics_url, "tritonllm_time_to_first_token_seconds_count") > before
    )
    text = requests.get(triton_server.metrics_url, timeout=10).text
    for name in (
        "tritonllm_time_to_first_token_seconds_bucket",
        "tritonllm_inter_token_latency_seconds_bucket",
        "tritonllm_e2e_request_latency_seconds_bucket",
        "tritonllm_queue_time_seconds_bucket",
        "tritonllm_num_requests_running",
        "tritonllm_num_requests_waiting",
        "tritonllm_kv_cache_usage_ratio",
        "tritonllm_generation_tokens_total",
        "tritonllm_prompt_tokens_total",
    ):
        assert name in text, name


def test_admin_api_needs_the_key(triton_server: TritonServer) -> None:
    url = f"http://{triton_server.http_url}/v2/repository/index"
    assert requests.post(url, timeout=10).status_code == 403
    ok = requests.post(url, headers={"tritonllm-admin-key": "test-admin-key"}, timeout=10)
    assert ok.status_code == 200


def test_bls_requests_cancelled_at_once_never_run_on(triton_server: TritonServer) -> None:
    """A cancel that lands while the BLS is still preprocessing, or before tensorrt_llm has the inner
    request, is not lost: none of these requests generates on to its 400 tokens (Triton may also drop
    one before the BLS sees it). A request sent after them marks the point where all have arrived."""
    generated = metric_sum(triton_server.metrics_url, "tritonllm_generation_tokens_total")
    body = {"text_input": "The quick brown fox", "max_tokens": 400, "min_tokens": 400, "stream": True}
    for _ in range(5):
        GrpcStream(triton_server, "tensorrt_llm_bls", body).close(cancel=True)
    texts, error = grpc_generate(triton_server, "tensorrt_llm_bls", {"text_input": "hi", "max_tokens": 2})
    assert error is None and texts
    assert wait_for(lambda: kv_blocks_used(triton_server) == 0, 10)
    assert metric_sum(triton_server.metrics_url, "tritonllm_num_requests_running") == 0
    total = metric_sum(triton_server.metrics_url, "tritonllm_generation_tokens_total") - generated
    assert total < 400, f"{total} tokens generated for cancelled requests"
