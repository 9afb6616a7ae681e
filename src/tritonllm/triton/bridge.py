"""The `tensorrt_llm` model's core: Triton requests in, the project's engine, responses out.

`EngineBridge` owns an `Engine` (any engine). `submit` queues one Triton request, which may hold several
batch rows (NVIDIA's `batch_index`): each row is one engine request. The engine loop only drops each
step's outputs into a queue; a sender thread builds the tensors and sends them through the request's
`ResponseChannel` (the Triton response sender in production, a fake in unit tests), so the engine loop
never waits on Triton. The same thread checks `is_cancelled()` (an IPC round trip to the server) at
most once per `cancel_check_interval` per request, right after sending it a response, and every
`SWEEP_FACTOR` intervals for requests that got no response lately (waiting, long prefill): no
per-request polling loop. A cancelled request is aborted in the engine, which frees its KV blocks
before its next step. Every request gets exactly one final response,
whatever happens.

Decoupled (streaming) models send each row's responses as they come, `batch_index` naming the row
when there are several, and the final flag with the last row's last response. A non-decoupled model
sends one response holding every row. With `stream_interval` N > 1 a streamed row's first token goes
out at once (time to first token unchanged) and later ones N at a time, the rest with the last
response: each response costs the server, the stub and the client a fixed share of CPU (measured in
benchmarks/README.md), which on a machine whose cores the engine fills comes out of the engine's.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.errors import EngineBusyError, EngineDeadError, EngineError, InvalidRequestError
from tritonllm.engine.llm_engine import RequestOutput
from tritonllm.engine.protocol import Engine
from tritonllm.engine.sequence import FinishReason
from tritonllm.engine.serving import ServingEngine
from tritonllm.os_threads import name_current_thread
from tritonllm.triton.tensors import EngineRequest, RequestError, from_invalid
from tritonllm.triton.text import CONTEXT_TOKENS

log = logging.getLogger(__name__)

Outputs = dict[str, np.ndarray]
BUSY = "server busy, retry later"
SWEEP_FACTOR = 2  # requests without responses are checked every SWEEP_FACTOR intervals
# Cancellation checks per second, shared by the requests in flight: each is an IPC round trip (~0.3 ms of
# a core here). At 32 streams checked every 50 ms they took a fifth of a core from a 2-core server.
CANCEL_CHECKS_PER_S = 100


def cancel_check_interval(min_s: float, in_flight: int) -> float:
    """How often to ask whether one request was cancelled: `min_s`, or less often under many requests."""
    return max(min_s, in_flight / CANCEL_CHECKS_PER_S)


class ResponseChannel(Protocol):
    """Where one request's responses go."""

    def send(self, outputs: Outputs | None, error: str | None, final: bool) -> None:
        """Send a response (`outputs` None with `final`: a flag-only final response)."""

    def is_cancelled(self) -> bool:
        """True once the client has gone or cancelled."""


@dataclass
class FinishedRequest:
    """What the metrics need about an engine request that ended (`output` None: it failed)."""

    received_ns: int
    output: RequestOutput | None
    reason: str


@dataclass
class _Row:
    """One batch row of a Triton request: one engine request."""

    engine_id: str
    batch_index: int
    request: EngineRequest
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # streamed: tokens already sent
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    context: list[int] = field(default_factory=list)
    done: bool = False
    whole: Outputs | None = None  # non-decoupled: the row's final outputs, sent with the others


@dataclass
class _Group:
    """One Triton request and its rows."""

    triton_id: str
    channel: ResponseChannel
    received_ns: int
    rows: list[_Row] = field(default_factory=list)
    error: str | None = None  # non-decoupled: the first row error, sent as the one response
    cancelled: bool = False
    checked_at: float = 0.0
    closed: bool = False

    @property
    def batched(self) -> bool:
        return len(self.rows) > 1

    @property
    def pending(self) -> int:
        return sum(not r.done for r in self.rows)


def _i32(values) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


