"""Per-key admission: token buckets on requests/min and tokens/min, and a bounded concurrency gate.

A request is charged one request and `prompt + max_tokens` tokens when admitted (its real size is known
only at the end); the tokens it did not generate are given back when it finishes. Rejections are
immediate 429s with the time after which the bucket holds enough (`Retry-After`). Requests over the
concurrency cap wait in a bounded queue for at most `queue_timeout_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from tritonllm.openai.config import ApiKey, KeyLimits
from tritonllm.openai.errors import APIError, rate_limited


class TokenBucket:
    """`rate_per_s` refill up to `capacity`; `take` never blocks."""

    def __init__(self, rate_per_s: float, capacity: float, clock: Callable[[], float] = time.monotonic):
        if rate_per_s <= 0 or capacity <= 0:
            raise ValueError("rate_per_s and capacity must be > 0")
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self._clock = clock
        self._level = capacity
        self._updated = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._updated) * self.rate_per_s)
        self._updated = now

    def take(self, amount: float) -> float:
        """Take `amount` and return 0, or take nothing and return the seconds until it would fit."""
        self._refill()
        if self._level >= amount:
            self._level -= amount
            return 0.0
        return (amount - self._level) / self.rate_per_s

    def give_back(self, amount: float) -> None:
        self._refill()
        self._level = min(self.capacity, self._level + amount)


class ConcurrencyGate:
    """At most `limit` requests at once; up to `max_queue` more wait, each for at most `timeout_s`."""

    def __init__(self, limit: int, max_queue: int, timeout_s: float):
        self.limit = limit
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self._semaphore = asyncio.Semaphore(limit)
        self.waiting = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._semaphore.locked() and self.waiting >= self.max_queue:
            raise rate_limited(
                f"too many concurrent requests for this key (limit {self.limit}, {self.waiting} queued)",
                retry_after_s=1,
                reason="queue_full",
            )
        self.waiting += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._semaphore.acquire()
        except TimeoutError:
            raise rate_limited(
                f"waited {self.timeout_s:g}s for one of this key's {self.limit} concurrent slots",
                retry_after_s=1,
                reason="queue_timeout",
            ) from None
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._semaphore.release()


class KeyLimiter:
    """The buckets and gate of one key (absent where its limit is unlimited)."""

    def __init__(self, limits: KeyLimits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.requests = self._bucket(limits.requests_per_minute, limits.burst_s, clock)
        self.tokens = self._bucket(limits.tokens_per_minute, limits.burst_s, clock)
        self.gate = (
            ConcurrencyGate(limits.max_concurrency, limits.queue_bound, limits.queue_timeout_s)
            if limits.max_concurrency is not None
            else None
        )

    @staticmethod
    def _bucket(per_minute: float | None, burst_s: float, clock: Callable[[], float]) -> TokenBucket | None:
        if per_minute is None:
            return None
        return TokenBucket(per_minute / 60.0, max(1.0, per_minute * burst_s / 60.0), clock)

    def admit_request(self) -> None:
        if self.requests is None:
            return
        wait = self.requests.take(1)
        if wait > 0:
            raise rate_limited(
                f"rate limit of {self.limits.requests_per_minute:g} requests/min reached for this key",
                retry_after_s=wait,
                reason="requests_per_minute",
            )

    def reserve_tokens(self, amount: int) -> None:
        if self.tokens is None:
            return
        if amount > self.tokens.capacity:
            raise APIError(
                429,
                f"request needs {amount} tokens (prompt + max_tokens) but this key's limit of "
                f"{self.limits.tokens_per_minute:g} tokens/min holds at most {self.tokens.capacity:.0f}: "
                "lower max_tokens",
                type="rate_limit_error",
                param="max_tokens",
                code="rate_limit_exceeded",
                reason="tokens_per_minute",
            )
        wait = self.tokens.take(amount)
        if wait > 0:
            raise rate_limited(
                f"rate limit of {self.limits.tokens_per_minute:g} tokens/min reached for this key",
                retry_after_s=wait,
                reason="tokens_per_minute",
            )

    def refund_tokens(self, amount: int) -> None:
        if self.tokens is not None and amount > 0:
            self.tokens.give_back(amount)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.gate is None:
            yield
            return
        async with self.gate.slot():
            yield


class Limiters:
    """One KeyLimiter per key, made on first use (the anonymous caller shares one, unlimited)."""

    def __init__(self) -> None:
        self._by_key: dict[str, KeyLimiter] = {}

    def for_key(self, key: ApiKey) -> KeyLimiter:
        limiter = self._by_key.get(key.key)
        if limiter is None:
            limiter = self._by_key[key.key] = KeyLimiter(key.limits)
        return limiter
