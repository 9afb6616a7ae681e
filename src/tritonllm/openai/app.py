"""The OpenAI-compatible HTTP front door (aiohttp): endpoints, keys, limits, streaming, metrics.

Each request: authenticate (Bearer key, or the anonymous caller when keys are off) -> requests/min
bucket -> parse and validate (exact prompt tokens) -> tokens/min bucket -> the key's concurrency slot
-> one gRPC stream into Triton with the key's tier as the engine priority. A streamed response sends
its headers with the first piece, so errors raised before any token (busy, bad input, unreachable)
still get their own status. The server runs with handler cancellation: a client that disconnects
cancels its handler, which closes the gRPC stream, which cancels the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from tritonllm_client.results import Piece

from tritonllm.openai.config import ANONYMOUS, ApiKey, FrontDoorConfig
from tritonllm.openai.errors import APIError, invalid
from tritonllm.openai.limits import Limiters
from tritonllm.openai.metrics import FrontDoorMetrics
from tritonllm.openai.output import Delta, OutputAssembler
from tritonllm.openai.protocol import GenerationRequest, PromptEncoder, RequestTranslator
from tritonllm.openai.responses import SSE_DONE, ResponseBuilder, sse, usage
from tritonllm.openai.tools import ToolCallStream
from tritonllm.openai.triton import TritonBackend

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE = 499  # nginx's status for a client that closed the connection (metrics only)
FINAL_STATUS = web.ResponseKey("final_status", int)  # a streamed outcome after its 200 headers (metrics)
UNFINISHED = {
    "abort": (503, "the generation was aborted (the server is stopping)"),
    "timeout": (504, "the generation timed out in the engine"),
    "error": (500, "the engine failed during generation"),
}


def model_max_len(model_dir: str, tokenizer: Any) -> int | None:
    """The context length: config.json's `max_position_embeddings`, else the tokenizer's limit."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
        if isinstance(value, int) and value > 1:
            return value
    except (OSError, ValueError):
        pass
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 1 < limit < 10**7 else None


def _log_if_server_error(exc: APIError) -> None:
    """A 5xx is the server's fault: the operator sees its cause in the log, not only the caller."""
    if exc.status >= 500:
        log.error("answered %d (%s): %s", exc.status, exc.code, exc.message)


def _error_response(exc: APIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers())


async def _until(pieces: AsyncIterator[Piece], deadline: float) -> AsyncIterator[Piece]:
    """The pieces, raising TimeoutError where the next one is awaited once `deadline` (loop time) passes."""
    async with contextlib.aclosing(pieces):
        while True:
            async with asyncio.timeout_at(deadline):
                piece = await anext(pieces, None)
            if piece is None:
                return
            yield piece


class _Timer:
    """Observes TTFT, ITLs and end-to-end latency of one request from its pieces' arrival times."""

    def __init__(self, metrics: FrontDoorMetrics, tier: str, started_s: float):
        self.metrics, self.tier, self.started_s = metrics, tier, started_s
        self.last_s: float | None = None
        self._itl = metrics.itl.labels(tier)  # looked up once, observed per token

    def piece(self, piece: Piece) -> None:
        if piece.num_tokens == 0:
            return
        if self.last_s is None:
            self.metrics.ttft.labels(self.tier).observe(piece.received_s - self.started_s)
        else:
            self._itl.observe(piece.received_s - self.last_s)
        self.last_s = piece.received_s

    def done(self) -> None:
        if self.last_s is not None:
            self.metrics.e2e.labels(self.tier).observe(self.last_s - self.started_s)


