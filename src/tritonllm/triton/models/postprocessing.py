"""The `postprocessing` model: token ids -> text."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from tritonllm.triton import tensors
from tritonllm.triton.bridge import Outputs
from tritonllm.triton.models.common import (
    model_parameters,
    pb_utils,
    request_inputs,
    triton_error,
    triton_response,
)
from tritonllm.triton.text import TextCodec

log = logging.getLogger(__name__)


class PostprocessingModel:
    """TOKENS_BATCH (+ the tokens before them) -> OUTPUT text."""

    def initialize(self, args: dict[str, str]) -> None:
        self.pb = pb_utils()
        params = model_parameters(json.loads(args["model_config"]))
        self.codec = TextCodec(params["tokenizer_dir"], params.get("skip_special_tokens", "true") != "false")

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                responses.append(triton_response(self.pb, self.postprocess(request_inputs(request))))
            except Exception as exc:
                log.exception("postprocessing failed")
                responses.append(
                    self.pb.InferenceResponse(
                        output_tensors=[],
                        error=triton_error(self.pb, f"postprocessing failed: {exc}", "INTERNAL"),
                    )
                )
        return responses

    def postprocess(self, inputs: tensors.Inputs) -> Outputs:
        """OUTPUT is 1-D, one string per batch row and beam, as NVIDIA's postprocessing returns it."""
        tokens = inputs["TOKENS_BATCH"]  # [batch, beam, n]
        lengths = inputs.get("SEQUENCE_LENGTH")
        context = inputs.get("CONTEXT_IDS")
        texts = []
        for b in range(tokens.shape[0]):
            ctx = [int(t) for t in context[b] if t >= 0] if context is not None else []
            for beam in range(tokens.shape[1]):
                n = int(lengths[b][beam]) if lengths is not None else tokens.shape[2]
                texts.append(self.codec.delta(ctx, [int(t) for t in tokens[b][beam][:n]]).encode("utf-8"))
        return {"OUTPUT": np.array(texts, dtype=object)}
