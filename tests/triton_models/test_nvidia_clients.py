"""The models driven the way NVIDIA's own client scripts drive them (real server, decoupled models).

Request shapes and reads follow `end_to_end_grpc_client.py` (ensemble / tensorrt_llm_bls) and
`inflight_batcher_llm_client.py` (tensorrt_llm) of triton-inference-server/tensorrtllm_backend: the
inputs are `[batch, 1]` arrays, streaming goes over one gRPC stream per generation, and the reads are
theirs (`as_numpy("text_output")[0].decode()`, `batch_index[0][0]`, `output_ids[0][0]`,
`sequence_length[0][0]`). This is this project's own test code, not NVIDIA's scripts.
"""

from __future__ import annotations

import queue
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from tritonllm.triton.launcher import TritonServer

TIMEOUT_S = 60
PROMPT = "The capital of France is"


def tensor(name: str, value: np.ndarray) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
    t.set_data_from_numpy(value)
    return t


def text_inputs(prompts: list[str], max_tokens: int, stream: bool, **extra: np.ndarray) -> list:
    """end_to_end_grpc_client.prepare_inputs, stacked along the batch axis for several prompts."""
    n = len(prompts)
    inputs = {
        "text_input": np.array([[p] for p in prompts]).astype(object),
        "max_tokens": np.full((n, 1), max_tokens, dtype=np.int32),
        "stream": np.full((n, 1), stream, dtype=bool),
        "beam_width": np.ones((n, 1), dtype=np.int32),
        "temperature": np.ones((n, 1), dtype=np.float32),
        "exclude_input_in_output": np.full((n, 1), True, dtype=bool),
        **extra,
    }
    return [tensor(k, v) for k, v in inputs.items()]


