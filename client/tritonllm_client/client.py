"""`AsyncClient` (asyncio) and `Client` (sync, thread-safe): generate and stream with the client's policies.

Every call goes: concurrency slot (bounded, within the request timeout) -> per attempt: rate limiter ->
circuit breaker -> transport, retried with backoff while no token has arrived. The sync `Client` runs one
`AsyncClient` on a private event loop thread, so both share one implementation and the same policies.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import pybreaker

from tritonllm_client.errors import (
    RETRYABLE_ERRORS,
    ClientError,
    GenerationInterruptedError,
    RequestTimeoutError,
)
from tritonllm_client.options import ClientConfig, SamplingOptions
from tritonllm_client.policies import CircuitBreaker, RateLimiter, retrying
from tritonllm_client.results import Chunk, GenerationResult, Piece, ResultBuilder
from tritonllm_client.transport import GrpcTransport, HttpTransport, Transport

T = TypeVar("T")


class Generation:
    """An in-flight streamed generation: iterate its chunks; `result` is set once it finished."""

    def __init__(self, chunks: AsyncIterator[Chunk], builder: ResultBuilder):
        self._chunks = chunks
        self._builder = builder
        self.result: GenerationResult | None = None

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Chunk]:
        try:
            async for chunk in self._chunks:
                yield chunk
            self.result = self._builder.result()
        finally:  # also when this iterator is closed or dropped early: cancel the request now
            await self._chunks.aclose()  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        """Stop early: cancels the request on the server."""
        await self._chunks.aclose()  # type: ignore[attr-defined]


class AsyncClient:
    """Generate against `ensemble` or `tensorrt_llm_bls` over gRPC or HTTP. Use as `async with`."""

    def __init__(self, config: ClientConfig | None = None, **config_fields: Any):
        self.config = config or ClientConfig(**config_fields)
        transport_cls = GrpcTransport if self.config.protocol == "grpc" else HttpTransport
        self.transport: Transport = transport_cls(self.config.url, self.config.connect_timeout_s)
        self._slots = asyncio.Semaphore(self.config.max_concurrency)
        self.rate_limiter = RateLimiter(self.config.rate_limit) if self.config.rate_limit else None
        self.breaker = CircuitBreaker(self.config.breaker)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.transport.close()

    async def health(self, model: str | None = None) -> dict[str, Any]:
        """Server liveness/readiness and the model's readiness and metadata."""
        report = await self.transport.health(model or self.config.model)
        return {"url": self.config.url, "protocol": self.config.protocol, **report}

    async def generate(
        self, prompt: str, options: SamplingOptions | None = None, *, chat: bool = False, stream: bool = False
    ) -> GenerationResult:
        """The whole generation. `stream=True` streams underneath to measure time to first token and ITLs."""
        generation = self._start(prompt, options or SamplingOptions(), chat=chat, streaming=stream)
        async for _ in generation:
            pass
        assert generation.result is not None
        return generation.result

    def stream(
        self, prompt: str, options: SamplingOptions | None = None, *, chat: bool = False
    ) -> Generation:
        """Chunks as they are generated; breaking out (or `aclose()`) cancels the request on the server."""
        return self._start(prompt, options or SamplingOptions(), chat=chat, streaming=True)

    def _start(self, prompt: str, options: SamplingOptions, *, chat: bool, streaming: bool) -> Generation:
        if not isinstance(prompt, str) or not prompt:
            raise ClientError("prompt must be a non-empty string")
        builder = ResultBuilder(uuid.uuid4().hex, self.config.model, options.return_log_probs)
        return Generation(self._chunks(prompt, options, chat, streaming, builder), builder)

    async def _chunks(
        self, prompt: str, options: SamplingOptions, chat: bool, streaming: bool, builder: ResultBuilder
    ) -> AsyncIterator[Chunk]:
        deadline = time.monotonic() + self.config.request_timeout_s
        parameters = {"apply_chat_template": True} if chat else {}
        inputs = {
            "text_input": prompt,
            **options.inputs(),
            "stream": streaming,
            "exclude_input_in_output": True,
            "return_num_output_tokens": True,
        }
        await self._bounded(self._slots.acquire(), deadline, "waiting for a concurrency slot")
        try:
            pieces, first = await self._open(inputs, parameters, options, builder, deadline)
            try:
                yield builder.add(first)
                while True:
                    try:
                        piece = await self._bounded(anext(pieces), deadline, "streaming", streamed=True)
                    except StopAsyncIteration:
                        return
                    yield builder.add(piece)
            finally:
                await pieces.aclose()  # type: ignore[attr-defined]
        finally:
            self._slots.release()

    async def _open(
        self,
        inputs: dict[str, Any],
        parameters: dict[str, Any],
        options: SamplingOptions,
        builder: ResultBuilder,
        deadline: float,
    ) -> tuple[AsyncIterator[Piece], Piece]:
        """Send the request and wait for its first response, retrying only while nothing was received."""
        async for attempt in retrying(self.config.retry):
            with attempt:
                if self.rate_limiter is not None:
                    await self._bounded(self.rate_limiter.acquire(options.max_tokens), deadline, "rate limit")
                try:
                    with self.breaker.guard():
                        if self.config.count_prompt_tokens and builder.prompt_tokens is None:
                            count = self.transport.prompt_tokens(inputs["text_input"], parameters)
                            builder.prompt_tokens = await self._bounded(
                                count, deadline, "counting prompt tokens"
                            )
                        builder.sent_s = time.perf_counter()
                        pieces = self.transport.generate(
                            self.config.model, inputs, parameters, builder.request_id
                        )
                        try:
                            first = await self._bounded(
                                anext(pieces), deadline, "waiting for the first token"
                            )
                        except BaseException:
                            await pieces.aclose()  # type: ignore[attr-defined]
                            raise
                except pybreaker.CircuitBreakerError as exc:
                    raise CircuitBreaker.translate(exc) from None
        return pieces, first

    async def _bounded(self, awaitable: Any, deadline: float, what: str, streamed: bool = False) -> Any:
        """Await within the request's deadline; errors after streamed tokens are never retryable."""
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            # Not `asyncio.wait_for`: on 3.11 it can swallow a cancellation that races a completion.
            async with asyncio.timeout(remaining):
                return await awaitable
        except TimeoutError:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise RequestTimeoutError(
                f"request timed out after {self.config.request_timeout_s:g} s ({what}); cancelled"
            ) from None
        except RETRYABLE_ERRORS as exc:
            if streamed:
                raise GenerationInterruptedError(f"failed after tokens were streamed: {exc}") from exc
            raise


