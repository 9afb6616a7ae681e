"""How `tensorrt_llm_bls` reaches `tensorrt_llm`: one gRPC stream per request to this server's own port.

Not the Python backend's BLS (`InferenceRequest.exec(decoupled=True)`): under streaming load that path
of Triton 2.51 corrupts the stub's heap (segfaults after 60-500 streams in 10 of 10 runs of
`benchmarks/stress_streams.py`, also with NVIDIA's inline pattern) and can deadlock (the GIL against
its response-iterator mutexes). A stub that only sends responses, as `tensorrt_llm` does for every
token, is not affected. gRPC also ties cancellation to the call: cancelling the stream cancels the
engine request, which frees its KV blocks within one step, with no `stop` request that could overtake
the request it stops.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import (
    deserialize_bytes_tensor,
    np_to_triton_dtype,
    serialize_byte_tensor,
    triton_to_np_dtype,
)

from tritonllm.triton.bridge import Outputs

UNREACHABLE = "engine is not reachable"  # prefix of the error when the call itself fails

_Input = service_pb2.ModelInferRequest.InferInputTensor
_Output = service_pb2.ModelInferRequest.InferRequestedOutputTensor


class EngineCallError(Exception):
    """The engine model answered with an error, or could not be reached; the message says which."""


def infer_request(
    model: str, request_id: str, inputs: dict[str, np.ndarray], outputs: list[str], timeout_us: int = 0
) -> service_pb2.ModelInferRequest:
    """A `ModelInferRequest` carrying `inputs` as raw bytes, as `tritonclient` would send them."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    if timeout_us:
        request.parameters["timeout"].int64_param = timeout_us
    for name, array in inputs.items():
        array = np.ascontiguousarray(array)
        datatype = np_to_triton_dtype(array.dtype)
        if datatype == "BYTES":
            serialized = serialize_byte_tensor(array)
            raw = serialized.item() if serialized.size else b""
        else:
            raw = array.tobytes()
        request.inputs.append(_Input(name=name, datatype=datatype, shape=array.shape))
        request.raw_input_contents.append(raw)
    request.outputs.extend(_Output(name=name) for name in outputs)
    return request


def response_outputs(response: service_pb2.ModelInferResponse) -> Outputs:
    """A response's outputs as arrays (read-only views of its raw bytes): what `InferResult.as_numpy`
    gives, without its search by name and copies per output, once per streamed token."""
    raw = response.raw_output_contents
    if len(raw) != len(response.outputs):  # typed `contents` (not what Triton sends): tritonclient reads
        result = InferResult(response)
        return {o.name: result.as_numpy(o.name) for o in response.outputs}
    outputs = {}
    for output, data in zip(response.outputs, raw, strict=True):
        if output.datatype == "BYTES":
            array = deserialize_bytes_tensor(data)
        else:
            array = np.frombuffer(data, dtype=triton_to_np_dtype(output.datatype))
        outputs[output.name] = array.reshape(output.shape)
    return outputs


class EngineStream:
    """One request's responses as output dicts; `cancel()` (any thread) cancels it on the server."""

    def __init__(self, call: grpc.Call, url: str):
        self._call = call
        self._url = url
        self.cancelled = False

    def __iter__(self) -> Iterator[Outputs]:
        error = None
        try:
            for message in self._call:
                if message.error_message:
                    # An error is the request's final response: read on to the stream's end, which the
                    # server sends next. Leaving the call here cancels it while Triton 2.51 is still
                    # finishing the stream, and its handler then waits for a cancellation callback that
                    # never comes, holding `tensorrt_llm`: the launcher's drain (an unload) then hung until
                    # its deadline, ~1 stop in 8 after a busy rejection (test_launcher's interval test).
                    error = error or message.error_message
                elif message.infer_response.outputs and error is None:
                    yield response_outputs(message.infer_response)
        except grpc.RpcError as exc:
            if self.cancelled:
                return
            detail = f"{exc.code().name}: {exc.details()}"
            raise EngineCallError(f"{UNREACHABLE} over gRPC at {self._url} ({detail})") from None
        if error is not None:
            raise EngineCallError(error)

    def cancel(self) -> None:
        self.cancelled = True
        self._call.cancel()


class EngineLink:
    """A gRPC channel to the engine model; `open` starts one streamed request on it (thread-safe)."""

    def __init__(self, url: str, model: str):
        self.url = url
        self.model = model
        self._channel = grpc.insecure_channel(
            url,
            options=[
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ],
        )
        self._stream = service_pb2_grpc.GRPCInferenceServiceStub(self._channel).ModelStreamInfer

    def open(
        self, request_id: str, inputs: dict[str, np.ndarray], outputs: list[str], timeout_us: int = 0
    ) -> EngineStream:
        """Send the request and half-close: Triton ends the stream after the request's final response."""
        request = infer_request(self.model, request_id, inputs, outputs, timeout_us)
        return EngineStream(self._stream(iter([request])), self.url)

    def close(self) -> None:
        self._channel.close()
