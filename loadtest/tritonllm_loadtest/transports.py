"""Thin, blocking transports to Triton's generate endpoints that time every token.

One transport object per Locust user (``requests`` sessions and gRPC channels are not shared between
greenlets). They work in plain threads too; under Locust the process is gevent-patched (and gRPC is put
into gevent mode by ``locust_plugin.py``), so a blocking read yields to the other users.
"""

from __future__ import annotations

import json
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import requests
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tritonllm_loadtest.workload import GenerationRequest

TRANSPORTS = ("http-stream", "http", "grpc-stream")
OnToken = Callable[[], None]
# Wire types of the request tensors we send (model_repository/README.md).
TENSOR_TYPES = {
    "text_input": "BYTES",
    "max_tokens": "INT32",
    "min_tokens": "INT32",
    "stream": "BOOL",
    "exclude_input_in_output": "BOOL",
    "priority": "INT32",
}
PACK_FORMATS = {"INT32": "<i", "BOOL": "<?"}


@dataclass
class GenerationResult:
    """What one request did; times are ``time.perf_counter()`` seconds."""

    start: float
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # streamed: arrival of each token's response
    output_tokens: int = 0
    text: str = ""
    error_kind: str | None = None  # "timeout", "connection", "http_503", "server_error", "incomplete", ...
    error_message: str = ""

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def e2e_s(self) -> float:
        return self.end - self.start

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    def fail(self, kind: str, message: str) -> GenerationResult:
        self.error_kind, self.error_message, self.end = kind, message[:300], time.perf_counter()
        return self


def _no_op() -> None:
    pass


def request_inputs(request: GenerationRequest, stream: bool, exact_output: bool) -> dict[str, object]:
    """Request tensors; ``exact_output`` sets min_tokens = max_tokens: every reply has the sampled length."""
    inputs: dict[str, object] = {
        "text_input": request.prompt,
        "max_tokens": request.max_tokens,
        "stream": stream,
        "exclude_input_in_output": True,
    }
    if exact_output:
        inputs["min_tokens"] = request.max_tokens
    if request.priority:
        inputs["priority"] = request.priority
    return inputs


class HttpTransport:
    """``/generate`` (one response) or ``/generate_stream`` (server-sent events, one per token)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        stream: bool,
        timeout_s: float,
        count_tokens: Callable[[str], int],
        exact_output: bool = True,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            base_url = f"http://{base_url}"
        endpoint = "generate_stream" if stream else "generate"
        self.url = f"{base_url.rstrip('/')}/v2/models/{model}/{endpoint}"
        self.stream, self.timeout_s, self.count_tokens = stream, timeout_s, count_tokens
        self.exact_output = exact_output
        self.session = requests.Session()

    def generate(self, request: GenerationRequest, on_token: OnToken = _no_op) -> GenerationResult:
        """``on_token`` is called as each streamed token arrives (live throughput)."""
        result = GenerationResult(start=time.perf_counter())
        payload = request_inputs(request, self.stream, self.exact_output)
        try:
            with self.session.post(self.url, json=payload, stream=True, timeout=self.timeout_s) as response:
                if response.status_code != 200:
                    return result.fail(f"http_{response.status_code}", response.text)
                if self.stream:
                    return self._read_events(response, result, on_token)
                return self._read_whole(response, result)
        except requests.Timeout as exc:
            return result.fail("timeout", str(exc))
        except requests.ConnectionError as exc:
            return result.fail("connection", str(exc))

    def _read_whole(self, response: requests.Response, result: GenerationResult) -> GenerationResult:
        body = response.json()
        if "error" in body:
            return result.fail("server_error", str(body["error"]))
        result.end = time.perf_counter()
        result.text = "".join(_as_list(body.get("text_output", "")))
        result.output_tokens = self.count_tokens(result.text)
        return result

    def _read_events(
        self, response: requests.Response, result: GenerationResult, on_token: OnToken
    ) -> GenerationResult:
        finished = False
        pieces: list[str] = []
        for line in _sse_lines(response):
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                return result.fail("server_error", str(event["error"]))
            if "text_output" in event:
                result.token_times.append(now)
                on_token()
                pieces.append("".join(_as_list(event["text_output"])))
            finished = finished or bool(event.get("finish_reason"))
        result.end = time.perf_counter()
        result.text, result.output_tokens = "".join(pieces), len(result.token_times)
        if not finished:
            return result.fail("incomplete", f"stream ended after {result.output_tokens} tokens")
        return result


def _as_list(value: object) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def _sse_lines(response: requests.Response):
    """Lines of an event stream as each chunk arrives (``iter_lines`` would wait for a full buffer)."""
    buffer = b""
    for chunk in response.iter_content(chunk_size=None):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode().rstrip("\r")
    if buffer:
        yield buffer.decode()


class GrpcStreamTransport:
    """One ``ModelStreamInfer`` stream per request (cancelling a stream cancels all its requests)."""

    def __init__(self, target: str, model: str, timeout_s: float, exact_output: bool = True) -> None:
        self.model, self.timeout_s, self.exact_output = model, timeout_s, exact_output
        self.channel = grpc.insecure_channel(target)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def generate(self, request: GenerationRequest, on_token: OnToken = _no_op) -> GenerationResult:
        result = GenerationResult(start=time.perf_counter())
        message = infer_request(self.model, request_inputs(request, True, self.exact_output))
        call = self.stub.ModelStreamInfer(iter([message]), timeout=self.timeout_s)
        pieces: list[str] = []
        try:
            for reply in call:
                now = time.perf_counter()
                if reply.error_message:
                    return result.fail("server_error", reply.error_message)
                response = reply.infer_response
                outputs = {
                    o.name: raw for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)
                }
                if "text_output" in outputs:
                    result.token_times.append(now)
                    on_token()
                    pieces.append(decode_bytes_tensor(outputs["text_output"]))
                if response.parameters["triton_final_response"].bool_param:
                    break
            else:
                return result.fail("incomplete", f"stream ended after {len(result.token_times)} tokens")
        except grpc.RpcError as exc:
            code = exc.code()
            kind = {grpc.StatusCode.DEADLINE_EXCEEDED: "timeout", grpc.StatusCode.UNAVAILABLE: "connection"}
            return result.fail(kind.get(code, f"grpc_{code.name.lower()}"), exc.details() or "")
        finally:
            call.cancel()
        result.end = time.perf_counter()
        result.text, result.output_tokens = "".join(pieces), len(result.token_times)
        return result

    def close(self) -> None:
        self.channel.close()


def infer_request(model: str, inputs: dict[str, object]) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest with each input as a ``[1, 1]`` raw tensor (every model has max_batch_size > 0)."""
    message = service_pb2.ModelInferRequest(model_name=model, id=uuid.uuid4().hex)
    message.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, value in inputs.items():
        dtype = TENSOR_TYPES[name]
        message.inputs.add(name=name, datatype=dtype, shape=[1, 1])
        if dtype == "BYTES":
            data = str(value).encode()
            message.raw_input_contents.append(struct.pack("<I", len(data)) + data)
        else:
            message.raw_input_contents.append(struct.pack(PACK_FORMATS[dtype], value))
    return message


def decode_bytes_tensor(raw: bytes) -> str:
    """Concatenated elements of a raw BYTES tensor (each a 4-byte little-endian length, then the bytes)."""
    pieces, offset = [], 0
    while offset < len(raw):
        (size,) = struct.unpack_from("<I", raw, offset)
        pieces.append(raw[offset + 4 : offset + 4 + size].decode(errors="replace"))
        offset += 4 + size
    return "".join(pieces)
