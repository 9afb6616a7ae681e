"""Request tensors -> engine inputs, with errors that name the offending tensor.

Inputs arrive as `{name: numpy array}` with the batch dimension first (every model has
`max_batch_size > 0`), so a `[1]` tensor comes as shape `[1, 1]`. Names follow NVIDIA's TensorRT-LLM
backend (`tensorrt_llm` model); `ENSEMBLE_TO_ENGINE` maps the ensemble/BLS names onto them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tritonllm.engine.errors import InvalidRequestError
from tritonllm.engine.sampling_params import SamplingParams

Inputs = Mapping[str, np.ndarray]

# Ensemble / BLS input name -> tensorrt_llm input name (only where they differ or pass through).
ENSEMBLE_TO_ENGINE: dict[str, str] = {
    "max_tokens": "request_output_len",
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "length_penalty": "len_penalty",
    "stream": "streaming",
    "stop_words": "stop_words_list",
    "bad_words": "bad_words_list",
    "text_input": "input_ids",
}
ENGINE_TO_ENSEMBLE = {v: k for k, v in ENSEMBLE_TO_ENGINE.items()}

# tensorrt_llm inputs that exist upstream but this engine does not implement: sending one is an error.
UNSUPPORTED_ENGINE_INPUTS = (
    "embedding_bias",
    "lora_task_id",
    "lora_weights",
    "lora_config",
    "prompt_embedding_table",
    "prompt_table_extra_ids",
    "prompt_vocab_size",
    "draft_input_ids",
    "draft_logits",
    "encoder_input_features",
    "encoder_output_lengths",
    "decoder_input_ids",
    "cross_attention_mask",
    "skip_cross_attn_blocks",
    "mrope_rotary_cos_sin",
    "mrope_position_deltas",
    "context_phase_params",
    "retention_token_range_starts",
    "retention_token_range_ends",
    "retention_token_range_priorities",
    "retention_token_range_durations_ms",
    "retention_decode_priority",
    "retention_decode_duration_ms",
    "lookahead_window_size",
    "lookahead_ngram_size",
    "lookahead_verification_set_size",
)
# Inputs NVIDIA declares that change nothing for this engine (beam search, draft tokens, top-p decay
# and encoder-decoder settings without the feature they tune): accepted and ignored, as
# TensorRT-LLM ignores them with beam_width 1. `runtime_top_p_decay` itself must stay 1 (no decay).
IGNORED_ENGINE_INPUTS = (
    "pad_id",
    "len_penalty",
    "early_stopping",
    "beam_search_diversity_rate",
    "draft_acceptance_threshold",
    "decoder_input_lengths",
    "runtime_top_p_min",
    "runtime_top_p_reset_ids",
)

# SamplingParams / engine field -> the tensorrt_llm tensor that sets it (for error messages).
FIELD_TO_TENSOR = {
    "max_tokens": "request_output_len",
    "min_tokens": "min_tokens",
    "temperature": "temperature",
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "end_id": "end_id",
    "stop_token_ids": "stop_words_list",
    "bad_token_ids": "bad_words_list",
    "input_ids": "input_ids",
}


class RequestError(ValueError):
    """A request input is missing or invalid; `tensor` names it (as the client named it)."""

    def __init__(self, tensor: str, message: str):
        alias = ENGINE_TO_ENSEMBLE.get(tensor)
        shown = f"'{tensor}' (ensemble/BLS: '{alias}')" if alias else f"'{tensor}'"
        super().__init__(f"input {shown}: {message}")
        self.tensor = tensor
        self.message = message

    def for_ensemble(self) -> RequestError:
        """The same error named by the ensemble/BLS input (used by the BLS, which knows the caller)."""
        err = RequestError.__new__(RequestError)
        name = ENGINE_TO_ENSEMBLE.get(self.tensor, self.tensor)
        ValueError.__init__(err, f"input '{name}': {self.message}")
        err.tensor, err.message = name, self.message
        return err


def from_invalid(exc: InvalidRequestError) -> RequestError:
    """Turn an engine validation error (naming a SamplingParams field) into one naming the tensor."""
    tensor = FIELD_TO_TENSOR.get(exc.field, exc.field)
    prefix = f"{exc.field}: "
    message = str(exc)
    return RequestError(tensor, message[len(prefix) :] if message.startswith(prefix) else message)


def batch_size(inputs: Inputs) -> int:
    """The request's batch size: every batched tensor must have the same first dimension."""
    sizes = {name: arr.shape[0] for name, arr in inputs.items() if arr.ndim > 0}
    if not sizes:
        return 1
    size = max(sizes.values())
    for name, n in sizes.items():
        if n != size:
            raise RequestError(name, f"has batch size {n}, other inputs {size}")
    if size == 0:
        raise RequestError(next(iter(sizes)), "batch size is 0")
    return size


