"""The Triton Python models; each `model_repository/*/1/model.py` re-exports one class from here.

`triton_python_backend_utils` exists only inside Triton's Python stub, so it is imported in
`initialize`. The request logic lives in `tensors`, `text`, `bridge` and `metrics`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.serving import ServingEngine
from tritonllm.engine_format import engine_backend, engine_defaults
from tritonllm.triton import tensors
from tritonllm.triton.bridge import EngineBridge, Outputs
from tritonllm.triton.launcher import ENGINE_MODEL
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
# BLS inputs NVIDIA declares for multimodal and speculative decoding, which this engine has not.
BLS_UNSUPPORTED_INPUTS = (
    "image_input",
    "image_bytes_input",
    "image_url_input",
    "video_bytes_input",
    "num_draft_tokens",
)
# preprocessing inputs of the same kind (ensemble name in the error).
PREPROCESSING_UNSUPPORTED_INPUTS = {
    "IMAGE_BYTES": "image_bytes_input",
    "IMAGE_URL": "image_url_input",
    "VIDEO_BYTES": "video_bytes_input",
    "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id",
}
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


def _pb() -> ModuleType:
    import triton_python_backend_utils as pb_utils  # only inside Triton's Python stub

    return pb_utils


def _parameters(model_config: dict[str, Any]) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def _inputs(request: Any) -> dict[str, np.ndarray]:
    return {t.name(): t.as_numpy() for t in request.inputs()}


def _request_parameters(request: Any) -> dict[str, Any]:
    try:
        return json.loads(request.parameters() or "{}")
    except (ValueError, TypeError):
        return {}


# Request parameters this repository understands; `/generate` turns unknown JSON keys into parameters.
KNOWN_PARAMETERS = {
    "apply_chat_template",
    "Streaming",  # sent by NVIDIA's inflight_batcher_llm_client.py
    "sequence_id",
    "sequence_start",
    "sequence_end",
    "priority",
    "timeout",
}


def _checked_parameters(request: Any) -> dict[str, Any]:
    """The request parameters; unknown ones are an error naming them."""
    params = _request_parameters(request)
    for name in params:
        if name not in KNOWN_PARAMETERS and not name.startswith("triton_"):
            raise RequestError(name, "is not an input or parameter of this model")
    return params


def _wants_chat(params: dict[str, Any]) -> bool:
    value = params.get("apply_chat_template", False)
    return value is True or str(value).lower() in ("1", "true", "yes")


def _error(pb: ModuleType, message: str, code: str = "INVALID_ARG") -> Any:
    return pb.TritonError(message, getattr(pb.TritonError, code))


def _response(pb: ModuleType, outputs: Outputs) -> Any:
    return pb.InferenceResponse(output_tensors=[pb.Tensor(name, arr) for name, arr in outputs.items()])


def _error_code(message: str) -> str:
    if message.startswith("input "):
        return "INVALID_ARG"
    if message.startswith(("server busy", "engine is not running")):
        return "UNAVAILABLE"
    return "INTERNAL"


class SenderChannel:
    """A `ResponseChannel` over a decoupled request's response sender.

    Triton frees a request's response factory once its final response is sent, and `is_cancelled()`
    after that crashes the server (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled, Triton 2.51):
    a lock orders the two, and a closed channel reports not cancelled.
    """

    def __init__(self, pb: ModuleType, request: Any, decoupled: bool = True):
        self._pb = pb
        self._request = request
        self._sender = request.get_response_sender()
        self._final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._decoupled = decoupled
        self._lock = threading.Lock()
        self._closed = False

    def send(self, outputs: Outputs | None, error: str | None, final: bool) -> None:
        flags = self._final if final else 0
        if error is not None:
            response = self._pb.InferenceResponse(
                output_tensors=[], error=_error(self._pb, error, _error_code(error))
            )
        elif outputs is not None:
            response = _response(self._pb, outputs)
        elif not self._decoupled:  # a non-decoupled model answers with exactly one response
            response = self._pb.InferenceResponse(output_tensors=[])
        else:
            response = None
        with self._lock:
            if self._closed:
                return
            self._closed = final
            if response is None:
                self._sender.send(flags=flags)
            else:
                self._sender.send(response, flags=flags)

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self._closed and self._request.is_cancelled()


class PreprocessingModel:
    """QUERY text -> INPUT_ID tokens; stop/bad words -> NVIDIA word lists."""

    def initialize(self, args: dict[str, str]) -> None:
        self.pb = _pb()
        params = _parameters(json.loads(args["model_config"]))
        self.codec = TextCodec(params["tokenizer_dir"])

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._one(request) for request in requests]

    def _one(self, request: Any) -> Any:
        try:
            params = _checked_parameters(request)
            return _response(
                self.pb, self.preprocess(_inputs(request), _wants_chat(params), params.get("priority"))
            )
        except RequestError as exc:
            return self.pb.InferenceResponse(output_tensors=[], error=_error(self.pb, str(exc)))
        except Exception as exc:
            log.exception("preprocessing failed")
            return self.pb.InferenceResponse(
                output_tensors=[], error=_error(self.pb, f"preprocessing failed: {exc}", "INTERNAL")
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


class PostprocessingModel:
    """TOKENS_BATCH (+ the tokens before them) -> OUTPUT text."""

    def initialize(self, args: dict[str, str]) -> None:
        self.pb = _pb()
        params = _parameters(json.loads(args["model_config"]))
        self.codec = TextCodec(params["tokenizer_dir"], params.get("skip_special_tokens", "true") != "false")

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                responses.append(_response(self.pb, self.postprocess(_inputs(request))))
            except Exception as exc:
                log.exception("postprocessing failed")
                responses.append(
                    self.pb.InferenceResponse(
                        output_tensors=[], error=_error(self.pb, f"postprocessing failed: {exc}", "INTERNAL")
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


def engine_config(params: dict[str, str]) -> EngineConfig:
    """EngineConfig from the `tensorrt_llm` model's config.pbtxt parameters.

    `engine_dir` is a HF checkpoint or an engine directory from `build_engines/build.py`, whose limits
    (and quantization) fill the parameters left empty; the engine's own defaults fill the rest.
    """
    ints = (
        "tokens_per_block",
        "num_kv_blocks",
        "kv_cache_memory_bytes",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_waiting",
        "num_threads",
        "seed",
    )
    kwargs: dict[str, Any] = {"model": params["engine_dir"], **engine_defaults(params["engine_dir"])}
    for name in ints:
        if params.get(name, "").strip():
            kwargs[name] = int(params[name])
    for name in ("dtype", "device", "quantization"):
        if params.get(name, "").strip():
            kwargs[name] = params[name].strip()
    if params.get("enable_prefix_caching", "").strip():
        kwargs["enable_prefix_caching"] = params["enable_prefix_caching"].strip().lower() != "false"
    return EngineConfig(**kwargs)


def _decoupled(pb: ModuleType, config: dict[str, Any]) -> bool:
    return bool(pb.using_decoupled_model_transaction_policy(config))


class EngineModel:
    """The `tensorrt_llm` model over the project's engine: decoupled (streaming) or not."""

    def initialize(self, args: dict[str, str]) -> None:
        self.pb = _pb()
        config = json.loads(args["model_config"])
        self.decoupled = _decoupled(self.pb, config)
        params = _parameters(config)
        self.drain_timeout_s = float(params.get("drain_timeout_s") or 5.0)
        if params.get("disable_kernels", "").lower() == "true":  # the stub does not inherit the environment
            os.environ["TRITONLLM_DISABLE_KERNELS"] = "1"
        from tritonllm.triton.metrics import MetricsReporter

        engine_cfg = engine_config(params)
        if engine_backend(engine_cfg.model) == "tensorrt_llm":  # an engine dir built by TensorRT-LLM
            from tritonllm.engine.trtllm_executor import TrtllmEngine, settings_from_parameters

            engine = TrtllmEngine(engine_cfg.model, settings_from_parameters(engine_cfg.model, params))
        else:
            engine = ServingEngine(engine_cfg)
        self.metrics = MetricsReporter(self.pb, engine, labels={"model": args["model_name"]})
        self.bridge = EngineBridge(
            engine_cfg,
            on_finished=self.metrics.record_finished,
            on_rejected=self.metrics.record_rejected,
            engine=engine,
            decoupled=self.decoupled,
        )

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            try:
                channel = SenderChannel(self.pb, request, self.decoupled)
            except Exception:
                log.exception("no response sender")
                continue
            try:
                self.bridge.submit(request.request_id(), self.parse(request), channel)
            except RequestError as exc:
                channel.send(None, str(exc), final=True)
            except Exception as exc:
                log.exception("tensorrt_llm execute failed")
                channel.send(None, f"internal error: {exc}", final=True)
        return None

    def parse(self, request: Any) -> list[tensors.EngineRequest]:
        """One EngineRequest per batch row (a `stop` request is one row)."""
        inputs = _inputs(request)
        if tensors.is_stop(inputs):
            return [tensors.parse_engine_request(tensors.split_batch(inputs)[0])]
        priority = _request_parameters(request).get("priority")
        rows = [tensors.parse_engine_request(row, priority) for row in tensors.split_batch(inputs)]
        if not self.decoupled and any(r.streaming for r in rows):
            raise RequestError("streaming", "needs the decoupled model (tritonllm launch --decoupled true)")
        return rows

    def finalize(self) -> None:
        self.bridge.shutdown(self.drain_timeout_s)
        self.metrics.close()


