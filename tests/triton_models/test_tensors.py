"""Request parsing: tensors -> SamplingParams, errors naming the tensor, NVIDIA word lists."""

from __future__ import annotations

import numpy as np
import pytest

from tritonllm.triton.tensors import (
    RequestError,
    from_word_list,
    parse_engine_request,
    split_batch,
    to_word_list,
)


def engine_inputs(**extra) -> dict[str, np.ndarray]:
    """A minimal valid tensorrt_llm request (batch dimension included)."""
    base = {
        "input_ids": np.array([[5, 6, 7, 8]], dtype=np.int32),
        "input_lengths": np.array([[4]], dtype=np.int32),
        "request_output_len": np.array([[8]], dtype=np.int32),
    }
    for name, value in extra.items():
        base[name] = value if isinstance(value, np.ndarray) else np.array([[value]])
    return base


def test_minimal_request_is_greedy_like_tensorrt_llm() -> None:
    req = parse_engine_request(engine_inputs())
    assert req.prompt_ids == [5, 6, 7, 8]
    assert req.params.max_tokens == 8 and req.params.greedy
    assert not req.streaming and not req.exclude_input_in_output and not req.stop


def test_sampling_inputs_map_onto_sampling_params() -> None:
    req = parse_engine_request(
        engine_inputs(
            runtime_top_k=np.array([[40]], dtype=np.int32),
            runtime_top_p=np.array([[0.9]], dtype=np.float32),
            temperature=np.array([[0.7]], dtype=np.float32),
            min_length=np.array([[2]], dtype=np.int32),
            random_seed=np.array([[123]], dtype=np.uint64),
            streaming=np.array([[True]]),
            return_log_probs=np.array([[True]]),
            end_id=np.array([[2]], dtype=np.int32),
        )
    )
    p = req.params
    assert (p.top_k, round(p.top_p, 5), round(p.temperature, 5)) == (40, 0.9, 0.7)
    assert (p.min_tokens, p.seed, p.end_id, p.logprobs) == (2, 123, 2, True)
    assert req.streaming and not p.greedy


def test_input_lengths_truncates_padded_ids() -> None:
    req = parse_engine_request(engine_inputs(input_lengths=np.array([[2]], dtype=np.int32)))
    assert req.prompt_ids == [5, 6]


@pytest.mark.parametrize(
    ("extra", "tensor"),
    [
        ({"runtime_top_p": np.array([[1.5]], dtype=np.float32)}, "runtime_top_p"),
        ({"runtime_top_k": np.array([[-1]], dtype=np.int32)}, "runtime_top_k"),
        ({"temperature": np.array([[-0.5]], dtype=np.float32)}, "temperature"),
        ({"beam_width": np.array([[2]], dtype=np.int32)}, "beam_width"),
        ({"num_return_sequences": np.array([[3]], dtype=np.int32)}, "num_return_sequences"),
        ({"lora_task_id": np.array([[1]], dtype=np.uint64)}, "lora_task_id"),
        ({"return_context_logits": np.array([[True]])}, "return_context_logits"),
        ({"request_output_len": np.array([[0]], dtype=np.int32)}, "request_output_len"),
        ({"presence_penalty": np.array([[5.0]], dtype=np.float32)}, "presence_penalty"),
        ({"min_tokens": np.array([[99]], dtype=np.int32)}, "min_tokens"),
        ({"runtime_top_p_decay": np.array([[0.5]], dtype=np.float32)}, "runtime_top_p_decay"),
        ({"prompt_embedding_table": np.ones((1, 2, 4), dtype=np.float16)}, "prompt_embedding_table"),
        ({"lookahead_window_size": np.array([[4]], dtype=np.int32)}, "lookahead_window_size"),
        ({"input_lengths": np.array([[9]], dtype=np.int32)}, "input_lengths"),
        ({"guided_decoding_guide": np.array([[b"{}"]], dtype=object)}, "guided_decoding_guide_type"),
    ],
)
def test_bad_input_names_its_tensor(extra: dict, tensor: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_engine_request(engine_inputs(**extra))
    assert info.value.tensor == tensor and f"'{tensor}'" in str(info.value)


def test_errors_also_name_the_ensemble_input() -> None:
    with pytest.raises(RequestError) as info:
        parse_engine_request(engine_inputs(runtime_top_p=np.array([[2.0]], dtype=np.float32)))
    assert "'top_p'" in str(info.value)
    assert str(info.value.for_ensemble()).startswith("input 'top_p': must be in [0, 1]")


def test_a_batch_splits_into_rows_as_nvidia_batch_index() -> None:
    inputs = engine_inputs()
    inputs["input_ids"] = np.array([[1, 2, 0], [3, 4, 5]], dtype=np.int32)
    inputs["input_lengths"] = np.array([[2], [3]], dtype=np.int32)
    inputs["request_output_len"] = np.array([[4], [6]], dtype=np.int32)
    rows = [parse_engine_request(row) for row in split_batch(inputs)]
    assert [r.prompt_ids for r in rows] == [[1, 2], [3, 4, 5]]
    assert [r.params.max_tokens for r in rows] == [4, 6]


def test_batch_sizes_must_agree() -> None:
    inputs = engine_inputs()
    inputs["input_ids"] = np.array([[1, 2], [3, 4]], dtype=np.int32)
    with pytest.raises(RequestError, match="'input_lengths'.*batch size 1, other inputs 2"):
        split_batch(inputs)


def test_stop_request_needs_no_sampling() -> None:
    assert parse_engine_request(engine_inputs(stop=np.array([[True]]))).stop


@pytest.mark.parametrize("words", [[], [[7]], [[1, 2, 3], [4], [5, 6]]])
def test_word_list_round_trip(words: list[list[int]]) -> None:
    arr = to_word_list(words)
    assert arr.shape[:2] == (1, 2) and arr.dtype == np.int32
    assert from_word_list({"w": arr}, "w") == words


def test_stop_and_bad_words_reach_sampling_params() -> None:
    req = parse_engine_request(
        engine_inputs(stop_words_list=to_word_list([[9, 10], [11]]), bad_words_list=to_word_list([[3, 4]]))
    )
    assert req.params.stop_token_ids == [[9, 10], [11]]
    assert req.params.bad_token_ids == [[3, 4]]


def test_beam_search_only_inputs_are_accepted_and_ignored_with_beam_width_1() -> None:
    req = parse_engine_request(
        engine_inputs(
            early_stopping=np.array([[True]]),
            beam_search_diversity_rate=np.array([[0.3]], dtype=np.float32),
            runtime_top_p_decay=np.array([[1.0]], dtype=np.float32),
            runtime_top_p_min=np.array([[0.1]], dtype=np.float32),
            len_penalty=np.array([[1.2]], dtype=np.float32),
        )
    )
    assert req.params.greedy


def test_priority_from_input_then_parameter() -> None:
    assert parse_engine_request(engine_inputs()).priority == 0
    assert parse_engine_request(engine_inputs(), priority_parameter=3).priority == 3
    with_input = engine_inputs(priority=np.array([[-2]], dtype=np.int32))
    assert parse_engine_request(with_input, priority_parameter=3).priority == -2
    with pytest.raises(RequestError, match="'priority'"):
        parse_engine_request(engine_inputs(), priority_parameter="high")


def test_return_flags_for_optional_outputs() -> None:
    req = parse_engine_request(
        engine_inputs(
            return_num_input_tokens=np.array([[True]]),
            return_num_output_tokens=np.array([[True]]),
            return_perf_metrics=np.array([[True]]),
        )
    )
    assert req.return_num_input_tokens and req.return_num_output_tokens and req.return_perf_metrics
