"""The Triton Python models; each `model_repository/*/1/model.py` re-exports one class from here.

`triton_python_backend_utils` exists only inside Triton's Python stub, so it is imported in
`initialize`. The request logic lives in `tensors`, `text`, `bridge` and `metrics`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from types import ModuleType
from typing import Any

import numpy as np

from tritonllm.build.engine_dir import engine_backend, engine_defaults
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.serving import ServingEngine
from tritonllm.triton import tensors
from tritonllm.triton.bridge import EngineBridge, Outputs
from tritonllm.triton.launcher import ENGINE_MODEL
from tritonllm.triton.tensors import RequestError
from tritonllm.triton.text import TextCodec

log = logging.getLogger(__name__)

# tensorrt_llm outputs passed through unchanged by the BLS.
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
    "finish_reason",
)
# Ensemble/BLS inputs handled by preprocessing rather than passed to tensorrt_llm.
TEXT_INPUTS = (
    "text_input",
    "decoder_text_input",
    "stop_words",
    "bad_words",
    "embedding_bias_words",
    "embedding_bias_weights",
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
    "sequence_id",
    "sequence_start",
    "sequence_end",
    "priority",
    "timeout",
}


def _wants_chat(request: Any) -> bool:
    """Whether the request asks for the chat template; unknown parameters are an error naming them."""
    params = _request_parameters(request)
    for name in params:
        if name not in KNOWN_PARAMETERS and not name.startswith("triton_"):
            raise RequestError(name, "is not an input or parameter of this model")
    value = params.get("apply_chat_template", False)
    return value is True or str(value).lower() in ("1", "true", "yes")


def _error(pb: ModuleType, message: str, code: str = "INVALID_ARG") -> Any:
    return pb.TritonError(message, getattr(pb.TritonError, code))


def _response(pb: ModuleType, outputs: Outputs) -> Any:
    return pb.InferenceResponse(output_tensors=[pb.Tensor(name, arr) for name, arr in outputs.items()])


def _error_code(message: str) -> str:
    if message.startswith("input "):
        return "INVALID_ARG"
    if message.startswith("server busy"):
        return "UNAVAILABLE"
    return "INTERNAL"


class SenderChannel:
    """A `ResponseChannel` over a decoupled request's response sender.

    Triton frees a request's response factory once its final response is sent, and `is_cancelled()`
    after that crashes the server (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled, Triton 2.51):
    a lock orders the two, and a closed channel reports not cancelled.
    """

    def __init__(self, pb: ModuleType, request: Any):
        self._pb = pb
        self._request = request
        self._sender = request.get_response_sender()
        self._final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
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
            chat = _wants_chat(request)
            return _response(self.pb, self.preprocess(_inputs(request), chat))
        except RequestError as exc:
            return self.pb.InferenceResponse(output_tensors=[], error=_error(self.pb, str(exc)))
        except Exception as exc:
            log.exception("preprocessing failed")
            return self.pb.InferenceResponse(
                output_tensors=[], error=_error(self.pb, f"preprocessing failed: {exc}", "INTERNAL")
            )

    def preprocess(self, inputs: tensors.Inputs, chat: bool = False) -> Outputs:
        tensors.batch_size(inputs)
        text = tensors.scalar(inputs, "QUERY", str)
        if not text:
            raise RequestError("text_input", "is missing or empty")
        if tensors.scalar(inputs, "DECODER_QUERY", str):
            raise RequestError("decoder_text_input", "encoder-decoder models are not supported")
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
        tokens = inputs["TOKENS_BATCH"]  # [batch, beam, n]
        lengths = inputs.get("SEQUENCE_LENGTH")
        context = inputs.get("CONTEXT_IDS")
        texts = []
        for b in range(tokens.shape[0]):
            ctx = [int(t) for t in context[b]] if context is not None else []
            row = []
            for beam in range(tokens.shape[1]):
                n = int(lengths[b][beam]) if lengths is not None else tokens.shape[2]
                row.append(self.codec.delta(ctx, [int(t) for t in tokens[b][beam][:n]]).encode("utf-8"))
            texts.append(row)
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


class EngineModel:
    """The decoupled `tensorrt_llm` model over the project's engine."""

    def initialize(self, args: dict[str, str]) -> None:
        self.pb = _pb()
        config = json.loads(args["model_config"])
        if not self.pb.using_decoupled_model_transaction_policy(config):
            raise self.pb.TritonModelException("tensorrt_llm must be decoupled (model_transaction_policy)")
        params = _parameters(config)
        self.drain_timeout_s = float(params.get("drain_timeout_s") or 5.0)
        if params.get("disable_kernels", "").lower() == "true":  # the stub does not inherit the environment
            os.environ["TRITONLLM_DISABLE_KERNELS"] = "1"
        from tritonllm.triton.metrics import MetricsReporter

        config = engine_config(params)
        if engine_backend(config.model) == "tensorrt_llm":  # an engine dir built by TensorRT-LLM
            from tritonllm.build.trtllm_executor import TrtllmEngine, settings_from_parameters

            engine = TrtllmEngine(config.model, settings_from_parameters(config.model, params))
        else:
            engine = ServingEngine(config)
        self.metrics = MetricsReporter(self.pb, engine, labels={"model": args["model_name"]})
        self.bridge = EngineBridge(
            config,
            on_finished=self.metrics.record_finished,
            on_rejected=self.metrics.record_rejected,
            engine=engine,
        )

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            try:
                channel = SenderChannel(self.pb, request)
            except Exception:
                log.exception("no response sender")
                continue
            try:
                parsed = tensors.parse_engine_request(_inputs(request))
                self.bridge.submit(request.request_id(), parsed, channel)
            except RequestError as exc:
                channel.send(None, str(exc), final=True)
            except Exception as exc:
                log.exception("tensorrt_llm execute failed")
                channel.send(None, f"internal error: {exc}", final=True)
        return None

    def finalize(self) -> None:
        self.bridge.shutdown(self.drain_timeout_s)
        self.metrics.close()


