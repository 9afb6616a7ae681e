"""The front door's Triton client: one gRPC stream per generation into `tensorrt_llm_bls`, or straight
into the token-id model `tensorrt_llm` (`--triton-model tensorrt_llm`).

Straight into `tensorrt_llm`, the front door does the BLS's work itself with the same code
(`tritonllm.triton.text_requests`: tokenization, stop words, validation, incremental detokenization),
which saves the BLS's stub and one more pass through Triton for every streamed token.

Tensors are built and responses read with the `tritonllm-client` package's helpers, so the front door
reads token counts, log-probabilities and finish reasons exactly as that client does. Leaving the
iteration early (client gone, stop string, timeout) cancels the gRPC stream; the BLS then cancels the
engine request, which frees its KV blocks within one step.

The request and the responses are built and read straight from Triton's protobuf messages
(`build_request`, `read_piece`), byte for byte what `tritonclient` would send and read but without its
numpy tensors and per-output conversions: that work ran once per token on the front door's event loop.
Responses in another layout (typed `contents` instead of raw bytes) go through `tritonclient`'s reader.

The engine priority of the caller's tier goes in the `priority` input (lower is served first) where
the model declares it. Triton's errors become the caller's status: the engine's busy error 429, Triton
unreachable or a model's Python stub failing its health check 503 (both with Retry-After), bad input
400 (Triton names the tensor; the message says which), a missing model 503.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import (
    MAX_GRPC_MESSAGE_SIZE,
    InferResult,
    KeepAliveOptions,
    service_pb2,
    service_pb2_grpc,
)
from tritonclient.utils import InferenceServerException
from tritonllm_client.errors import (
    ClientError,
    InvalidRequestError,
    ModelNotFoundError,
    ServerBusyError,
    ServerUnavailableError,
    classify,
)
from tritonllm_client.results import Piece, piece_from_outputs
from tritonllm_client.transport import UINT64_INPUTS

from tritonllm.openai.errors import APIError
from tritonllm.triton.models.engine_link import infer_request, response_outputs
from tritonllm.triton.tensors import RequestError
from tritonllm.triton.text import TextCodec
from tritonllm.triton.text_requests import TEXT_OUTPUTS, TextRequests

# The outputs a Piece is built from (tritonllm_client.results.piece_from_outputs).
READ_OUTPUTS = ("text_output", "num_output_tokens", "output_log_probs", "cum_log_probs", "finish_reason")
# Triton tensor -> the OpenAI parameter that sets it (for 400s raised by the server).
TENSOR_TO_PARAM = {
    "text_input": "prompt",
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "seed",
    "stop_words": "stop",
    "min_tokens": "min_tokens",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "guided_decoding_guide_type": "response_format",
    "guided_decoding_guide": "response_format",
}


def api_error(exc: ClientError, retry_after_s: float) -> APIError:
    """The status and body a caller gets for a Triton error."""
    message = str(exc)
    if isinstance(exc, ServerBusyError):
        return APIError(
            429,
            f"the engine is busy, retry later ({message})",
            type="rate_limit_error",
            code="engine_busy",
            retry_after_s=retry_after_s,
            reason="engine_busy",
        )
    if isinstance(exc, ServerUnavailableError | ModelNotFoundError):
        return APIError(
            503,
            f"the inference server is unavailable: {message}",
            type="server_error",
            code="backend_unavailable",
            retry_after_s=retry_after_s,
            reason="backend_unavailable",
        )
    if isinstance(exc, InvalidRequestError):
        param = next((p for t, p in TENSOR_TO_PARAM.items() if f"'{t}'" in message), None)
        return APIError(400, message, param=param, code="invalid_value", reason="invalid_request")
    return APIError(
        500,
        f"generation failed: {message}",
        type="server_error",
        code="internal_error",
        reason="internal_error",
    )


_InputTensor = service_pb2.ModelInferRequest.InferInputTensor
_OutputTensor = service_pb2.ModelInferRequest.InferRequestedOutputTensor
_INT32 = struct.Struct("<i")
_UINT64 = struct.Struct("<Q")
_FP32 = struct.Struct("<f")
_COUNT_TYPES = {"UINT32": (4, False), "INT32": (4, True), "UINT64": (8, False), "INT64": (8, True)}


def _bytes_element(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(4, "little") + data


def input_tensor(name: str, value: Any) -> tuple[Any, bytes]:
    """One request value as Triton's `[1, 1]` (`[1, N]` for a list of strings) tensor and its raw bytes:
    the types of `tritonllm_client.transport.grpc_tensor` (the contract of this repository's models)."""
    if isinstance(value, list):
        return _InputTensor(name=name, datatype="BYTES", shape=[1, len(value)]), b"".join(
            _bytes_element(v) for v in value
        )
    if isinstance(value, str):
        return _InputTensor(name=name, datatype="BYTES", shape=[1, 1]), _bytes_element(value)
    if isinstance(value, bool):
        return _InputTensor(name=name, datatype="BOOL", shape=[1, 1]), b"\x01" if value else b"\x00"
    if isinstance(value, int):
        if name in UINT64_INPUTS:
            return _InputTensor(name=name, datatype="UINT64", shape=[1, 1]), _UINT64.pack(value)
        return _InputTensor(name=name, datatype="INT32", shape=[1, 1]), _INT32.pack(value)
    return _InputTensor(name=name, datatype="FP32", shape=[1, 1]), _FP32.pack(value)


def input_array(name: str, value: Any) -> np.ndarray:
    """One request value as the `[1, 1]` (`[1, N]` for a list of strings) array `input_tensor` sends."""
    if isinstance(value, list):
        return np.array([[v.encode() for v in value]], dtype=object)
    if isinstance(value, str):
        return np.array([[value.encode()]], dtype=object)
    if isinstance(value, bool):
        return np.array([[value]], dtype=bool)
    if isinstance(value, int):
        return np.array([[value]], dtype=np.uint64 if name in UINT64_INPUTS else np.int32)
    return np.array([[value]], dtype=np.float32)


def build_request(model: str, inputs: dict[str, Any], outputs: list[str], request_id: str) -> Any:
    """The `ModelInferRequest` that `tritonclient` builds from `grpc_tensor` inputs (tested equal)."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, value in inputs.items():
        tensor, raw = input_tensor(name, value)
        request.inputs.append(tensor)
        request.raw_input_contents.append(raw)
    request.outputs.extend(_OutputTensor(name=n) for n in outputs)
    return request


def _first_bytes(raw: bytes) -> str:
    """The first element of a raw BYTES tensor as text ("" for an empty tensor)."""
    if len(raw) < 4:
        return ""
    size = int.from_bytes(raw[:4], "little")
    return raw[4 : 4 + size].decode("utf-8", errors="replace")


def read_piece(response: Any) -> Piece:
    """A `ModelInferResponse` -> the Piece `piece_from_outputs` makes of it (tested equal)."""
    raw = response.raw_output_contents
    if len(raw) != len(response.outputs):  # typed contents: tritonclient's reader
        result = InferResult(response)
        return piece_from_outputs({o.name: result.as_numpy(o.name) for o in response.outputs})
    text, reason, count, log_probs, cum = "", "", None, None, None
    for output, data in zip(response.outputs, raw, strict=True):
        name, datatype = output.name, output.datatype
        if name == "text_output" and datatype == "BYTES":
            text = _first_bytes(data)
        elif name == "finish_reason" and datatype == "BYTES":
            reason = _first_bytes(data)
        elif name == "num_output_tokens" and datatype in _COUNT_TYPES and data:
            size, signed = _COUNT_TYPES[datatype]  # int.from_bytes: a sixth of np.frombuffer's time
            count = int.from_bytes(data[:size], "little", signed=signed)
        elif name == "output_log_probs" and datatype == "FP32":
            log_probs = np.frombuffer(data, dtype="<f4").astype(float).tolist()
        elif name == "cum_log_probs" and datatype == "FP32":
            cum = float(np.frombuffer(data, dtype="<f4")[0]) if data else None
        elif name in READ_OUTPUTS:  # an unexpected type: the general reader
            result = InferResult(response)
            return piece_from_outputs({o.name: result.as_numpy(o.name) for o in response.outputs})
    if count is None and log_probs is not None:
        count = len(log_probs)
    return Piece(
        text=text,
        num_tokens=count,
        log_probs=log_probs or [],
        cum_log_prob=cum,
        finish_reason=reason or None,
        received_s=time.perf_counter(),
    )


def _channel_options() -> list[tuple[str, Any]]:
    """`tritonclient`'s own channel options (message size limits, keepalive)."""
    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
    ]