class FrontDoor:
    """The application: one tokenizer, one Triton channel, per-key limiters and metrics."""

    def __init__(self, config: FrontDoorConfig, tokenizer: Any, backend: TritonBackend | None = None):
        self.config = config
        self.encoder = PromptEncoder(tokenizer)
        max_len = config.max_model_len or model_max_len(config.tokenizer_dir, tokenizer)
        self.translator = RequestTranslator(self.encoder, max_len, config.served_model_name)
        self.backend = backend or TritonBackend(
            config.triton_url,
            config.triton_model,
            config.connect_timeout_s,
            config.retry_after_s,
            tokenizer_dir=config.tokenizer_dir,
        )
        self.metrics = FrontDoorMetrics()
        self.limiters = Limiters()
        self._anonymous = ApiKey(key="anonymous", name=ANONYMOUS, tier=config.keys.default_tier)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        await self.backend.close()

    # Keys.

    def authenticate(self, request: web.Request) -> ApiKey:
        if not self.config.auth_required:
            return self._anonymous
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                reason="unauthorized",
            )
        found = None
        for key in self.config.keys.keys:  # compare every key in constant time
            if hmac.compare_digest(key.key.encode(), token.encode()):
                found = key
        if found is None:
            raise APIError(401, "invalid API key", code="invalid_api_key", reason="unauthorized")
        return found

    # Plain endpoints.

    async def health(self, request: web.Request) -> web.Response:
        if await self.backend.ready():
            return web.json_response({"status": "ok", "model": self.config.served_model_name})
        return web.json_response(
            {"status": "unavailable", "triton": self.config.triton_url, "model": self.config.triton_model},
            status=503,
        )

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        try:
            self.authenticate(request)
        except APIError as exc:
            return _error_response(exc)
        model = {
            "id": self.config.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tritonllm",
        }
        return web.json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions", self.translator.completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat_completions", self.translator.chat)

    # Generation.

    async def _serve(
        self, request: web.Request, endpoint: str, parse: Callable[[dict[str, Any]], GenerationRequest]
    ) -> web.StreamResponse:
        started_s = time.perf_counter()
        tier = "none"
        status = CLIENT_GONE
        in_flight = None
        try:
            key = self.authenticate(request)
            tier = key.tier
            in_flight = self.metrics.in_flight.labels(tier)
            in_flight.inc()
            limiter = self.limiters.for_key(key)
            limiter.admit_request()
            gen = parse(await self._json(request))
            limiter.reserve_tokens(gen.prompt_tokens + gen.max_tokens)
            out = OutputAssembler(gen.stop, gen.max_tokens, gen.logprobs)
            try:
                async with limiter.slot():
                    response = await self._generate(request, gen, tier, out, started_s)
            finally:
                limiter.refund_tokens(gen.max_tokens - out.completion_tokens)
            status = response.get(FINAL_STATUS, response.status)
            self.metrics.tokens.labels("prompt", tier).inc(gen.prompt_tokens)
            self.metrics.tokens.labels("completion", tier).inc(out.completion_tokens)
            return response
        except APIError as exc:
            status = exc.status
            self.metrics.rejected.labels(exc.reason, tier).inc()
            _log_if_server_error(exc)
            return _error_response(exc)
        finally:
            self.metrics.requests.labels(endpoint, str(status), tier).inc()
            if in_flight is not None:
                in_flight.dec()

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise invalid("body", f"is not valid JSON: {exc}", "invalid_json") from None
        if not isinstance(body, dict):
            raise invalid("body", "must be a JSON object", "invalid_type")
        return body

    async def _generate(
        self, request: web.Request, gen: GenerationRequest, tier: str, out: OutputAssembler, started_s: float
    ) -> web.StreamResponse:
        builder = ResponseBuilder(gen.kind, self.config.served_model_name, gen.logprobs)
        timer = _Timer(self.metrics, tier, started_s)
        priority = self.config.keys.priority(tier)
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        generation = _until(self.backend.generate(gen.inputs, priority, builder.id), deadline)
        try:
            async with contextlib.aclosing(generation) as pieces:
                if gen.stream:
                    return await self._stream(request, gen, builder, out, timer, pieces)
                async for piece in pieces:
                    timer.piece(piece)
                    out.add(piece)
                    if out.stopped:
                        break
        except APIError as exc:
            if gen.tools is not None and exc.param == "response_format":  # the guide is the tool's schema
                exc.param = gen.tools.param
                exc.message = f"{exc.param}: the schema is invalid ({exc.message})"
            raise
        except TimeoutError:
            raise self._timed_out() from None
        finally:
            timer.done()
        out.finish()
        reason = out.finish_reason
        if reason in UNFINISHED:
            status, message = UNFINISHED[reason]
            raise APIError(status, message, type="server_error", code=reason, reason=reason)
        text = (gen.prompt if gen.echo else "") + out.text
        use = usage(gen.prompt_tokens, out.completion_tokens)
        tool_calls = None
        if gen.tools is not None:
            calls = gen.tools.stream()
            calls.push(text)
            tool_calls = calls.whole(complete=reason != "length")
            reason = calls.finish_reason(reason)
        return web.json_response(builder.whole(text, reason, out.logprobs, out.token_texts, use, tool_calls))

    async def _stream(
        self,
        request: web.Request,
        gen: GenerationRequest,
        builder: ResponseBuilder,
        out: OutputAssembler,
        timer: _Timer,
        pieces: AsyncIterator[Piece],
    ) -> web.StreamResponse:
        first = await anext(pieces, None)  # an error here still gets its own status
        response = _EventStream(headers=SSE_HEADERS)
        await response.prepare(request)
        events = _Events(request, response, self.config.request_timeout_s)
        calls = gen.tools.stream() if gen.tools is not None else None
        try:
            opening = gen.prompt if gen.echo else ""
            if calls is not None:
                events.add(builder.chunk(Delta(""), first=True, tool_calls=calls.opening()))
            elif gen.kind == "chat" or opening:
                events.add(builder.chunk(Delta(opening), first=True))
            try:
                await self._stream_pieces(events, builder, out, timer, first, pieces, calls)
            except (APIError, TimeoutError) as exc:  # after the headers: an SSE error event, as OpenAI sends
                error = exc if isinstance(exc, APIError) else self._timed_out()
                _log_if_server_error(error)
                events.add(error.body())
                events.done()
                await events.flush()
                response[FINAL_STATUS] = error.status
                return response
            reason = out.finish_reason
            if reason in UNFINISHED:
                status, message = UNFINISHED[reason]
                error = APIError(status, message, type="server_error", code=reason)
                _log_if_server_error(error)
                events.add(error.body())
                response[FINAL_STATUS] = status
            else:
                if calls is not None:
                    reason = self._finish_calls(events, builder, calls, reason)
                events.add(builder.chunk(Delta(""), finish_reason=reason))
            if gen.include_usage:
                events.add(builder.usage_chunk(usage(gen.prompt_tokens, out.completion_tokens)))
            events.done()
            await events.close()
        except ConnectionResetError:  # the client went away between pieces: closing the stream cancels
            response[FINAL_STATUS] = CLIENT_GONE
        return response

    def _timed_out(self) -> APIError:
        """The 504 of a request past its deadline: the same body whole or as a streamed error event."""
        return APIError(
            504,
            f"the request did not finish within {self.config.request_timeout_s:g}s",
            type="server_error",
            code="timeout",
            reason="timeout",
        )

    @staticmethod
    def _finish_calls(events: _Events, builder: ResponseBuilder, calls: ToolCallStream, reason: str) -> str:
        """The held-back end of the arguments; text that never formed a call goes out as content."""
        tail = calls.finish(complete=reason != "length")
        if tail:
            events.add(builder.chunk(Delta(""), tool_calls=tail))
        if calls.name is None and calls.text:
            events.add(builder.chunk(Delta(calls.text)))
        return calls.finish_reason(reason)

    @staticmethod
    async def _stream_pieces(
        events: _Events,
        builder: ResponseBuilder,
        out: OutputAssembler,
        timer: _Timer,
        first: Piece | None,
        pieces: AsyncIterator[Piece],
        calls: ToolCallStream | None = None,
    ) -> None:
        """Each piece's event is written as it comes (with the opening chunk and the headers for the
        first); after a stop string, the rest leaves with the closing events in one write."""
        piece = first
        while piece is not None:
            timer.piece(piece)
            delta = out.add(piece)
            if calls is not None:  # a forced tool call: the text becomes tool_calls deltas
                tool_deltas = calls.push(delta.text)
                if tool_deltas or delta.logprobs:
                    events.add(builder.chunk(delta, tool_calls=tool_deltas))
            elif delta.logprobs:
                events.add(builder.chunk(delta))
            elif delta.text:
                events.add_bytes(builder.content_event(delta.text))
            if out.stopped:
                return
            await events.flush()
            piece = await anext(pieces, None)
        tail = out.finish()
        if calls is not None:
            tool_deltas = calls.push(tail.text)
            if tool_deltas:
                events.add(builder.chunk(tail, tool_calls=tool_deltas))
        elif tail.text:
            events.add(builder.chunk(tail))