def split_batch(inputs: Inputs) -> list[dict[str, np.ndarray]]:
    """One `{name: array}` per batch row, each keeping a batch dimension of 1 (NVIDIA's batch_index)."""
    n = batch_size(inputs)
    if n == 1:
        return [dict(inputs)]
    return [{name: arr[i : i + 1] if arr.ndim > 0 else arr for name, arr in inputs.items()} for i in range(n)]


def row(inputs: Inputs, name: str) -> np.ndarray | None:
    """The request's row of a tensor (batch dimension removed), or None when absent."""
    arr = inputs.get(name)
    if arr is None:
        return None
    return arr[0] if arr.ndim > 0 else arr


def scalar(inputs: Inputs, name: str, kind: type, default=None):
    """A `[1]` tensor's value as `kind` (int, float, bool or str); `default` when absent."""
    value = row(inputs, name)
    if value is None:
        return default
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise RequestError(name, f"expected one value, got shape {list(np.asarray(value).shape)}")
    item = flat[0]
    try:
        if kind is str:
            return item.decode("utf-8") if isinstance(item, bytes) else str(item)
        if kind is bool:
            return bool(item)
        if kind is float:
            out = float(item)
            if not np.isfinite(out):
                raise RequestError(name, f"must be a finite number, got {out}")
            return out
        return int(item)
    except UnicodeDecodeError:
        raise RequestError(name, "is not valid UTF-8") from None


def strings(inputs: Inputs, name: str) -> list[str]:
    """A STRING[-1] tensor's values; empty strings dropped; [] when absent."""
    value = row(inputs, name)
    if value is None:
        return []
    out = []
    for item in np.asarray(value).reshape(-1):
        try:
            text = item.decode("utf-8") if isinstance(item, bytes) else str(item)
        except UnicodeDecodeError:
            raise RequestError(name, "is not valid UTF-8") from None
        if text:
            out.append(text)
    return out


def to_word_list(sequences: list[list[int]]) -> np.ndarray:
    """NVIDIA's word-list format `[1, 2, N]`: flattened ids (0-padded), then cumulative ends (-1-padded)."""
    flat = [t for seq in sequences for t in seq]
    ends = list(np.cumsum([len(seq) for seq in sequences])) if sequences else []
    width = max(1, len(flat))
    ids = flat + [0] * (width - len(flat))
    offsets = [int(e) for e in ends] + [-1] * (width - len(ends))
    return np.array([[ids, offsets]], dtype=np.int32)


def from_word_list(inputs: Inputs, name: str) -> list[list[int]]:
    """Token sequences from a `[2, N]` word list (see `to_word_list`); [] when absent."""
    value = row(inputs, name)
    if value is None:
        return []
    arr = np.asarray(value)
    if arr.ndim != 2 or arr.shape[0] != 2:
        raise RequestError(name, f"expected shape [2, N] (ids, offsets), got {list(arr.shape)}")
    ids, ends = arr[0].tolist(), arr[1].tolist()
    sequences, start = [], 0
    for end in ends:
        if end < 0:
            break
        if end <= start or end > len(ids):
            raise RequestError(name, f"offset {end} is out of order or beyond the {len(ids)} ids")
        sequences.append([int(t) for t in ids[start:end]])
        start = end
    return sequences


@dataclass
class EngineRequest:
    """A parsed `tensorrt_llm` request (one batch row)."""

    prompt_ids: list[int]
    params: SamplingParams
    streaming: bool
    exclude_input_in_output: bool
    return_log_probs: bool
    stop: bool = False
    priority: int = 0  # lower is served first (the engine's order)
    return_perf_metrics: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def request_priority(inputs: Inputs, parameter: object = None, name: str = "priority") -> int:
    """The request's priority: the `priority` input, else the `priority` request parameter, else 0.

    Lower values are served first, as in the engine (and unlike Triton's own 1-is-highest levels).
    """
    value = scalar(inputs, name, int)
    if value is not None:
        return value
    if parameter is None:
        return 0
    try:
        return int(parameter)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise RequestError(
            "priority", f"the request parameter must be an integer, got {parameter!r}"
        ) from None