class Client:
    """Synchronous, thread-safe facade over one `AsyncClient` running on a private event loop thread."""

    def __init__(self, config: ClientConfig | None = None, **config_fields: Any):
        config = config or ClientConfig(**config_fields)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tritonllm-client", daemon=True)
        self._thread.start()
        self._async = self._run(self._make(config))

    @staticmethod
    async def _make(config: ClientConfig) -> AsyncClient:
        return AsyncClient(config)  # created on the loop: its semaphore and channels belong to it

    @property
    def config(self) -> ClientConfig:
        return self._async.config

    @property
    def breaker(self) -> CircuitBreaker:
        return self._async.breaker

    def _submit(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Any) -> Any:
        return self._submit(coro).result()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._async.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def health(self, model: str | None = None) -> dict[str, Any]:
        return self._run(self._async.health(model))

    def generate(
        self, prompt: str, options: SamplingOptions | None = None, *, chat: bool = False, stream: bool = False
    ) -> GenerationResult:
        return self._run(self._async.generate(prompt, options, chat=chat, stream=stream))

    def stream(
        self, prompt: str, options: SamplingOptions | None = None, *, chat: bool = False
    ) -> SyncGeneration:
        return SyncGeneration(self, self._async.stream(prompt, options, chat=chat))


class SyncGeneration:
    """Iterator over a streamed generation; `close()` (or leaving a `for` loop early) cancels it."""

    def __init__(self, client: Client, generation: Generation):
        self._client = client
        self._generation = generation
        self._chunks = generation.__aiter__()

    @property
    def result(self) -> GenerationResult | None:
        return self._generation.result

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while True:
                try:
                    yield self._client._run(anext(self._chunks))
                except StopAsyncIteration:
                    return
        finally:
            self.close()

    def close(self) -> None:
        if not self._client._loop.is_closed():
            self._client._run(self._chunks.aclose())  # type: ignore[attr-defined]
