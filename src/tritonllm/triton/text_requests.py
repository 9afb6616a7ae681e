"""Text requests on the token-id engine model: ensemble-named inputs in, `text_output` out.

What `tensorrt_llm_bls` does around its call to `tensorrt_llm`, as plain functions of numpy arrays, so
that a client holding the tokenizer (the OpenAI front door) can call `tensorrt_llm` itself and skip the
BLS's hop (a stub and a gRPC pass per streamed token) with exactly the BLS's tokenization, validation,
errors and detokenization.
"""

from __future__ import annotations

import numpy as np

from tritonllm.triton import tensors
from tritonllm.triton.bridge import Outputs
from tritonllm.triton.models.preprocessing import PreprocessingModel
from tritonllm.triton.tensors import RequestError
from tritonllm.triton.text import TextCodec

# tensorrt_llm outputs passed through unchanged (each only when tensorrt_llm sends it).
PASSTHROUGH_OUTPUTS = (
    "cum_log_probs",
    "output_log_probs",
    "batch_index",
    "sequence_index",
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
    "num_input_tokens",
    "num_output_tokens",
    "finish_reason",
)
# What the text needs from tensorrt_llm; ask for a passthrough output only when the caller wants it.
TEXT_OUTPUTS = ["output_ids", "sequence_length", "output_context_ids"]
# Ensemble/BLS inputs NVIDIA declares for multimodal and speculative decoding, which this engine has not.
UNSUPPORTED_TEXT_INPUTS = (
    "image_input",
    "image_bytes_input",
    "image_url_input",
    "video_bytes_input",
    "num_draft_tokens",
)
# Ensemble/BLS inputs handled by preprocessing rather than passed to tensorrt_llm.
TEXT_INPUTS = (
    "text_input",
    "decoder_text_input",
    "stop_words",
    "bad_words",
    "embedding_bias_words",
    "embedding_bias_weights",
    "prompt_table_extra_id",
)
# Ensemble input -> the preprocessing input it becomes.
PREPROCESSING_NAMES = {
    "text_input": "QUERY",
    "decoder_text_input": "DECODER_QUERY",
    "bad_words": "BAD_WORDS_DICT",
    "stop_words": "STOP_WORDS_DICT",
    "embedding_bias_words": "EMBEDDING_BIAS_WORDS",
    "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
    "max_tokens": "REQUEST_OUTPUT_LEN",
    "priority": "PRIORITY",
    "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID",
}


class TextRequests:
    """One tokenizer's text requests: `engine_inputs` before tensorrt_llm, `text_outputs` after."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self._pre = PreprocessingModel()
        self._pre.codec = codec

    def engine_inputs(
        self, inputs: tensors.Inputs, chat: bool = False, priority: object = None, decoupled: bool = True
    ) -> dict[str, np.ndarray]:
        """Ensemble-named inputs -> tensorrt_llm inputs, validated here so errors name the caller's tensor."""
        for name in UNSUPPORTED_TEXT_INPUTS:
            value = tensors.row(inputs, name)
            if value is not None and np.asarray(value).size > 0 and np.asarray(value).any():
                raise RequestError(name, "is not supported by this engine")
        pre = self._pre.preprocess(
            {new: inputs[old] for old, new in PREPROCESSING_NAMES.items() if old in inputs}, chat, priority
        )
        out = {
            tensors.ENSEMBLE_TO_ENGINE.get(name, name): arr
            for name, arr in inputs.items()
            if name not in TEXT_INPUTS and name not in UNSUPPORTED_TEXT_INPUTS and name != "use_draft_logits"
        }
        out["input_ids"] = pre["INPUT_ID"]
        out["input_lengths"] = pre["REQUEST_INPUT_LEN"]
        out["stop_words_list"] = pre["STOP_WORDS_IDS"]
        out["bad_words_list"] = pre["BAD_WORDS_IDS"]
        out["priority"] = pre["OUT_PRIORITY"]
        try:
            rows = [tensors.parse_engine_request(row) for row in tensors.split_batch(out)]
        except RequestError as exc:
            raise exc.for_ensemble() from None
        if not decoupled and any(r.streaming for r in rows):
            raise RequestError("stream", "needs the decoupled model (tritonllm launch --decoupled true)")
        return out

    def text_outputs(self, outputs: Outputs) -> Outputs:
        """tensorrt_llm's token ids -> `text_output` (1-D, one string per row, as NVIDIA's BLS) and the
        passthrough outputs."""
        ids, lengths, context = (
            outputs["output_ids"],
            outputs["sequence_length"],
            outputs["output_context_ids"],
        )
        texts = []
        for b in range(ids.shape[0]):
            n = int(lengths[b].reshape(-1)[0])
            ctx = [int(t) for t in context[b] if t >= 0]
            texts.append(self.codec.delta(ctx, ids[b].reshape(-1)[:n].tolist()).encode("utf-8"))
        result = {"text_output": np.array(texts, dtype=object)}
        return result | {name: outputs[name] for name in PASSTHROUGH_OUTPUTS if name in outputs}
