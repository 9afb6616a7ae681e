"""The `tensorrt_llm_bls` model: the ensemble's contract in one Python model, with cancellation."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from tritonllm.triton import tensors
from tritonllm.triton.bridge import SWEEP_FACTOR, Outputs, cancel_check_interval
from tritonllm.triton.models.common import (
    SenderChannel,
    checked_parameters,
    is_decoupled,
    model_parameters,
    pb_utils,
    request_inputs,
    wants_chat,
)
from tritonllm.triton.models.engine_link import EngineCallError, EngineLink, EngineStream
from tritonllm.triton.models.preprocessing import PreprocessingModel
from tritonllm.triton.repository import ENGINE_MODEL
from tritonllm.triton.tensors import RequestError
from tritonllm.triton.text import TextCodec

log = logging.getLogger(__name__)

# tensorrt_llm outputs passed through unchanged by the BLS (each only when tensorrt_llm sends it).
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
# What the text needs; the passthrough outputs are asked for only when the BLS's caller asked for them.
TEXT_OUTPUTS = ["output_ids", "sequence_length", "output_context_ids"]
# Where `tensorrt_llm` is when config.pbtxt does not say (`tritonllm launch` fills it in).
DEFAULT_ENGINE_GRPC_URL = "127.0.0.1:8001"
# BLS inputs NVIDIA declares for multimodal and speculative decoding, which this engine has not.
BLS_UNSUPPORTED_INPUTS = (
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


class BLSModel:
    """`tensorrt_llm_bls`: the ensemble's contract in one Python model, with cancellation.

    Tokenizes and detokenizes in-process and streams token ids from `tensorrt_llm` (decoupled or not,
    as this model) over this server's own gRPC port (`engine_link`: the Python backend's BLS calls
    crash under streaming load in Triton 2.51). When the client cancels, the gRPC call is cancelled,
    which cancels the engine request and frees its KV blocks before the engine's next step (ensembles
    cannot do this in Triton 2.51). Cancellation is checked after each response (at most every
    CANCEL_CHECK_S, less often under many requests: the checks share a budget per second) and swept
    at twice that interval for requests still waiting.
    """

    CANCEL_CHECK_S = 0.05

    def initialize(self, args: dict[str, str]) -> None:
        self.pb = pb_utils()
        config = json.loads(args["model_config"])
        self.decoupled = is_decoupled(self.pb, config)
        params = model_parameters(config)
        self.codec = TextCodec(params["tokenizer_dir"])
        self.engine = EngineLink(params.get("engine_grpc_url") or DEFAULT_ENGINE_GRPC_URL, ENGINE_MODEL)
        self.pre = PreprocessingModel()
        self.pre.pb, self.pre.codec = self.pb, self.codec
        self._lock = threading.Lock()
        self._inflight: dict[str, _BlsRequest] = {}  # inner request id -> its state
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._sweep, name="bls-cancel", daemon=True)
        self._watcher.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), daemon=True).start()
        return None

    def finalize(self) -> None:
        self._closing.set()
        self._watcher.join(5.0)
        self.engine.close()

    def engine_inputs(
        self, inputs: tensors.Inputs, chat: bool, priority: object = None
    ) -> dict[str, np.ndarray]:
        """Ensemble-named inputs -> tensorrt_llm inputs, validated here so errors name the caller's tensor."""
        for name in BLS_UNSUPPORTED_INPUTS:
            value = tensors.row(inputs, name)
            if value is not None and np.asarray(value).size > 0 and np.asarray(value).any():
                raise RequestError(name, "is not supported by this engine")
        pre = self._preprocess(inputs, chat, priority)
        out = {
            tensors.ENSEMBLE_TO_ENGINE.get(name, name): arr
            for name, arr in inputs.items()
            if name not in TEXT_INPUTS and name not in BLS_UNSUPPORTED_INPUTS and name != "use_draft_logits"
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
        if not self.decoupled and any(r.streaming for r in rows):
            raise RequestError("stream", "needs the decoupled model (tritonllm launch --decoupled true)")
        return out

    def _preprocess(self, inputs: tensors.Inputs, chat: bool, priority: object) -> Outputs:
        names = {
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
        return self.pre.preprocess(
            {new: inputs[old] for old, new in names.items() if old in inputs}, chat, priority
        )

    def _serve(self, request: Any) -> None:
        channel = SenderChannel(self.pb, request, self.decoupled)
        inner_id = f"bls-{uuid.uuid4().hex}"
        try:
            params = checked_parameters(request)
            engine_inputs = self.engine_inputs(
                request_inputs(request), wants_chat(params), params.get("priority")
            )
        except RequestError as exc:
            channel.send(None, str(exc), final=True)
            return
        except Exception as exc:
            log.exception("BLS preprocessing failed")
            channel.send(None, f"internal error: {exc}", final=True)
            return
        try:
            wanted = TEXT_OUTPUTS + [n for n in PASSTHROUGH_OUTPUTS if n in channel.requested]
            stream = self.engine.open(inner_id, engine_inputs, wanted)
        except Exception as exc:
            log.exception("BLS could not start the engine request")
            channel.send(None, f"internal error: {exc}", final=True)
            return
        state = _BlsRequest(channel, stream)
        with self._lock:
            self._inflight[inner_id] = state
        try:
            for outputs in stream:
                if "output_ids" not in outputs:
                    continue  # the flag-only final response
                channel.send(self._text_response(outputs), None, final=not self.decoupled)
                self._check_cancelled(state)
            if stream.cancelled:
                channel.send(None, "request cancelled", final=True)
            elif self.decoupled:
                channel.send(None, None, final=True)
        except EngineCallError as exc:
            channel.send(None, str(exc), final=True)
        except Exception as exc:
            log.exception("BLS request failed")
            try:
                channel.send(None, f"internal error: {exc}", final=True)
            except Exception:
                log.exception("could not send the BLS error")
        finally:
            with self._lock:
                self._inflight.pop(inner_id, None)

    def _text_response(self, outputs: Outputs) -> Outputs:
        """tensorrt_llm's token ids -> `text_output` (1-D, one string per row, as NVIDIA's BLS)."""
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

    def _check_interval(self) -> float:
        return cancel_check_interval(self.CANCEL_CHECK_S, len(self._inflight))

    def _check_cancelled(self, state: _BlsRequest, intervals: int = 1) -> None:
        now = time.monotonic()
        if state.stream.cancelled or now - state.checked_at < intervals * self._check_interval():
            return
        state.checked_at = now
        try:
            if state.channel.is_cancelled():
                state.stream.cancel()
        except Exception:
            log.exception("cancelling a BLS request failed")

    def _sweep(self) -> None:
        """Requests without a response lately (waiting in the engine, long prefills)."""
        while not self._closing.wait(SWEEP_FACTOR * self.CANCEL_CHECK_S):
            with self._lock:
                states = list(self._inflight.values())
            for state in states:
                self._check_cancelled(state, intervals=SWEEP_FACTOR)


@dataclass
class _BlsRequest:
    """A BLS request in flight: its client channel and cancellation state."""

    channel: SenderChannel
    stream: EngineStream
    checked_at: float = 0.0
