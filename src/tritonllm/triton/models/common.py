"""What every Triton model here shares: the backend module, parameters, errors, responses.

`triton_python_backend_utils` exists only inside Triton's Python stub, so it is imported when a model
initializes (`pb_utils()`), never at import time.
"""

from __future__ import annotations

import faulthandler
import json
import threading
from types import ModuleType
from typing import Any

import numpy as np

from tritonllm.triton.bridge import Outputs
from tritonllm.triton.tensors import RequestError


def pb_utils() -> ModuleType:
    import triton_python_backend_utils as pb  # only inside Triton's Python stub

    faulthandler.enable()  # a stub that crashes leaves every thread's Python stack in the server log
    return pb


def model_parameters(model_config: dict[str, Any]) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def request_inputs(request: Any) -> dict[str, np.ndarray]:
    return {t.name(): t.as_numpy() for t in request.inputs()}


def request_parameters(request: Any) -> dict[str, Any]:
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


def checked_parameters(request: Any) -> dict[str, Any]:
    """The request parameters; unknown ones are an error naming them."""
    params = request_parameters(request)
    for name in params:
        if name not in KNOWN_PARAMETERS and not name.startswith("triton_"):
            raise RequestError(name, "is not an input or parameter of this model")
    return params


def request_timeout_us(request: Any, params: dict[str, Any]) -> int:
    """The request's time limit in microseconds, 0 for none.

    Triton hands a gRPC request's `timeout` (tritonclient's `timeout=`, microseconds) to the model as
    `request.timeout()` and enforces nothing itself for a Python model; HTTP `/generate` turns a JSON
    `timeout` key into a parameter instead, read here in the same unit.
    """
    if request.timeout():
        return int(request.timeout())
    value = params.get("timeout", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError("timeout", f"must be a whole number of microseconds >= 0, got {value!r}")
    return value


def wants_chat(params: dict[str, Any]) -> bool:
    value = params.get("apply_chat_template", False)
    return value is True or str(value).lower() in ("1", "true", "yes")


def triton_error(pb: ModuleType, message: str, code: str = "INVALID_ARG") -> Any:
    return pb.TritonError(message, getattr(pb.TritonError, code))


def triton_response(pb: ModuleType, outputs: Outputs, requested: frozenset[str] | None = None) -> Any:
    """A response of `outputs`, only those in `requested` when given."""
    names = outputs.keys() if requested is None else outputs.keys() & requested
    return pb.InferenceResponse(output_tensors=[pb.Tensor(name, outputs[name]) for name in names])


def error_code(message: str) -> str:
    if message.startswith("input "):
        return "INVALID_ARG"
    if message.startswith(("server busy", "engine is not running", "engine is not reachable")):
        return "UNAVAILABLE"
    return "INTERNAL"


class SenderChannel:
    """A `ResponseChannel` over a decoupled request's response sender.

    Triton frees a request's response factory once its final response is sent, and `is_cancelled()`
    after that crashes the server (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled, Triton 2.51):
    a lock orders the two, and a closed channel reports not cancelled.

    Only the outputs the request asked for become Triton tensors: Triton drops the others, but only
    after the stub has built them (a streamed token's response has 4 outputs, clients such as NVIDIA's
    scripts ask for 1 or 2, and the string `finish_reason` is serialized in Python).
    """

    def __init__(self, pb: ModuleType, request: Any, decoupled: bool = True):
        self._pb = pb
        self._request = request
        self._sender = request.get_response_sender()
        self._requested = frozenset(request.requested_output_names())
        self._final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._decoupled = decoupled
        self._lock = threading.Lock()
        self._closed = False

    def send(self, outputs: Outputs | None, error: str | None, final: bool) -> None:
        flags = self._final if final else 0
        if error is not None:
            response = self._pb.InferenceResponse(
                output_tensors=[], error=triton_error(self._pb, error, error_code(error))
            )
        elif outputs is not None:
            response = triton_response(self._pb, outputs, self._requested)
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

    @property
    def requested(self) -> frozenset[str]:
        """The outputs the request asked for (all of the model's when it named none)."""
        return self._requested

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self._closed and self._request.is_cancelled()


def is_decoupled(pb: ModuleType, config: dict[str, Any]) -> bool:
    return bool(pb.using_decoupled_model_transaction_policy(config))
