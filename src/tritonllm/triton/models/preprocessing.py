"""The `preprocessing` model: text -> token ids, stop/bad words -> NVIDIA word lists."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from tritonllm.triton import tensors
from tritonllm.triton.bridge import Outputs
from tritonllm.triton.models.common import (
    checked_parameters,
    model_parameters,
    pb_utils,
    request_inputs,
    triton_error,
    triton_response,
    wants_chat,
)
from tritonllm.triton.tensors import RequestError
from tritonllm.triton.text import TextCodec

log = logging.getLogger(__name__)

# Inputs NVIDIA declares for multimodal models, which this engine has not (ensemble names in errors).
PREPROCESSING_UNSUPPORTED_INPUTS = {
    "IMAGE_BYTES": "image_bytes_input",
    "IMAGE_URL": "image_url_input",
    "VIDEO_BYTES": "video_bytes_input",
    "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id",
}


class PreprocessingModel:
    """QUERY text -> INPUT_ID tokens; stop/bad words -> NVIDIA word lists."""

    def initialize(self, args: dict[str, str]) -> None:
        self.pb = pb_utils()
        params = model_parameters(json.loads(args["model_config"]))
        self.codec = TextCodec(params["tokenizer_dir"])

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._one(request) for request in requests]

    def _one(self, request: Any) -> Any:
        try:
            params = checked_parameters(request)
            return triton_response(
                self.pb, self.preprocess(request_inputs(request), wants_chat(params), params.get("priority"))
            )
        except RequestError as exc:
            return self.pb.InferenceResponse(output_tensors=[], error=triton_error(self.pb, str(exc)))
        except Exception as exc:
            log.exception("preprocessing failed")
            return self.pb.InferenceResponse(
                output_tensors=[], error=triton_error(self.pb, f"preprocessing failed: {exc}", "INTERNAL")
            )

    def preprocess(self, inputs: tensors.Inputs, chat: bool = False, priority: object = None) -> Outputs:
        """Every batch row tokenized; ids padded to the longest row (REQUEST_INPUT_LEN says how many)."""
        rows = [self._preprocess_row(row, chat, priority) for row in tensors.split_batch(inputs)]
        out: Outputs = {}
        for name in rows[0]:
            arrays = [r[name] for r in rows]
            width = max(a.shape[-1] for a in arrays)
            fill = -1 if name.endswith("WORDS_IDS") else 0
            out[name] = np.concatenate(
                [
                    np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])], constant_values=fill)
                    for a in arrays
                ]
            )
        for name in ("BAD_WORDS_IDS", "STOP_WORDS_IDS"):  # ids are padded with 0, offsets with -1
            out[name][:, 0, :][out[name][:, 0, :] < 0] = 0
        return out

    def _preprocess_row(self, inputs: tensors.Inputs, chat: bool, priority: object) -> Outputs:
        text = tensors.scalar(inputs, "QUERY", str)
        if not text:
            raise RequestError("text_input", "is missing or empty")
        if tensors.scalar(inputs, "DECODER_QUERY", str):
            raise RequestError("decoder_text_input", "encoder-decoder models are not supported")
        for name, shown in PREPROCESSING_UNSUPPORTED_INPUTS.items():
            value = tensors.row(inputs, name)
            if value is not None and np.asarray(value).size > 0:
                raise RequestError(shown, "is not supported by this engine")
        if tensors.strings(inputs, "EMBEDDING_BIAS_WORDS"):
            raise RequestError("embedding_bias_words", "embedding bias is not supported by this engine")
        weights = tensors.row(inputs, "EMBEDDING_BIAS_WEIGHTS")
        if weights is not None and np.asarray(weights).size > 0:
            raise RequestError("embedding_bias_weights", "embedding bias is not supported by this engine")
        try:
            ids = self.codec.encode(text, chat=chat)
        except ValueError as exc:
            raise RequestError("text_input", str(exc)) from None
        output_len = tensors.scalar(inputs, "REQUEST_OUTPUT_LEN", int)
        if output_len is None:
            raise RequestError("max_tokens", "is required")
        return {
            "INPUT_ID": np.array([ids], dtype=np.int32),
            "REQUEST_INPUT_LEN": np.array([[len(ids)]], dtype=np.int32),
            "BAD_WORDS_IDS": tensors.to_word_list(
                self.codec.encode_words(tensors.strings(inputs, "BAD_WORDS_DICT"))
            ),
            "STOP_WORDS_IDS": tensors.to_word_list(
                self.codec.encode_words(tensors.strings(inputs, "STOP_WORDS_DICT"))
            ),
            "EMBEDDING_BIAS": np.zeros((1, 0), dtype=np.float32),
            "REQUEST_OUTPUT_LEN": np.array([[output_len]], dtype=np.int32),
            "OUT_END_ID": np.array([[tensors.scalar(inputs, "END_ID", int, -1)]], dtype=np.int32),
            "OUT_PAD_ID": np.array([[tensors.scalar(inputs, "PAD_ID", int, -1)]], dtype=np.int32),
            # The ensemble's `priority` input or the request's `priority` parameter, for tensorrt_llm.
            "OUT_PRIORITY": np.array(
                [[tensors.request_priority(inputs, priority, "PRIORITY")]], dtype=np.int32
            ),
        }
