"""The client-side rate limiter against the real server: throughput, token units, deadline."""

from __future__ import annotations

import asyncio
import time

import pytest
from tritonllm_client import (
    AsyncClient,
    Client,
    InvalidOptionError,
    RateLimit,
    RateLimitTimeoutError,
    SamplingOptions,
)

from tritonllm.triton.launcher import TritonServer

RATE = 20.0
SECONDS = 3.0


async def _throughput(server: TritonServer, limit: RateLimit, max_tokens: int) -> float:
    """Completions per second after the initial burst, all callers at once (slots never the bound).

    Measured between completions, so a request's latency cancels out (it only shifts both ends).
    """
    burst = int(limit.burst if limit.unit == "requests" else limit.burst // max_tokens)
    count = int(RATE * SECONDS) + burst
    options = SamplingOptions(max_tokens=max_tokens)
    done: list[float] = []

    async def one(client: AsyncClient, i: int) -> None:
        result = await client.generate(f"prompt {i}", options)
        assert result.output_tokens == max_tokens
        done.append(time.perf_counter())

    async with AsyncClient(url=server.grpc_url, max_concurrency=count, rate_limit=limit) as client:
        await asyncio.gather(*(one(client, i) for i in range(count)))
    done.sort()
    return (count - 1 - burst) / (done[-1] - done[burst])


@pytest.mark.parametrize(
    ("limit", "max_tokens"),
    [
        # burst 4: a bucket of 1 overflows whenever a waiter wakes late (timer jitter on a loaded machine)
        (RateLimit(rate=RATE, burst=4), 1),
        (RateLimit(rate=RATE * 4, burst=16, unit="tokens"), 4),  # 4 tokens per request: RATE requests/s
    ],
    ids=["requests", "tokens"],
)
def test_rate_limiter_throughput_within_10_percent(
    triton_server: TritonServer, limit: RateLimit, max_tokens: int
) -> None:
    measured = asyncio.run(_throughput(triton_server, limit, max_tokens))
    assert abs(measured - RATE) / RATE < 0.10, f"{measured:.2f} requests/s for a limit of {RATE}"


def test_rate_limiter_deadline_and_impossible_requests(triton_server: TritonServer) -> None:
    limit = RateLimit(rate=0.5, burst=1, timeout_s=0.3)
    with Client(url=triton_server.grpc_url, rate_limit=limit) as client:
        client.generate("first", SamplingOptions(max_tokens=1))  # takes the only token
        started = time.monotonic()
        with pytest.raises(RateLimitTimeoutError, match=r"did not admit the request within 0.3 s"):
            client.generate("second", SamplingOptions(max_tokens=1))
        assert 0.25 < time.monotonic() - started < 2.0
    tokens = RateLimit(rate=100, burst=8, unit="tokens")
    too_big = pytest.raises(InvalidOptionError, match="exceeds the rate limiter's burst")
    with Client(url=triton_server.grpc_url, rate_limit=tokens) as client, too_big:
        client.generate("too big", SamplingOptions(max_tokens=9))