class BLSModel:
    """`tensorrt_llm_bls`: the ensemble's contract in one decoupled model, with cancellation.

    Tokenizes and detokenizes in-process and calls `tensorrt_llm` with `exec(decoupled=True)`. When
    the client cancels, a watcher sends `tensorrt_llm` a `stop` request for the inner request id,
    which frees the engine's KV blocks before its next step (ensembles cannot do this in Triton 2.51).
    """

    def initialize(self, args: dict[str, str]) -> None:
        self.pb = _pb()
        params = _parameters(json.loads(args["model_config"]))
        self.codec = TextCodec(params["tokenizer_dir"])
        self.pre = PreprocessingModel()
        self.pre.pb, self.pre.codec = self.pb, self.codec
        self._lock = threading.Lock()
        self._inflight: dict[str, SenderChannel] = {}  # inner request id -> the client's channel
        self._stopped: set[str] = set()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="bls-cancel", daemon=True)
        self._watcher.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), daemon=True).start()
        return None

    def finalize(self) -> None:
        self._closing.set()
        self._watcher.join(5.0)

    def engine_inputs(self, inputs: tensors.Inputs, chat: bool) -> dict[str, np.ndarray]:
        """Ensemble-named inputs -> tensorrt_llm inputs, validated here so errors name the caller's tensor."""
        pre = self._preprocess(inputs, chat)
        out = {
            tensors.ENSEMBLE_TO_ENGINE.get(name, name): arr
            for name, arr in inputs.items()
            if name not in TEXT_INPUTS
        }
        out["input_ids"] = pre["INPUT_ID"]
        out["input_lengths"] = pre["REQUEST_INPUT_LEN"]
        out["stop_words_list"] = pre["STOP_WORDS_IDS"]
        out["bad_words_list"] = pre["BAD_WORDS_IDS"]
        try:
            tensors.parse_engine_request(out)
        except RequestError as exc:
            raise exc.for_ensemble() from None
        return out

    def _preprocess(self, inputs: tensors.Inputs, chat: bool) -> Outputs:
        names = {
            "text_input": "QUERY",
            "decoder_text_input": "DECODER_QUERY",
            "bad_words": "BAD_WORDS_DICT",
            "stop_words": "STOP_WORDS_DICT",
            "embedding_bias_words": "EMBEDDING_BIAS_WORDS",
            "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
            "max_tokens": "REQUEST_OUTPUT_LEN",
        }
        return self.pre.preprocess({new: inputs[old] for old, new in names.items() if old in inputs}, chat)

    def _serve(self, request: Any) -> None:
        channel = SenderChannel(self.pb, request)
        inner_id = f"bls-{uuid.uuid4().hex}"
        try:
            inputs = _inputs(request)
            engine_inputs = self.engine_inputs(inputs, _wants_chat(request))
        except RequestError as exc:
            channel.send(None, str(exc), final=True)
            return
        except Exception as exc:
            log.exception("BLS preprocessing failed")
            channel.send(None, f"internal error: {exc}", final=True)
            return
        with self._lock:
            self._inflight[inner_id] = channel
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
            for response in inner.exec(decoupled=True):
                if response.has_error():
                    channel.send(None, response.error().message(), final=True)
                    return
                outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
                if "output_ids" not in outputs:
                    continue  # the flag-only final response
                n = int(outputs["sequence_length"].reshape(-1)[0])
                ids = outputs["output_ids"].reshape(-1)[:n].tolist()
                ctx = outputs["output_context_ids"].reshape(-1).tolist()
                text = self.codec.delta(ctx, ids)
                result = {"text_output": np.array([[text.encode("utf-8")]], dtype=object)}
                result |= {name: outputs[name] for name in PASSTHROUGH_OUTPUTS if name in outputs}
                if inner_id not in self._stopped:  # the client has gone: just wait for the abort
                    channel.send(result, None, final=False)
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
                self._stopped.discard(inner_id)

    def _watch(self) -> None:
        while not self._closing.wait(0.005):
            with self._lock:
                items = [(k, c) for k, c in self._inflight.items() if k not in self._stopped]
            for inner_id, channel in items:
                try:
                    if channel.is_cancelled():
                        with self._lock:
                            self._stopped.add(inner_id)
                        self._send_stop(inner_id)
                except Exception:
                    log.exception("cancelling %s failed", inner_id)

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
        for _ in stop.exec(decoupled=True):
            pass
