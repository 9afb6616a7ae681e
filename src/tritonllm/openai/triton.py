"""The front door's Triton client: one gRPC stream per generation into `tensorrt_llm_bls`.

Tensors are built and responses read with the `tritonllm-client` package's helpers, so the front door
reads token counts, log-probabilities and finish reasons exactly as that client does. Leaving the
iteration early (client gone, stop string, timeout) cancels the gRPC stream; the BLS then cancels the
engine request, which frees its KV blocks within one step.

The engine priority of the caller's tier goes in the `priority` input (lower is served first) where
the model declares it. Triton's errors become the caller's status: the engine's busy error 429, Triton
unreachable 503, bad input 400 (Triton names the tensor; the message says which), a missing model 503.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
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
from tritonllm_client.transport import grpc_tensor

from tritonllm.openai.errors import APIError

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


class TritonBackend:
    """One gRPC channel to Triton; `generate` streams one request's pieces."""

    def __init__(self, url: str, model: str, connect_timeout_s: float, retry_after_s: float):
        self.url = url
        self.model = model
        self.connect_timeout_s = connect_timeout_s
        self.retry_after_s = retry_after_s
        self._client = grpcaio.InferenceServerClient(url)
        self._names: tuple[frozenset[str], frozenset[str]] | None = None

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
        wanted = (
            set(READ_OUTPUTS) if inputs.get("return_log_probs") else set(READ_OUTPUTS) - {"output_log_probs"}
        )
        request = {
            "model_name": self.model,
            "inputs": [grpc_tensor(name, value) for name, value in inputs.items()],
            # Only the outputs read here: the rest (timings, KV counters) would cost a conversion each.
            "outputs": [grpcclient.InferRequestedOutput(n) for n in sorted(wanted & declared_outputs)],
            "request_id": request_id,
        }

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield request  # then half-close: Triton ends the stream after the final response

        responses = self._client.stream_infer(one_request())
        try:
            async for result, error in responses:
                if error is not None:
                    raise self._error(error)
                response = result.get_response()
                if response.outputs:
                    yield piece_from_outputs({o.name: result.as_numpy(o.name) for o in response.outputs})
        except (grpc.aio.AioRpcError, InferenceServerException) as exc:
            raise self._error(exc) from None
        finally:
            responses.cancel()  # a no-op after the final response; cancels the request otherwise

    async def ready(self) -> bool:
        """Whether Triton answers and the model is ready."""
        try:
            return bool(await self._client.is_model_ready(self.model, client_timeout=self.connect_timeout_s))
        except (grpc.aio.AioRpcError, InferenceServerException):
            return False

    async def close(self) -> None:
        await self._client.close()
