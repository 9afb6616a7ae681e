"""The two transports behind one interface: gRPC streaming and HTTP generate / generate_stream (SSE).

Both yield normalised `Piece`s and raise the classified errors of `errors.py`. Closing a generation's
iterator early (cancel, timeout, abandon) cancels its gRPC stream or drops its HTTP connection, which the
server sees as a cancellation (it frees the KV blocks on `tensorrt_llm_bls`; Triton never cancels inside
an ensemble).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from tritonllm_client.errors import ClientError, ServerUnavailableError, classify
from tritonllm_client.results import Piece, piece_from_outputs

UINT64_INPUTS = frozenset({"seed", "random_seed", "lora_task_id"})
PREPROCESSING_MODEL = "preprocessing"


class Transport(Protocol):
    def generate(
        self, model: str, inputs: dict[str, Any], parameters: dict[str, Any], request_id: str
    ) -> AsyncIterator[Piece]: ...

    async def prompt_tokens(self, text: str, parameters: dict[str, Any]) -> int: ...

    async def health(self, model: str) -> dict[str, Any]: ...

    async def close(self) -> None: ...


def grpc_tensor(name: str, value: Any) -> grpcclient.InferInput:
    """One request value as a `[1, 1]` (or `[1, N]` for a list of strings) tensor of the contract's type."""
    if isinstance(value, list):
        arr, dtype = np.array([[v.encode() for v in value]], dtype=object), "BYTES"
    elif isinstance(value, str):
        arr, dtype = np.array([[value.encode()]], dtype=object), "BYTES"
    elif isinstance(value, bool):
        arr, dtype = np.array([[value]], dtype=bool), "BOOL"
    elif isinstance(value, int):
        np_type, dtype = (np.uint64, "UINT64") if name in UINT64_INPUTS else (np.int32, "INT32")
        arr = np.array([[value]], dtype=np_type)
    else:
        arr, dtype = np.array([[value]], dtype=np.float32), "FP32"
    tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
    tensor.set_data_from_numpy(arr)
    return tensor


def _grpc_error(exc: Exception, model: str) -> ClientError:
    if isinstance(exc, grpc.aio.AioRpcError):
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return ServerUnavailableError(f"gRPC server unavailable: {exc.details()}")
        return classify(f"{exc.code().name}: {exc.details()}", model)
    if isinstance(exc, InferenceServerException):
        status = exc.status() or ""
        if "UNAVAILABLE" in status:
            return ServerUnavailableError(f"gRPC server unavailable: {exc.message()}")
        return classify(exc.message() or str(exc), model)
    return classify(str(exc), model)


class GrpcTransport:
    """One channel per client, one bidirectional stream per generation."""

    def __init__(self, url: str, connect_timeout_s: float):
        self.connect_timeout_s = connect_timeout_s
        self._client = grpcaio.InferenceServerClient(url)

    async def generate(
        self, model: str, inputs: dict[str, Any], parameters: dict[str, Any], request_id: str
    ) -> AsyncIterator[Piece]:
        request = {
            "model_name": model,
            "inputs": [grpc_tensor(name, value) for name, value in inputs.items()],
            "request_id": request_id,
            "parameters": parameters or None,
        }

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield request  # then half-close: the server ends the stream after the last response

        responses = self._client.stream_infer(one_request())
        try:
            async for result, error in responses:
                if error is not None:
                    raise _grpc_error(error, model)
                response = result.get_response()
                if response.outputs:
                    yield piece_from_outputs({o.name: result.as_numpy(o.name) for o in response.outputs})
        except (grpc.aio.AioRpcError, InferenceServerException) as exc:
            raise _grpc_error(exc, model) from None
        finally:
            responses.cancel()  # no-op after a normal end; cancels the request on the server otherwise

    async def prompt_tokens(self, text: str, parameters: dict[str, Any]) -> int:
        inputs = [grpc_tensor("QUERY", text), grpc_tensor("REQUEST_OUTPUT_LEN", 1)]
        try:
            result = await self._client.infer(
                PREPROCESSING_MODEL,
                inputs,
                parameters=parameters or None,
                client_timeout=self.connect_timeout_s,
            )
        except (grpc.aio.AioRpcError, InferenceServerException) as exc:
            raise _grpc_error(exc, PREPROCESSING_MODEL) from None
        return int(result.as_numpy("REQUEST_INPUT_LEN").reshape(-1)[0])

    async def health(self, model: str) -> dict[str, Any]:
        timeout = self.connect_timeout_s
        try:
            live = await self._client.is_server_live(client_timeout=timeout)
            ready = await self._client.is_server_ready(client_timeout=timeout)
            server = await self._client.get_server_metadata(as_json=True, client_timeout=timeout)
            model_ready = await self._client.is_model_ready(model, client_timeout=timeout)
            metadata = (
                await self._client.get_model_metadata(model, as_json=True, client_timeout=timeout)
                if model_ready
                else None
            )
        except (grpc.aio.AioRpcError, InferenceServerException) as exc:
            raise _grpc_error(exc, model) from None
        return _health_report(live, ready, server, model, model_ready, metadata)

    async def close(self) -> None:
        await self._client.close()