class TritonBackend:
    """gRPC to Triton: `tritonclient`'s client for metadata and readiness, and a channel of the same
    options on which `generate` opens one `ModelStreamInfer` stream per request."""

    def __init__(
        self,
        url: str,
        model: str,
        connect_timeout_s: float,
        retry_after_s: float,
        tokenizer_dir: str | None = None,
    ):
        self.url = url
        self.model = model
        self.tokenizer_dir = tokenizer_dir  # for a token-id model: the text work the BLS would do
        self._text: TextRequests | None = None
        self.connect_timeout_s = connect_timeout_s
        self.retry_after_s = retry_after_s
        self._client = grpcaio.InferenceServerClient(url)
        self._channel = grpc.aio.insecure_channel(url, options=_channel_options())
        self._stream = service_pb2_grpc.GRPCInferenceServiceStub(self._channel).ModelStreamInfer
        self._names: tuple[frozenset[str], frozenset[str]] | None = None
        self._outputs: dict[bool, list[str]] = {}  # with log-probabilities or not -> outputs to ask for

    def _error(self, exc: Exception) -> APIError:
        if isinstance(exc, grpc.aio.AioRpcError):
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return api_error(ServerUnavailableError(exc.details() or "UNAVAILABLE"), self.retry_after_s)
            return api_error(classify(f"{exc.code().name}: {exc.details()}", self.model), self.retry_after_s)
        text = exc.message() if isinstance(exc, InferenceServerException) else str(exc)
        status = exc.status() if isinstance(exc, InferenceServerException) else None
        if status and "UNAVAILABLE" in status and "busy" not in (text or "").lower():
            return api_error(ServerUnavailableError(text or status), self.retry_after_s)
        return api_error(classify(text or str(exc), self.model), self.retry_after_s)

    async def _metadata(self) -> tuple[frozenset[str], frozenset[str]]:
        """The model's input and output names (cached once read): what this server takes and sends."""
        if self._names is None:
            try:
                metadata = await self._client.get_model_metadata(
                    self.model, as_json=True, client_timeout=self.connect_timeout_s
                )
            except (grpc.aio.AioRpcError, InferenceServerException) as exc:
                raise self._error(exc) from None
            self._names = (
                frozenset(i["name"] for i in metadata.get("inputs", [])),
                frozenset(o["name"] for o in metadata.get("outputs", [])),
            )
        return self._names

    async def generate(self, inputs: dict[str, Any], priority: int, request_id: str) -> AsyncIterator[Piece]:
        """Stream one generation. Closing this iterator early cancels the request on the server."""
        declared_inputs, declared_outputs = await self._metadata()
        inputs = dict(inputs)
        if "priority" in declared_inputs:  # this project's models; NVIDIA's have no priority input
            inputs["priority"] = priority
        if "return_num_output_tokens" in declared_inputs:  # exact token counts per response
            inputs["return_num_output_tokens"] = True
        else:  # NVIDIA's older models: count the log-probabilities, one per token
            inputs["return_log_probs"] = True
        want_log_probs = bool(inputs.get("return_log_probs"))
        outputs = self._outputs.get(want_log_probs)
        if outputs is None:
            wanted = set(READ_OUTPUTS) if want_log_probs else set(READ_OUTPUTS) - {"output_log_probs"}
            # Only the outputs read here: the rest (timings, KV counters) would cost a conversion each.
            outputs = self._outputs[want_log_probs] = sorted(wanted & declared_outputs)
        text = None
        if "input_ids" in declared_inputs:  # a token-id model: the BLS's text work happens here
            if "output_context_ids" not in declared_outputs:
                raise APIError(
                    500,
                    f"{self.model} takes token ids but sends no output_context_ids to detokenize with "
                    "(NVIDIA's tensorrt_llm): call tensorrt_llm_bls instead (--triton-model)",
                    type="server_error",
                    code="unsupported_model",
                    reason="internal_error",
                )
            text = await self._text_requests()
        if text is None:
            request = build_request(self.model, inputs, outputs, request_id)
        else:
            request = self._engine_request(text, inputs, outputs, request_id)
        call = self._stream()
        try:
            try:
                await call.write(request)
                await call.done_writing()  # half-close: Triton ends the stream after the final response
            except asyncio.InvalidStateError:  # the call already ended (e.g. unreachable): read says why
                pass
            error = None
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                if response.error_message:  # final: read on to the end (engine_link.EngineStream says why)
                    error = error or response.error_message
                    continue
                if error is not None or not response.infer_response.outputs:
                    continue
                if text is None:
                    yield read_piece(response.infer_response)
                    continue
                engine_outputs = response_outputs(response.infer_response)
                if "output_ids" in engine_outputs:  # not the flag-only final response
                    yield piece_from_outputs(text.text_outputs(engine_outputs))
            if error is not None:
                raise self._error(InferenceServerException(msg=error))
        except (grpc.aio.AioRpcError, InferenceServerException) as exc:
            raise self._error(exc) from None
        finally:
            call.cancel()  # a no-op after the final response; cancels the request otherwise

    async def _text_requests(self) -> TextRequests:
        """The tokenizer's text work for a token-id model (loaded once, off the event loop)."""
        if self._text is None:
            if not self.tokenizer_dir:
                raise APIError(500, f"{self.model} takes token ids, and no tokenizer was given")
            codec = await asyncio.to_thread(TextCodec, self.tokenizer_dir)
            self._text = TextRequests(codec)
        return self._text

    def _engine_request(
        self, text: TextRequests, inputs: dict[str, Any], outputs: list[str], request_id: str
    ) -> Any:
        """The `tensorrt_llm` request the BLS would send for these ensemble-named inputs."""
        try:
            arrays = text.engine_inputs({name: input_array(name, value) for name, value in inputs.items()})
        except RequestError as exc:
            raise api_error(InvalidRequestError(str(exc)), self.retry_after_s) from None
        wanted = [*TEXT_OUTPUTS, *(name for name in outputs if name != "text_output")]
        return infer_request(self.model, request_id, arrays, wanted)

    async def ready(self) -> bool:
        """Whether Triton answers and the model is ready."""
        try:
            return bool(await self._client.is_model_ready(self.model, client_timeout=self.connect_timeout_s))
        except (grpc.aio.AioRpcError, InferenceServerException):
            return False

    async def close(self) -> None:
        await self._client.close()
        await self._channel.close()
