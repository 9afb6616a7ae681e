"""Production policies shared by all calls of one client: rate limit, retries, circuit breaker.

Built on well-kept libraries rather than our own: `aiolimiter` (a leaky bucket, equivalent to a token
bucket of capacity `burst` refilled at `rate`), `tenacity` (backoff with jitter) and `pybreaker`.
"""

from __future__ import annotations

import asyncio

import pybreaker
from aiolimiter import AsyncLimiter
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from tritonllm_client.errors import (
    RETRYABLE_ERRORS,
    CircuitOpenError,
    InvalidOptionError,
    RateLimitTimeoutError,
)
from tritonllm_client.options import BreakerPolicy, RateLimit, RetryPolicy


class RateLimiter:
    """A token bucket that waits up to its deadline, then raises `RateLimitTimeoutError`."""

    def __init__(self, limit: RateLimit):
        self.limit = limit
        self._bucket = AsyncLimiter(max_rate=limit.burst, time_period=limit.burst / limit.rate)

    async def acquire(self, max_tokens: int) -> None:
        amount = max_tokens if self.limit.unit == "tokens" else 1
        if amount > self.limit.burst:
            raise InvalidOptionError(
                f"max_tokens={max_tokens} exceeds the rate limiter's burst of {self.limit.burst:g} tokens:"
                " it could never be admitted"
            )
        try:
            async with asyncio.timeout(self.limit.timeout_s):
                await self._bucket.acquire(amount)
        except TimeoutError:
            raise RateLimitTimeoutError(
                f"rate limit of {self.limit.rate:g} {self.limit.unit}/s (burst {self.limit.burst:g}) did not"
                f" admit the request within {self.limit.timeout_s:g} s"
            ) from None


def retrying(policy: RetryPolicy) -> AsyncRetrying:
    """Retry only unavailable/busy errors; the caller raises them only before any token was streamed."""
    return AsyncRetrying(
        retry=retry_if_exception_type(RETRYABLE_ERRORS),
        stop=stop_after_attempt(policy.attempts),
        wait=wait_exponential_jitter(
            multiplier=policy.initial_backoff_s, max=policy.max_backoff_s, jitter=policy.jitter_s
        ),
        reraise=True,
    )


class CircuitBreaker:
    """Counts only unavailable/busy errors; any other outcome means the server answered."""

    def __init__(self, policy: BreakerPolicy):
        self._breaker = pybreaker.CircuitBreaker(
            fail_max=policy.failures,
            reset_timeout=policy.reset_timeout_s,
            exclude=[lambda exc: not isinstance(exc, RETRYABLE_ERRORS)],
            throw_new_error_on_trip=False,  # the caller sees the error that tripped it
        )

    @property
    def state(self) -> str:
        """'closed', 'open' or 'half-open'."""
        return self._breaker.current_state

    def guard(self):  # noqa: ANN201 (a pybreaker context manager)
        """Context manager around one attempt; raises `CircuitOpenError` while open."""
        return self._breaker.calling()

    @staticmethod
    def translate(exc: pybreaker.CircuitBreakerError) -> CircuitOpenError:
        return CircuitOpenError(f"circuit breaker open after repeated server failures: {exc}")