class BLSModel:
    """`tensorrt_llm_bls`: the ensemble's contract in one Python model, with cancellation.

    Tokenizes and detokenizes in-process and calls `tensorrt_llm` (decoupled or not, as this model).
    When the client cancels, `tensorrt_llm` gets a `stop` request for the inner request id, which frees
    the engine's KV blocks before its next step (ensembles cannot do this in Triton 2.51). Cancellation
    is checked after each response (at most every CANCEL_CHECK_S) and swept at that interval for
    requests still waiting; a stop that may have overtaken its request is sent again when the request
    answers, so none is lost.
    """

    CANCEL_CHECK_S = 0.05

    def initialize(self, args: dict[str, str]) -> None:
        self.pb = _pb()
        config = json.loads(args["model_config"])
        self.decoupled = _decoupled(self.pb, config)
        params = _parameters(config)
        self.codec = TextCodec(params["tokenizer_dir"])
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
            params = _checked_parameters(request)
            engine_inputs = self.engine_inputs(_inputs(request), _wants_chat(params), params.get("priority"))
        except RequestError as exc:
            channel.send(None, str(exc), final=True)
            return
        except Exception as exc:
            log.exception("BLS preprocessing failed")
            channel.send(None, f"internal error: {exc}", final=True)
            return
        state = _BlsRequest(channel)
        with self._lock:
            self._inflight[inner_id] = state
        try:
            inner = self.pb.InferenceRequest(
                model_name=ENGINE_MODEL,
                request_id=inner_id,
                inputs=[self.pb.Tensor(name, arr) for name, arr in engine_inputs.items()],
                requested_output_names=[
                    "output_ids",
                    "sequence_length",
                    "output_context_ids",
                    *PASSTHROUGH_OUTPUTS,
                ],
            )
            responses = inner.exec(decoupled=True) if self.decoupled else [inner.exec()]
            for response in responses:
                if response.has_error():
                    channel.send(None, response.error().message(), final=True)
                    return
                outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
                if "output_ids" not in outputs:
                    continue  # the flag-only final response
                if state.stopped:  # the client has gone: make sure the stop reached the engine
                    self._stop_again(inner_id, state)
                    continue
                channel.send(self._text_response(outputs), None, final=not self.decoupled)
                self._check_cancelled(inner_id, state)
            if self.decoupled:
                channel.send(None, None, final=True)
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

    def _check_cancelled(self, inner_id: str, state: _BlsRequest) -> None:
        now = time.monotonic()
        if state.stopped or now - state.checked_at < self.CANCEL_CHECK_S:
            return
        state.checked_at = now
        try:
            if state.channel.is_cancelled():
                state.stopped = True
                self._send_stop(inner_id)
        except Exception:
            log.exception("cancelling %s failed", inner_id)

    def _stop_again(self, inner_id: str, state: _BlsRequest) -> None:
        """A response after the stop: the stop may have reached tensorrt_llm before the request did."""
        if state.stops_sent < 3:
            state.stops_sent += 1
            self._send_stop(inner_id)

    def _sweep(self) -> None:
        """Requests without a response lately (waiting in the engine, long prefills)."""
        while not self._closing.wait(2 * self.CANCEL_CHECK_S):
            with self._lock:
                items = list(self._inflight.items())
            for inner_id, state in items:
                if time.monotonic() - state.checked_at >= 2 * self.CANCEL_CHECK_S:
                    self._check_cancelled(inner_id, state)

    def _send_stop(self, inner_id: str) -> None:
        """Tell tensorrt_llm to cancel `inner_id` (NVIDIA's `stop` input)."""
        one = np.array([[1]], dtype=np.int32)
        stop = self.pb.InferenceRequest(
            model_name=ENGINE_MODEL,
            request_id=inner_id,
            inputs=[
                self.pb.Tensor("input_ids", one),
                self.pb.Tensor("input_lengths", one),
                self.pb.Tensor("request_output_len", one),
                self.pb.Tensor("stop", np.array([[True]], dtype=bool)),
            ],
            requested_output_names=[],
        )
        if self.decoupled:
            for _ in stop.exec(decoupled=True):
                pass
        else:
            stop.exec()


@dataclass
class _BlsRequest:
    """A BLS request in flight: its client channel and cancellation state."""

    channel: SenderChannel
    checked_at: float = 0.0
    stopped: bool = False
    stops_sent: int = 0
