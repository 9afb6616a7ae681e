"""A small non-decoupled server (`tritonllm launch --decoupled false`): unary clients, priorities, busy.

Two running requests at most and a short queue, so a few requests saturate it. The requests and reads
follow NVIDIA's scripts in their non-streaming mode (`client.infer` / `async_infer`, which a decoupled
model refuses with UNIMPLEMENTED).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from test_nvidia_clients import PROMPT, engine_inputs, tensor, text_inputs
from triton_fixture import metric_sum, start_server, tiny_server_options, wait_for
from tritonclient.utils import InferenceServerException

from tritonllm.triton.launcher import TritonServer

TIMEOUT_S = 120
LOW, HIGH = 5, 0


@pytest.fixture(scope="module")
def unary_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    options = tiny_server_options(
        tiny_llama_dir,
        decoupled=False,
        max_num_seqs=2,
        max_waiting=8,
        num_kv_blocks=256,
        disable_kernels=True,
    )
    server = start_server(options, tmp_path_factory.mktemp("unary") / "tritonserver.log")
    try:
        yield server
    finally:
        server.stop(timeout_s=30)


def client(server: TritonServer) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_unary_text_request(unary_server: TritonServer, model: str) -> None:
    result = client(unary_server).infer(model, text_inputs([PROMPT], 8, False), client_timeout=TIMEOUT_S)
    output = result.as_numpy("text_output")
    assert output.ndim == 1 and output[0].decode("utf-8")


def test_unary_batch_of_two(unary_server: TritonServer) -> None:
    prompts = [PROMPT, "Il était une fois"]
    one = [
        client(unary_server).infer("ensemble", text_inputs([p], 6, False)).as_numpy("text_output")[0]
        for p in prompts
    ]
    both = client(unary_server).infer("ensemble", text_inputs(prompts, 6, False)).as_numpy("text_output")
    assert both.tolist() == one


def test_inflight_batcher_client_unary(unary_server: TritonServer) -> None:
    """`async_infer` with the `Streaming` parameter NVIDIA's script sends; output_ids[0][0] has the prompt."""
    done: queue.Queue = queue.Queue()
    client(unary_server).async_infer(
        "tensorrt_llm",
        engine_inputs([5, 6, 7], 6, False),
        callback=lambda result, error: done.put(error or result),
        request_id="1",
        parameters={"Streaming": False},
    )
    result = done.get(timeout=TIMEOUT_S)
    assert not isinstance(result, InferenceServerException), result
    assert result.as_numpy("sequence_length")[0][0] == 3 + 6
    assert list(result.as_numpy("output_ids")[0][0][:3]) == [5, 6, 7]


@pytest.mark.parametrize(("model", "name"), [("tensorrt_llm", "streaming"), ("tensorrt_llm_bls", "stream")])
def test_streaming_on_a_unary_server_names_the_input(
    unary_server: TritonServer, model: str, name: str
) -> None:
    inputs = engine_inputs([5, 6], 4, True) if model == "tensorrt_llm" else text_inputs([PROMPT], 4, True)
    with pytest.raises(InferenceServerException, match=f"'{name}'"):
        client(unary_server).infer(model, inputs, client_timeout=TIMEOUT_S)


def first_token_ns(result) -> int:
    return int(result.as_numpy("first_token_time_ns")[0][0])


def test_high_priority_starts_before_earlier_low_priority_and_preempts(unary_server: TritonServer) -> None:
    """Two low-priority requests run, two more wait; high-priority ones, sent last through each model,
    get their first token before the waiting low ones and preempt a running one (two engine slots)."""
    perf = {"return_perf_metrics": np.array([[True]])}
    low_inputs = engine_inputs(
        [5, 6, 7],
        400,
        False,
        min_tokens=np.array([[400]], dtype=np.int32),
        priority=np.array([[LOW]], np.int32),
    )
    preemptions = metric_sum(unary_server.metrics_url, "tritonllm_preemptions_total")
    with ThreadPoolExecutor(8) as pool:
        lows = [
            pool.submit(
                client(unary_server).infer,
                "tensorrt_llm",
                low_inputs + [tensor(k, v) for k, v in perf.items()],
            )
            for _ in range(4)
        ]
        assert wait_for(
            lambda: metric_sum(unary_server.metrics_url, "tritonllm_num_requests_waiting") >= 2, 60
        )
        highs = [
            pool.submit(
                client(unary_server).infer,
                "tensorrt_llm",
                engine_inputs([8, 9], 4, False, priority=np.array([[HIGH]], np.int32), **perf),
            ),
            pool.submit(  # through the ensemble's preprocessing
                client(unary_server).infer,
                "ensemble",
                text_inputs([PROMPT], 4, False, priority=np.array([[HIGH]], np.int32), **perf),
            ),
            pool.submit(  # through the BLS, as a /generate JSON key
                requests.post,
                f"http://{unary_server.http_url}/v2/models/tensorrt_llm_bls/generate",
                json={"text_input": PROMPT, "max_tokens": 4, "priority": HIGH, "return_perf_metrics": True},
                timeout=TIMEOUT_S,
            ),
        ]
        high_results = [h.result(TIMEOUT_S) for h in highs]
        low_results = [low.result(TIMEOUT_S) for low in lows]
    bls = high_results[2]
    assert bls.status_code == 200 and "first_token_time_ns" in bls.json(), bls.text
    started_lows = sorted(low_results, key=first_token_ns)
    waited = started_lows[2:]  # the two that were waiting when the high ones came
    high_firsts = [first_token_ns(h) for h in high_results[:2]] + [bls.json()["first_token_time_ns"]]
    assert max(high_firsts) < min(first_token_ns(w) for w in waited)
    assert metric_sum(unary_server.metrics_url, "tritonllm_preemptions_total") >= preemptions + 1
    assert all(r.as_numpy("sequence_length")[0][0] == 3 + 400 for r in low_results), "preempted ones finish"


def test_rejections_are_busy_errors_and_counted(unary_server: TritonServer) -> None:
    """A burst beyond the queue: each refusal is UNAVAILABLE 'server busy' (retryable), none an internal
    'engine error' (a rejection raced inside the engine loop), and the rejected counter moves by as many."""
    rejected = metric_sum(unary_server.metrics_url, "tritonllm_requests_rejected_total")
    inputs = engine_inputs([5, 6, 7], 24, False, min_tokens=np.array([[24]], dtype=np.int32))
    errors: list[str] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            client(unary_server).infer("tensorrt_llm", inputs, client_timeout=TIMEOUT_S)
        except InferenceServerException as exc:
            with lock:
                errors.append(f"{exc.status()} {exc.message()}")

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert errors, "16 at once overflow 2 running + 8 waiting"
    assert all("server busy" in e and "UNAVAILABLE" in e for e in errors), errors
    assert wait_for(
        lambda: metric_sum(unary_server.metrics_url, "tritonllm_requests_rejected_total")
        == rejected + len(errors)
    )
