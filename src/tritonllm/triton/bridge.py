"""The `tensorrt_llm` model's core: Triton requests in, the project's engine, streamed responses out.

`EngineBridge` owns a `ServingEngine`. `submit` queues a parsed request; the engine loop thread calls
back with each step's output, and the callback sends the response at once through the request's
`ResponseChannel` (the Triton response sender in production, a fake in unit tests). A watcher thread
polls `is_cancelled()` of every in-flight request and cancels it in the engine, which frees its KV
blocks before the next step. Every request gets exactly one final response, whatever happens.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.errors import EngineBusyError, EngineError, InvalidRequestError
from tritonllm.engine.llm_engine import RequestOutput
from tritonllm.engine.sequence import FinishReason
from tritonllm.engine.serving import ServingEngine
from tritonllm.triton.tensors import EngineRequest, from_invalid
from tritonllm.triton.text import CONTEXT_TOKENS

log = logging.getLogger(__name__)

Outputs = dict[str, np.ndarray]


class ResponseChannel(Protocol):
    """Where one request's responses go."""

    def send(self, outputs: Outputs | None, error: str | None, final: bool) -> None:
        """Send a response (`outputs` None with `final`: a flag-only final response)."""

    def is_cancelled(self) -> bool:
        """True once the client has gone or cancelled."""


@dataclass
class FinishedRequest:
    """What the metrics need about a request that ended."""

    received_ns: int
    output: RequestOutput


@dataclass
class _Live:
    engine_id: str
    triton_id: str
    channel: ResponseChannel
    request: EngineRequest
    received_ns: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    context: list[int] = field(default_factory=list)
    cancelled: bool = False


def _i32(values) -> np.ndarray:
    return np.array(values, dtype=np.int32)


