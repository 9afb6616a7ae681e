"""The `tensorrt_llm_bls` model: the ensemble's contract in one Python model, with cancellation."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tritonllm.triton.bridge import SWEEP_FACTOR, cancel_check_interval
from tritonllm.triton.models.common import (
    SenderChannel,
    checked_parameters,
    is_decoupled,
    model_parameters,
    pb_utils,
    request_inputs,
    request_timeout_us,
    wants_chat,
)
from tritonllm.triton.models.engine_link import EngineCallError, EngineLink, EngineStream
from tritonllm.triton.repository import ENGINE_MODEL
from tritonllm.triton.tensors import RequestError
from tritonllm.triton.text import TextCodec
from tritonllm.triton.text_requests import PASSTHROUGH_OUTPUTS, TEXT_OUTPUTS, TextRequests

log = logging.getLogger(__name__)

# Where `tensorrt_llm` is when config.pbtxt does not say (`tritonllm launch` fills it in).
DEFAULT_ENGINE_GRPC_URL = "127.0.0.1:8001"


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
        self.text = TextRequests(self.codec)
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

    def _serve(self, request: Any) -> None:
        channel = SenderChannel(self.pb, request, self.decoupled)
        inner_id = f"bls-{uuid.uuid4().hex}"
        try:
            params = checked_parameters(request)
            timeout_us = request_timeout_us(request, params)
            engine_inputs = self.text.engine_inputs(
                request_inputs(request), wants_chat(params), params.get("priority"), self.decoupled
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
            stream = self.engine.open(inner_id, engine_inputs, wanted, timeout_us)
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
                channel.send(self.text.text_outputs(outputs), None, final=not self.decoupled)
                self._check_cancelled(state)
            if stream.cancelled:
                channel.send(None, "request cancelled", final=True)
            else:  # decoupled: the flag-only final; a closed channel (unary, answered) ignores it
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