def _health_report(
    live: bool, ready: bool, server: dict[str, Any], model: str, model_ready: bool, metadata: Any
) -> dict[str, Any]:
    return {
        "server_live": bool(live),
        "server_ready": bool(ready),
        "server": {"name": server.get("name"), "version": server.get("version")},
        "model": model,
        "model_ready": bool(model_ready),
        "model_metadata": metadata,
    }


def _http_error(status: int, body: str, model: str) -> ClientError:
    try:
        message = json.loads(body).get("error", body)
    except (ValueError, AttributeError):
        message = body
    if status == 503 and "busy" not in message.lower():
        return ServerUnavailableError(f"HTTP 503: {message}")
    return classify(message, model)


class HttpTransport:
    """aiohttp for `/generate` and `/generate_stream` (not in tritonclient); tritonclient for health."""

    def __init__(self, url: str, connect_timeout_s: float):
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._health_client: httpaio.InferenceServerClient | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout)
        return self._session

    async def _post(self, path: str, body: dict[str, Any], model: str) -> aiohttp.ClientResponse:
        try:
            response = await self._http().post(f"http://{self.url}{path}", json=body)
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise ServerUnavailableError(f"HTTP server unavailable at {self.url}: {exc}") from None
        if response.status >= 400:
            text = await response.text()
            response.release()
            raise _http_error(response.status, text.removeprefix("data: ").strip(), model)
        return response

    async def generate(
        self, model: str, inputs: dict[str, Any], parameters: dict[str, Any], request_id: str
    ) -> AsyncIterator[Piece]:
        streaming = bool(inputs.get("stream"))
        body = {**inputs, **parameters}  # Triton's generate API takes no request id
        endpoint = "generate_stream" if streaming else "generate"
        response = await self._post(f"/v2/models/{model}/{endpoint}", body, model)
        try:
            if not streaming:
                yield piece_from_outputs(_checked(await response.json(), model))
                return
            async for line in response.content:
                if line.startswith(b"data: "):
                    yield piece_from_outputs(_checked(json.loads(line[len(b"data: ") :]), model))
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise ServerUnavailableError(f"HTTP connection lost: {exc}") from None
        finally:
            response.close()  # drops the connection if still streaming: the server sees a disconnect

    async def prompt_tokens(self, text: str, parameters: dict[str, Any]) -> int:
        body = {"QUERY": text, "REQUEST_OUTPUT_LEN": 1, **parameters}
        response = await self._post(f"/v2/models/{PREPROCESSING_MODEL}/generate", body, PREPROCESSING_MODEL)
        async with response:
            outputs = _checked(await response.json(), PREPROCESSING_MODEL)
        return int(np.asarray(outputs["REQUEST_INPUT_LEN"]).reshape(-1)[0])

    async def health(self, model: str) -> dict[str, Any]:
        if self._health_client is None:
            self._health_client = httpaio.InferenceServerClient(self.url, conn_timeout=self.connect_timeout_s)
        client = self._health_client
        try:
            live = await client.is_server_live()
            ready = await client.is_server_ready()
            server = await client.get_server_metadata()
            model_ready = await client.is_model_ready(model)
            metadata = await client.get_model_metadata(model) if model_ready else None
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise ServerUnavailableError(f"HTTP server unavailable at {self.url}: {exc}") from None
        except InferenceServerException as exc:
            raise classify(exc.message() or str(exc), model) from None
        return _health_report(live, ready, server, model, model_ready, metadata)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._health_client is not None:
            await self._health_client.close()


def _checked(event: dict[str, Any], model: str) -> dict[str, Any]:
    if "error" in event:
        raise classify(str(event["error"]), model)
    return event