class EngineBridge:
    """Submit parsed requests to the engine; send responses back; cancel on client request."""

    def __init__(
        self,
        config: EngineConfig,
        on_finished: Callable[[FinishedRequest], None] | None = None,
        on_rejected: Callable[[], None] | None = None,
        cancel_check_s: float = 0.05,
        engine: Engine | None = None,
        decoupled: bool = True,
        stream_interval: int = 1,
    ):
        # `engine`: another engine behind the same protocol (the TensorRT-LLM executor adapter).
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self.engine = engine if engine is not None else ServingEngine(config)
        self.tokens_per_block = config.tokens_per_block
        self.decoupled = decoupled
        self._on_finished = on_finished
        self._on_rejected = on_rejected
        self._cancel_check_s = cancel_check_s
        self._lock = threading.Lock()
        self._groups: dict[int, _Group] = {}
        self._by_triton_id: dict[str, set[int]] = {}
        self._ids = itertools.count()
        self._outbox: queue.SimpleQueue[tuple[_Group, _Row, RequestOutput | BaseException] | None] = (
            queue.SimpleQueue()
        )
        self._busy_since: float | None = None  # when the sender entered the Triton calls it is in now
        self._sender = threading.Thread(target=self._send_loop, name="tritonllm-send", daemon=True)
        self._sender.start()

    # Requests (any thread).

    def submit(
        self,
        triton_id: str,
        rows: list[EngineRequest],
        channel: ResponseChannel,
        timeout_s: float | None = None,
    ) -> None:
        """Queue a request's rows, or send its error as the final response. Never raises."""
        if rows and rows[0].stop:
            self._stop_request(triton_id, channel)
            return
        group = _Group(triton_id, channel, time.time_ns())
        gid = next(self._ids)
        for i, request in enumerate(rows):
            row = _Row(f"{triton_id or 'req'}#{gid}.{i}", i, request)
            row.context = request.prompt_ids[-CONTEXT_TOKENS:]
            group.rows.append(row)
        with self._lock:
            self._groups[gid] = group
            self._by_triton_id.setdefault(triton_id, set()).add(gid)
        for row in group.rows:
            try:
                self.engine.submit(
                    row.engine_id,
                    row.request.prompt_ids,
                    row.request.params,
                    priority=row.request.priority,
                    timeout_s=timeout_s,
                    on_output=lambda out, group=group, row=row: self._outbox.put((group, row, out)),
                )
            except EngineError as exc:
                # A row the engine refuses fails the whole request, as NVIDIA's backend does.
                message = self._error_message(exc)
                for other in group.rows:
                    if other is not row and not other.done:
                        self.engine.cancel(other.engine_id)
                self._row_failed(group, row, _Refused(message, exc))
                return

    def stop(self, triton_id: str) -> bool:
        """Cancel every in-flight request with this Triton request id (the `stop` input)."""
        with self._lock:
            groups = [self._groups[g] for g in self._by_triton_id.get(triton_id, ()) if g in self._groups]
        cancelled = False
        for group in groups:
            cancelled |= self._cancel(group)
        return cancelled

    @property
    def num_in_flight(self) -> int:
        return len(self._groups)

    def shutdown(self, drain_timeout_s: float = 5.0) -> None:
        """Finish in-flight requests for up to `drain_timeout_s`, abort the rest, stop the threads."""
        self.engine.shutdown(drain_timeout_s=drain_timeout_s)
        self._outbox.put(None)
        self._sender.join(10.0)
        with self._lock:
            leftover = list(self._groups.values())
        for group in leftover:  # the engine died before answering them
            self._close(group, "the engine stopped")

    # Helpers.

    def _stop_request(self, triton_id: str, channel: ResponseChannel) -> None:
        if not triton_id:
            message = str(RequestError("stop", "needs the request id of the request to cancel"))
            channel.send(None, message, final=True)
            return
        self.stop(triton_id)
        channel.send(None, None, final=True)

    def _cancel(self, group: _Group) -> bool:
        group.cancelled = True
        return any([self.engine.cancel(r.engine_id) for r in group.rows if not r.done])

    def _error_message(self, exc: BaseException) -> str:
        if isinstance(exc, InvalidRequestError):
            return str(from_invalid(exc))
        if isinstance(exc, EngineBusyError):
            return f"{BUSY}: {exc}"
        if isinstance(exc, EngineDeadError):
            return f"engine is not running: {exc}"
        return f"engine error: {exc}"

    def _forget(self, group: _Group) -> None:
        with self._lock:
            for gid, g in list(self._groups.items()):
                if g is group:
                    del self._groups[gid]
                    ids = self._by_triton_id.get(group.triton_id)
                    if ids is not None:
                        ids.discard(gid)
                        if not ids:
                            del self._by_triton_id[group.triton_id]
                    break

    def _close(self, group: _Group, error: str | None) -> None:
        """Send the group's final response (an error, or a flag-only response) once."""
        if group.closed:
            return
        group.closed = True
        for row in group.rows:
            row.done = True
        self._forget(group)
        try:
            group.channel.send(None, error, final=True)
        except Exception:
            log.exception("could not send the final response of %s", group.triton_id)

    # The sender thread.

    def _send_loop(self) -> None:
        name_current_thread()
        sweep_s = SWEEP_FACTOR * self._cancel_check_s
        next_sweep = time.monotonic() + sweep_s
        while True:
            try:
                item = self._outbox.get(timeout=self._cancel_check_s)
            except queue.Empty:
                item = ()  # type: ignore[assignment]
            if item is None:
                return
            self._busy_since = time.monotonic()
            if item:
                group, row, out = item
                try:
                    self._handle(group, row, out)
                except Exception as exc:  # never leave a request without its final response
                    log.exception("sending a response of %s failed", row.engine_id)
                    self._cancel(group)
                    self._close(group, f"internal error: {exc}")
            if time.monotonic() >= next_sweep:
                self._sweep_cancellations()
                next_sweep = time.monotonic() + sweep_s
            self._busy_since = None

    def sender_stalled_s(self) -> float:
        """Seconds the sender has spent on its current response (0 when idle). A send takes well under a
        second; one that never returns holds every later response back (`recovery.stop_stalled_server`)."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _handle(self, group: _Group, row: _Row, out: RequestOutput | BaseException) -> None:
        if group.closed or row.done:
            return
        if isinstance(out, BaseException):
            self._row_failed(group, row, out)
            return
        req = row.request
        row.tokens += out.new_token_ids
        if req.return_log_probs:
            lps = [lp or 0.0 for lp in out.new_logprobs]
            row.logprobs += lps
            row.cum_logprob += float(sum(lps))
        if out.finished:
            row.done = True
            if self._on_finished is not None:
                reason = (out.finish_reason or FinishReason.STOP).value
                self._on_finished(FinishedRequest(group.received_ns, out, reason))
        last = out.finished and group.pending == 0
        if req.streaming:
            self._send_streamed(group, row, out, last)
        elif out.finished:
            outputs = self._whole(group, row, out)
            if self.decoupled:
                group.channel.send(outputs, None, final=last)
            else:
                row.whole = outputs
                if last:
                    self._send_combined(group)
        if last:
            group.closed = True
            self._forget(group)
        elif not out.finished:
            self._maybe_check_cancelled(group)

    def _row_failed(self, group: _Group, row: _Row, exc: BaseException) -> None:
        row.done = True
        message = exc.message if isinstance(exc, _Refused) else self._error_message(exc)
        cause = exc.cause if isinstance(exc, _Refused) else exc
        if isinstance(cause, EngineBusyError) and self._on_rejected is not None:
            self._on_rejected()
        elif not isinstance(cause, InvalidRequestError) and self._on_finished is not None:
            self._on_finished(FinishedRequest(group.received_ns, None, FinishReason.ERROR.value))
        if isinstance(exc, _Refused) or not self.decoupled or not group.batched:
            for other in group.rows:
                if not other.done:
                    self.engine.cancel(other.engine_id)
            self._close(group, message)
            return
        # A decoupled batch: this row's error now, the other rows carry on.
        if group.pending == 0:
            self._close(group, message)
        else:
            group.channel.send(None, message, final=False)

    def _send_streamed(self, group: _Group, row: _Row, out: RequestOutput, last: bool) -> None:
        unsent = len(row.tokens) - row.sent
        held = unsent < (self.stream_interval if row.sent else 1)
        if held and not out.finished:
            return
        # A row that ends without a new token (aborted, timed out) still says why in a last, empty response.
        new, logprobs = row.tokens[row.sent :], row.logprobs[row.sent :]
        row.sent = len(row.tokens)
        outputs = self._outputs(group, row, out, new, row.context, logprobs, len(new))
        row.context = (row.context + new)[-CONTEXT_TOKENS:]
        group.channel.send(outputs, None, final=last)

    def _whole(self, group: _Group, row: _Row, out: RequestOutput) -> Outputs:
        req = row.request
        if req.exclude_input_in_output:
            ids, context = row.tokens, req.prompt_ids[-CONTEXT_TOKENS:]
        else:
            ids, context = req.prompt_ids + row.tokens, []
        # output_log_probs cover the generated tokens only, as TensorRT-LLM's.
        return self._outputs(group, row, out, ids, context, row.logprobs, len(row.tokens))

    def _send_combined(self, group: _Group) -> None:
        """Non-decoupled: every row's outputs in one response, padded along the token axis."""
        parts = [r.whole for r in group.rows if r.whole is not None]
        if len(parts) == 1:
            group.channel.send(parts[0], None, final=True)
            return
        combined: Outputs = {}
        for name in parts[0]:
            arrays = [p[name] for p in parts]
            width = max(a.shape[-1] for a in arrays)
            fill = "" if arrays[0].dtype == object else -1
            padded = [
                np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])], constant_values=fill)
                for a in arrays
            ]
            combined[name] = np.concatenate(padded, axis=0)
        group.channel.send(combined, None, final=True)

    def _outputs(
        self,
        group: _Group,
        row: _Row,
        out: RequestOutput,
        ids: list[int],
        context: list[int],
        logprobs: list[float],
        num_new_tokens: int,
    ) -> Outputs:
        """The response tensors; optional ones only when asked for, as NVIDIA's backend sends them."""
        req = row.request
        n = len(ids)
        outputs: Outputs = {
            "output_ids": _i32(ids).reshape(1, 1, n),
            "sequence_length": _i32([[n]]),
            "output_context_ids": _i32(context).reshape(1, len(context)),
            "finish_reason": np.array(
                [[(out.finish_reason or FinishReason.STOP).value if out.finished else ""]], dtype=object
            ),
        }
        if group.batched:
            outputs["batch_index"] = _scalar(row.batch_index, np.int32)
        if req.return_log_probs:
            outputs["cum_log_probs"] = _scalar(row.cum_logprob, np.float32)
            outputs["output_log_probs"] = np.array(logprobs, dtype=np.float32).reshape(1, 1, len(logprobs))
        if req.return_num_input_tokens:
            outputs["num_input_tokens"] = _scalar(out.num_prompt_tokens, np.uint32)
        if req.return_num_output_tokens:
            outputs["num_output_tokens"] = _scalar(num_new_tokens, np.uint32)
        if req.return_perf_metrics:
            tpb = self.tokens_per_block
            total_blocks = -(-(out.num_prompt_tokens + out.num_output_tokens) // tpb)
            reused = out.num_cached_tokens // tpb
            outputs |= {
                "kv_cache_alloc_new_blocks": _scalar(total_blocks - reused, np.int32),
                "kv_cache_reused_blocks": _scalar(reused, np.int32),
                "kv_cache_alloc_total_blocks": _scalar(total_blocks, np.int32),
                "arrival_time_ns": _scalar(group.received_ns, np.int64),
                "first_scheduled_time_ns": _scalar(out.first_scheduled_time_ns, np.int64),
                "first_token_time_ns": _scalar(out.first_token_time_ns, np.int64),
                "last_token_time_ns": _scalar(out.last_token_time_ns, np.int64),
                # No speculative decoding: nothing drafted, nothing accepted.
                "acceptance_rate": _scalar(0.0, np.float32),
                "total_accepted_draft_tokens": _scalar(0, np.int32),
                "total_draft_tokens": _scalar(0, np.int32),
            }
        return outputs

    # Cancellation (the sender thread).

    def _maybe_check_cancelled(self, group: _Group, intervals: int = 1) -> None:
        """Ask Triton whether `group` was cancelled, unless it was asked within `intervals` intervals."""
        now = time.monotonic()
        interval = intervals * cancel_check_interval(self._cancel_check_s, len(self._groups))
        if group.cancelled or now - group.checked_at < interval:
            return
        group.checked_at = now
        try:
            if group.channel.is_cancelled():
                self._cancel(group)
        except Exception:
            log.exception("is_cancelled failed for %s", group.triton_id)

    def _sweep_cancellations(self) -> None:
        """Requests that got no response lately (waiting, or in a long prefill)."""
        with self._lock:
            groups = list(self._groups.values())
        for group in groups:
            if not group.closed:
                self._maybe_check_cancelled(group, SWEEP_FACTOR)


class _Refused(Exception):
    """A row the engine refused at submit (delivered through the outbox like the engine's errors)."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.message = message
        self.cause = cause