def run_stream(server: TritonServer, model: str, inputs: list, outputs: list[str], **kwargs) -> list:
    """One gRPC stream: send, let the server close it, return every result or error (as NVIDIA's script)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), results))
    try:
        client.async_stream_infer(
            model, inputs, outputs=[grpcclient.InferRequestedOutput(o) for o in outputs], **kwargs
        )
    finally:
        client.stop_stream()  # waits for the server to close the stream
        client.close()
    items = []
    while not results.empty():
        items.append(results.get_nowait())
    return items


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("streaming", [False, True])
def test_end_to_end_client_reads_text_output(
    triton_server: TritonServer, model: str, streaming: bool
) -> None:
    results = run_stream(triton_server, model, text_inputs([PROMPT], 16, streaming), ["text_output"])
    errors = [r for r in results if isinstance(r, InferenceServerException)]
    assert not errors, errors
    texts = []
    for result in results:
        output = result.as_numpy("text_output")
        assert output.ndim == 1, f"text_output is 1-D like NVIDIA's, got shape {output.shape}"
        texts.append(output[0].decode("utf-8"))  # what NVIDIA's script does
    assert "".join(texts)
    if not streaming:
        assert len(texts) == 1


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_end_to_end_client_batch_inputs(triton_server: TritonServer, model: str) -> None:
    """`--batch-inputs`: two prompts in one request, responses told apart by `batch_index[0][0]`."""
    prompts = [PROMPT, "Il était une fois"]
    single = [
        run_stream(triton_server, model, text_inputs([p], 8, False), ["text_output"])[0]
        .as_numpy("text_output")[0]
        .decode()
        for p in prompts
    ]
    results = run_stream(triton_server, model, text_inputs(prompts, 8, True), ["text_output", "batch_index"])
    assert not [r for r in results if isinstance(r, InferenceServerException)], results
    texts = ["", ""]
    for result in results:
        batch_index = result.as_numpy("batch_index")
        index = 0 if batch_index is None else batch_index[0][0]
        texts[index] += result.as_numpy("text_output")[0].decode("utf-8")
    assert texts == single


def engine_inputs(ids: list[int], max_tokens: int, streaming: bool, **extra: np.ndarray) -> list:
    """inflight_batcher_llm_client.prepare_inputs (greedy: top_k 1, top_p 0)."""
    inputs = {
        "input_ids": np.array([ids], dtype=np.int32),
        "input_lengths": np.array([[len(ids)]], dtype=np.int32),
        "request_output_len": np.array([[max_tokens]], dtype=np.int32),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
        "streaming": np.array([[streaming]], dtype=bool),
        "end_id": np.array([[2]], dtype=np.int32),
        "pad_id": np.array([[2]], dtype=np.int32),
        "runtime_top_k": np.array([[1]], dtype=np.int32),
        "runtime_top_p": np.array([[0.0]], dtype=np.float32),
        **extra,
    }
    return [tensor(k, v) for k, v in inputs.items()]


OPTIONAL_OUTPUTS = {
    "return_log_probs": ("cum_log_probs", "output_log_probs"),
    "return_perf_metrics": (
        "kv_cache_alloc_new_blocks",
        "kv_cache_reused_blocks",
        "kv_cache_alloc_total_blocks",
        "arrival_time_ns",
        "first_scheduled_time_ns",
        "first_token_time_ns",
        "last_token_time_ns",
        "acceptance_rate",
        "total_accepted_draft_tokens",
        "total_draft_tokens",
    ),
    "return_num_input_tokens": ("num_input_tokens",),
    "return_num_output_tokens": ("num_output_tokens",),
}


def test_inflight_batcher_client_streaming_reads(triton_server: TritonServer) -> None:
    ids = [5, 6, 7, 8, 9]
    flags = {name: np.array([[True]]) for name in OPTIONAL_OUTPUTS}
    results = run_stream(
        triton_server, "tensorrt_llm", engine_inputs(ids, 6, True, **flags), [], request_id="1"
    )
    assert not [r for r in results if isinstance(r, InferenceServerException)], results
    tokens, counted = [], 0
    for result in results:
        if result.get_output("output_ids") is None:
            continue
        output_ids, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
        assert output_ids.shape[:2] == (1, 1) and lengths.shape == (1, 1)
        tokens += list(output_ids[0][0][: lengths[0][0]])
        assert result.as_numpy("output_log_probs")[0].shape == (1, len(output_ids[0][0]))
        assert result.as_numpy("cum_log_probs").shape == (1, 1)
        for name in OPTIONAL_OUTPUTS["return_perf_metrics"]:
            assert result.as_numpy(name).shape == (1, 1), name
        assert result.as_numpy("num_input_tokens")[0][0] == len(ids)
        counted += int(result.as_numpy("num_output_tokens")[0][0])
    assert len(tokens) == counted == 6


def test_outputs_nvidia_sends_on_request_only_come_on_request(triton_server: TritonServer) -> None:
    results = run_stream(triton_server, "tensorrt_llm", engine_inputs([5, 6, 7], 4, False), [])
    (result,) = [r for r in results if r.get_output("output_ids") is not None]
    assert result.as_numpy("output_ids").shape == (1, 1, 3 + 4), "prompt included, as NVIDIA's"
    for names in OPTIONAL_OUTPUTS.values():
        for name in names:
            assert result.get_output(name) is None, name
    assert result.get_output("batch_index") is None, "batch_index only for batches, as NVIDIA's"
    logprobs = run_stream(
        triton_server,
        "tensorrt_llm",
        engine_inputs([5, 6, 7], 4, False, return_log_probs=np.array([[True]])),
        [],
    )
    (result,) = [r for r in logprobs if r.get_output("output_ids") is not None]
    assert result.as_numpy("output_log_probs").shape == (1, 1, 4), "generated tokens only, no prompt padding"


@pytest.mark.parametrize(
    ("model", "name", "value", "shown"),
    [
        ("tensorrt_llm", "runtime_top_p_decay", np.array([[0.5]], dtype=np.float32), "runtime_top_p_decay"),
        ("tensorrt_llm", "lookahead_window_size", np.array([[4]], dtype=np.int32), "lookahead_window_size"),
        ("tensorrt_llm", "return_generation_logits", np.array([[True]]), "return_generation_logits"),
        (
            "ensemble",
            "prompt_embedding_table",
            np.ones((1, 2, 8), dtype=np.float16),
            "prompt_embedding_table",
        ),
        ("ensemble", "prompt_table_extra_id", np.array([[1]], dtype=np.uint64), "prompt_table_extra_id"),
        (
            "tensorrt_llm_bls",
            "image_url_input",
            np.array([[b"http://x/y.png"]], dtype=object),
            "image_url_input",
        ),
        ("tensorrt_llm_bls", "return_context_logits", np.array([[True]]), "return_context_logits"),
    ],
)
def test_declared_but_unsupported_inputs_get_this_projects_error(
    triton_server: TritonServer, model: str, name: str, value: np.ndarray, shown: str
) -> None:
    """Declared as NVIDIA declares them, so Triton passes them on and the model names them in its error."""
    if model == "tensorrt_llm":
        inputs = engine_inputs([5, 6, 7], 4, False) + [tensor(name, value)]
    else:
        inputs = text_inputs([PROMPT], 4, False) + [tensor(name, value)]
    results = run_stream(triton_server, model, inputs, [])
    errors = [r for r in results if isinstance(r, InferenceServerException)]
    assert errors and f"'{shown}'" in errors[0].message(), results
    assert "unexpected inference input" not in errors[0].message()


def test_beam_search_only_inputs_are_accepted(triton_server: TritonServer) -> None:
    extra = {
        "early_stopping": np.array([[True]]),
        "beam_search_diversity_rate": np.array([[0.0]], dtype=np.float32),
        "runtime_top_p_min": np.array([[1e-6]], dtype=np.float32),
        "len_penalty": np.array([[1.0]], dtype=np.float32),
    }
    results = run_stream(triton_server, "tensorrt_llm", engine_inputs([5, 6, 7], 3, False, **extra), [])
    assert not [r for r in results if isinstance(r, InferenceServerException)], results


def test_engine_batch_of_two_answers_each_row_with_its_batch_index(
    triton_server: TritonServer, tiny_llama_dir: Path
) -> None:
    rows = [[5, 6, 7, 8], [9, 10, 0, 0]]
    inputs = {
        "input_ids": np.array(rows, dtype=np.int32),
        "input_lengths": np.array([[4], [2]], dtype=np.int32),
        "request_output_len": np.array([[3], [5]], dtype=np.int32),
        "streaming": np.array([[True], [True]]),
        "exclude_input_in_output": np.array([[True], [True]]),
    }
    results = run_stream(triton_server, "tensorrt_llm", [tensor(k, v) for k, v in inputs.items()], [])
    assert not [r for r in results if isinstance(r, InferenceServerException)], results
    counts = [0, 0]
    for result in results:
        if result.get_output("output_ids") is not None:
            counts[result.as_numpy("batch_index")[0][0]] += result.as_numpy("sequence_length")[0][0]
    assert counts == [3, 5]


def test_stop_without_a_request_id_is_refused(triton_server: TritonServer) -> None:
    """NVIDIA's backend refuses it; it must not cancel every request that has no id."""
    victim = queue.Queue()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), victim))
    try:
        client.async_stream_infer(
            "tensorrt_llm",
            engine_inputs([5, 6, 7], 200, True, min_tokens=np.array([[200]], dtype=np.int32)),
        )
        assert not isinstance(victim.get(timeout=TIMEOUT_S), InferenceServerException)
        stop = {
            "input_ids": np.empty([1, 1], dtype=np.int32),
            "input_lengths": np.zeros([1, 1], dtype=np.int32),
            "request_output_len": np.array([[0]], dtype=np.int32),
            "stop": np.array([[True]]),
        }
        replies = run_stream(triton_server, "tensorrt_llm", [tensor(k, v) for k, v in stop.items()], [])
        assert isinstance(replies[0], InferenceServerException) and "'stop'" in replies[0].message()
    finally:
        client.stop_stream()  # waits for the victim to finish: it was not cancelled
        client.close()
    tokens = 1
    while not victim.empty():
        result = victim.get_nowait()
        assert not isinstance(result, InferenceServerException), result
        if result.get_output("output_ids") is not None:
            tokens += result.as_numpy("sequence_length")[0][0]
    assert tokens == 200, "the request without an id ran to its end"