class _EventStream(web.StreamResponse):
    """The SSE response: its headers leave with the first events, in one write (aiohttp >= 3.12 reads
    this flag; an older one sends them at `prepare`, which is only one more write)."""

    _send_headers_immediately = False


class _ClientStalledError(ConnectionResetError):
    """The client stopped reading: a write waited `write_timeout_s` for its socket to drain."""


class _Events:
    """SSE events gathered and written together: one socket write per flush instead of one per event.

    Each write is bounded: a client that keeps its connection open but stops reading would otherwise
    hold its generation and its concurrency slot for ever once the socket buffers fill. Past the bound
    the connection is aborted and the write raises `_ClientStalledError`, a `ConnectionResetError`, so
    the stream ends as for a client that went away (the Triton stream is closed, the engine cancels).
    """

    def __init__(self, request: web.Request, response: web.StreamResponse, write_timeout_s: float):
        self.request = request
        self.response = response
        self.write_timeout_s = write_timeout_s
        self.parts: list[bytes] = []

    def add(self, event: dict[str, Any]) -> None:
        self.parts.append(sse(event))

    def add_bytes(self, data: bytes) -> None:
        self.parts.append(data)

    def done(self) -> None:
        self.parts.append(SSE_DONE)

    def _take(self) -> bytes:
        data = b"".join(self.parts)
        self.parts.clear()
        return data

    async def _write(self, data: bytes, eof: bool = False) -> None:
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await (self.response.write_eof(data) if eof else self.response.write(data))
        except TimeoutError:
            if self.request.transport is not None:
                self.request.transport.abort()
            raise _ClientStalledError(f"the client read nothing for {self.write_timeout_s:g}s") from None

    async def flush(self) -> None:
        if self.parts:
            await self._write(self._take())

    async def close(self) -> None:
        await self._write(self._take(), eof=True)