class EngineBridge:
    """Submit parsed requests to the engine; stream responses back; cancel on client request."""

    def __init__(
        self,
        config: EngineConfig,
        on_finished: Callable[[FinishedRequest], None] | None = None,
        on_rejected: Callable[[], None] | None = None,
        cancel_poll_s: float = 0.005,
        engine: ServingEngine | None = None,
    ):
        # `engine`: another engine behind ServingEngine's interface (the TensorRT-LLM executor adapter).
        self.engine = engine if engine is not None else ServingEngine(config)
        self.tokens_per_block = config.tokens_per_block
        self._on_finished = on_finished
        self._on_rejected = on_rejected
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._by_triton_id: dict[str, set[str]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._cancel_poll_s = cancel_poll_s
        self._watcher = threading.Thread(
            target=self._watch_cancellations, name="tritonllm-cancel", daemon=True
        )
        self._watcher.start()

    # Requests.

    def submit(self, triton_id: str, request: EngineRequest, channel: ResponseChannel) -> None:
        """Queue a request, or send its error as the final response. Never raises."""
        if request.stop:
            self.stop(triton_id)
            channel.send(None, None, final=True)
            return
        engine_id = f"{triton_id or 'req'}#{next(self._ids)}"
        live = _Live(engine_id, triton_id, channel, request, time.time_ns())
        live.context = request.prompt_ids[-CONTEXT_TOKENS:]
        with self._lock:
            self._live[engine_id] = live
            self._by_triton_id.setdefault(triton_id, set()).add(engine_id)
        try:
            self.engine.submit(
                engine_id,
                request.prompt_ids,
                request.params,
                on_output=lambda out, live=live: self._on_output(live, out),
            )
        except InvalidRequestError as exc:
            self._fail(live, str(from_invalid(exc)))
        except EngineBusyError as exc:
            if self._on_rejected is not None:
                self._on_rejected()
            self._fail(live, f"server busy, retry later: {exc}")
        except EngineError as exc:
            self._fail(live, str(exc))

    def stop(self, triton_id: str) -> bool:
        """Cancel every in-flight request with this Triton request id (the `stop` input)."""
        with self._lock:
            engine_ids = list(self._by_triton_id.get(triton_id, ()))
        return any([self.engine.cancel(eid) for eid in engine_ids])

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    def shutdown(self, drain_timeout_s: float = 5.0) -> None:
        """Finish in-flight requests for up to `drain_timeout_s`, abort the rest, stop the threads."""
        self.engine.shutdown(drain_timeout_s=drain_timeout_s)
        self._stop.set()
        self._watcher.join(5.0)
        with self._lock:
            leftover = list(self._live.values())
        for live in leftover:  # the engine died before answering them
            self._fail(live, "the engine stopped")

    # The engine loop thread.

    def _forget(self, live: _Live) -> bool:
        with self._lock:
            if self._live.pop(live.engine_id, None) is None:
                return False
            ids = self._by_triton_id.get(live.triton_id)
            if ids is not None:
                ids.discard(live.engine_id)
                if not ids:
                    del self._by_triton_id[live.triton_id]
            return True

    def _fail(self, live: _Live, message: str) -> None:
        if self._forget(live):
            try:
                live.channel.send(None, message, final=True)
            except Exception:
                log.exception("could not send the error of %s", live.engine_id)

    def _on_output(self, live: _Live, out: RequestOutput | BaseException) -> None:
        if isinstance(out, BaseException):
            self._fail(live, f"engine error: {out}")
            return
        try:
            live.tokens += out.new_token_ids
            if live.request.return_log_probs:
                lps = [lp or 0.0 for lp in out.new_logprobs]
                live.logprobs += lps
                live.cum_logprob += float(sum(lps))
            if live.request.streaming:
                self._send_streamed(live, out)
            elif out.finished:
                self._send_whole(live, out)
        except Exception as exc:  # never leave a request without its final response
            log.exception("sending a response of %s failed", live.engine_id)
            self._fail(live, f"internal error: {exc}")
            return
        if out.finished:
            self._forget(live)
            if self._on_finished is not None:
                self._on_finished(FinishedRequest(live.received_ns, out))

    def _send_streamed(self, live: _Live, out: RequestOutput) -> None:
        new = out.new_token_ids
        if not new and not out.finished:
            return
        # A request that ends without a new token (aborted, timed out) still says why in a last,
        # empty response.
        outputs = self._outputs(live, out, new, live.context, live.logprobs[len(live.logprobs) - len(new) :])
        live.context = (live.context + out.new_token_ids)[-CONTEXT_TOKENS:]
        live.channel.send(outputs, None, final=out.finished)

    def _send_whole(self, live: _Live, out: RequestOutput) -> None:
        req = live.request
        if req.exclude_input_in_output:
            ids, context = live.tokens, req.prompt_ids[-CONTEXT_TOKENS:]
            logprobs = live.logprobs
        else:
            ids, context = req.prompt_ids + live.tokens, []
            logprobs = [0.0] * len(req.prompt_ids) + live.logprobs
        live.channel.send(self._outputs(live, out, ids, context, logprobs), None, final=True)

    def _outputs(
        self, live: _Live, out: RequestOutput, ids: list[int], context: list[int], logprobs: list[float]
    ) -> Outputs:
        n = len(ids)
        if not live.request.return_log_probs:
            logprobs = [0.0] * n
        tpb = self.tokens_per_block
        total_blocks = -(-(out.num_prompt_tokens + out.num_output_tokens) // tpb)
        reused = out.num_cached_tokens // tpb
        return {
            "output_ids": _i32(ids).reshape(1, 1, n),
            "sequence_length": _i32([[n]]),
            "output_context_ids": _i32(context).reshape(1, len(context)),
            "cum_log_probs": np.array([[live.cum_logprob]], dtype=np.float32),
            "output_log_probs": np.array(logprobs, dtype=np.float32).reshape(1, 1, n),
            "batch_index": _i32([[0]]),
            "sequence_index": _i32([[0]]),
            "kv_cache_alloc_new_blocks": _i32([[total_blocks - reused]]),
            "kv_cache_reused_blocks": _i32([[reused]]),
            "kv_cache_alloc_total_blocks": _i32([[total_blocks]]),
            "arrival_time_ns": np.array([[live.received_ns]], dtype=np.int64),
            "first_scheduled_time_ns": np.array([[out.first_scheduled_time_ns]], dtype=np.int64),
            "first_token_time_ns": np.array([[out.first_token_time_ns]], dtype=np.int64),
            "last_token_time_ns": np.array([[out.last_token_time_ns]], dtype=np.int64),
            "finish_reason": np.array(
                [[(out.finish_reason or FinishReason.STOP).value if out.finished else ""]], dtype=object
            ),
        }

    # The cancellation watcher.

    def _watch_cancellations(self) -> None:
        while not self._stop.wait(self._cancel_poll_s):
            with self._lock:
                lives = list(self._live.values())
            for live in lives:
                try:
                    if not live.cancelled and live.channel.is_cancelled():
                        live.cancelled = True
                        self.engine.cancel(live.engine_id)
                except Exception:
                    log.exception("is_cancelled failed for %s", live.engine_id)