def _reject_unsupported(inputs: Inputs) -> None:
    for name in UNSUPPORTED_ENGINE_INPUTS:
        value = row(inputs, name)
        if value is not None and np.asarray(value).size > 0:
            raise RequestError(name, "is not supported by this engine")
    decay = scalar(inputs, "runtime_top_p_decay", float, 1.0)
    if decay != 1.0:
        raise RequestError("runtime_top_p_decay", f"top-p decay is not supported (only 1.0), got {decay}")
    beam_width = scalar(inputs, "beam_width", int, 1)
    if beam_width != 1:
        raise RequestError(
            "beam_width", f"only 1 is supported (this engine does no beam search), got {beam_width}"
        )
    n = scalar(inputs, "num_return_sequences", int, 1)
    if n != 1:
        raise RequestError("num_return_sequences", f"only 1 is supported, got {n}")
    for name in ("return_context_logits", "return_generation_logits"):
        if scalar(inputs, name, bool, False):
            raise RequestError(name, "returning logits is not supported by this engine")


def is_stop(inputs: Inputs) -> bool:
    """NVIDIA's `stop` input: cancel the in-flight request with the same request id."""
    return bool(scalar(inputs, "stop", bool, False))


def parse_engine_request(inputs: Inputs, priority_parameter: object = None) -> EngineRequest:
    """Validate one batch row of a `tensorrt_llm` request and build its SamplingParams.

    Limits that depend on the model (prompt length, vocabulary) are checked at submit.
    """
    if batch_size(inputs) != 1:
        raise RequestError("input_ids", "parse one batch row at a time (split_batch)")
    if is_stop(inputs):
        return EngineRequest([], SamplingParams(max_tokens=1), False, True, False, stop=True)
    ids = row(inputs, "input_ids")
    if ids is None:
        raise RequestError("input_ids", "is required")
    prompt = [int(t) for t in np.asarray(ids).reshape(-1)]
    length = scalar(inputs, "input_lengths", int)
    if length is not None:
        if not 0 < length <= len(prompt):
            raise RequestError("input_lengths", f"must be in [1, {len(prompt)}], got {length}")
        prompt = prompt[:length]
    if not prompt:
        raise RequestError("input_ids", "the prompt is empty")
    max_tokens = scalar(inputs, "request_output_len", int)
    if max_tokens is None:
        raise RequestError("request_output_len", "is required")
    if max_tokens <= 0:
        raise RequestError("request_output_len", f"must be a positive integer, got {max_tokens}")
    _reject_unsupported(inputs)

    top_k = scalar(inputs, "runtime_top_k", int, 0)
    top_p = scalar(inputs, "runtime_top_p", float, 0.0)
    temperature = scalar(inputs, "temperature", float, 1.0)
    if top_k < 0:
        raise RequestError("runtime_top_k", f"must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 <= top_p <= 1.0:
        raise RequestError("runtime_top_p", f"must be in [0, 1] (0 disables it), got {top_p}")
    # TensorRT-LLM semantics: top_k == 0 and top_p == 0 (the defaults) mean greedy.
    if top_k == 0 and top_p == 0.0:
        top_k = 1
    min_tokens = scalar(inputs, "min_tokens", int)
    if min_tokens is None:
        min_tokens = scalar(inputs, "min_length", int, 0)
    seed = scalar(inputs, "seed", int)
    if seed is None:
        seed = scalar(inputs, "random_seed", int)
    end_id = scalar(inputs, "end_id", int, -1)
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "len_penalty"):
        scalar(inputs, name, float)  # finite check
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p if top_p > 0 else 1.0,
            repetition_penalty=scalar(inputs, "repetition_penalty", float, 1.0),
            presence_penalty=scalar(inputs, "presence_penalty", float, 0.0),
            frequency_penalty=scalar(inputs, "frequency_penalty", float, 0.0),
            seed=seed,
            end_id=end_id if end_id >= 0 else None,
            stop_token_ids=from_word_list(inputs, "stop_words_list"),
            bad_token_ids=from_word_list(inputs, "bad_words_list"),
            logprobs=scalar(inputs, "return_log_probs", bool, False),
            guided_decoding_guide_type=scalar(inputs, "guided_decoding_guide_type", str) or None,
            guided_decoding_guide=scalar(inputs, "guided_decoding_guide", str) or None,
        )
    except InvalidRequestError as exc:
        if exc.field == "min_tokens" and "min_tokens" not in inputs and "min_length" in inputs:
            raise RequestError("min_length", str(exc).split(": ", 1)[-1]) from None
        raise from_invalid(exc) from None
    return EngineRequest(
        prompt_ids=prompt,
        params=params,
        streaming=scalar(inputs, "streaming", bool, False),
        exclude_input_in_output=scalar(inputs, "exclude_input_in_output", bool, False),
        return_log_probs=params.logprobs,
        priority=request_priority(inputs, priority_parameter),
        return_perf_metrics=scalar(inputs, "return_perf_metrics", bool, False),
        return_num_input_tokens=scalar(inputs, "return_num_input_tokens", bool, False),
        return_num_output_tokens=scalar(inputs, "return_num_output_tokens", bool, False),
    )
