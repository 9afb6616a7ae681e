"""The library against the real tritonserver: both models, both protocols, sync and asyncio."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
from client_test_helpers import ABORTED, KV_USED, metric, wait_for
from triton_fixture import free_ports
from tritonllm_client import (
    AsyncClient,
    BreakerPolicy,
    CircuitOpenError,
    Client,
    InvalidOptionError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTimeoutError,
    RetryPolicy,
    SamplingOptions,
    ServerUnavailableError,
)

from tritonllm.triton.launcher import TritonServer
from tritonllm.triton.text import TextCodec

MODELS = ("ensemble", "tensorrt_llm_bls")
PROTOCOLS = ("grpc", "http")
PROMPT = "The quick brown fox"
# min_tokens = max_tokens: the random tiny model must not stop early, so counts are known exactly.
FIXED = SamplingOptions(max_tokens=12, min_tokens=12, return_log_probs=True)


def url(server: TritonServer, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


def client(server: TritonServer, protocol: str, model: str = "ensemble", **fields: object) -> Client:
    return Client(url=url(server, protocol), protocol=protocol, model=model, **fields)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_generate_and_stream_agree_with_exact_counts(
    triton_server: TritonServer, tiny_llama_dir: Path, protocol: str, model: str
) -> None:
    prompt_len = len(TextCodec(str(tiny_llama_dir)).encode(PROMPT))
    with client(triton_server, protocol, model, count_prompt_tokens=True) as c:
        whole = c.generate(PROMPT, FIXED)
        generation = c.stream(PROMPT, FIXED)
        chunks = list(generation)
    streamed = generation.result
    assert streamed is not None
    assert whole.text and streamed.text == whole.text == "".join(ch.text for ch in chunks)
    for result in (whole, streamed):
        assert result.output_tokens == 12 and result.prompt_tokens == prompt_len
        assert result.finish_reason == "length"
        assert result.log_probs is not None and len(result.log_probs) == 12
        assert all(lp <= 0 for lp in result.log_probs)
        assert math.isclose(sum(result.log_probs), result.cum_log_prob, rel_tol=1e-4, abs_tol=1e-4)
        assert 0 < result.ttft_s <= result.e2e_s and result.tokens_per_s > 0
    assert sum(ch.num_tokens for ch in chunks) == 12
    assert len(streamed.itls_s) == len(chunks) - 1 > 0 and all(x >= 0 for x in streamed.itls_s)
    assert whole.itls_s == [] and whole.ttft_s == whole.e2e_s  # one response: no token timings


def test_protocols_and_models_give_the_same_greedy_text(triton_server: TritonServer) -> None:
    texts = set()
    for protocol in PROTOCOLS:
        for model in MODELS:
            with client(triton_server, protocol, model) as c:
                texts.add(c.generate(PROMPT, SamplingOptions(max_tokens=10), stream=True).text)
    assert len(texts) == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_client_generate_stream_and_health(triton_server: TritonServer, protocol: str) -> None:
    async def main() -> None:
        async with AsyncClient(url=url(triton_server, protocol), protocol=protocol) as c:
            results = await asyncio.gather(*(c.generate(f"{PROMPT} {i}", FIXED) for i in range(4)))
            generation = c.stream(PROMPT, FIXED)
            pieces = [chunk.text async for chunk in generation]
            health = await c.health()
            missing = await c.health("no_such_model")
        assert all(r.output_tokens == 12 for r in results)
        assert generation.result is not None and "".join(pieces) == generation.result.text
        assert health["server_live"] and health["server_ready"] and health["model_ready"]
        assert {i["name"] for i in health["model_metadata"]["inputs"]} >= {"text_input", "max_tokens"}
        assert not missing["model_ready"] and missing["model_metadata"] is None

    asyncio.run(main())


def test_chat_template_sampling_seed_and_stop_words(triton_server: TritonServer) -> None:
    with client(triton_server, "grpc", "tensorrt_llm_bls", count_prompt_tokens=True) as c:
        plain = c.generate(PROMPT, SamplingOptions(max_tokens=4))
        chat = c.generate(PROMPT, SamplingOptions(max_tokens=4), chat=True)
        assert chat.prompt_tokens is not None and plain.prompt_tokens is not None
        assert chat.prompt_tokens > plain.prompt_tokens  # wrapped as a user turn
        sampled = SamplingOptions(max_tokens=16, min_tokens=16, temperature=1.0, top_k=50, seed=123)
        first, again = (c.generate(PROMPT, sampled).text for _ in range(2))
        others = {
            c.generate(PROMPT, SamplingOptions(**{**sampled.__dict__, "seed": s})).text for s in range(4)
        }
        assert first == again and len(others | {first}) > 1
        greedy = [chunk.text for chunk in c.stream(PROMPT, SamplingOptions(max_tokens=16, min_tokens=16))]
        stop = greedy[1]  # one streamed token of the greedy output (with its leading space, if any)
        stopped = c.generate(PROMPT, SamplingOptions(max_tokens=16, stop_words=(stop,)))
        assert stopped.finish_reason == "stop"
        assert stopped.text == "".join(greedy[: greedy.index(stop) + 1])  # the stop word is included


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_abandoned_stream_is_cancelled_on_the_server(triton_server: TritonServer, protocol: str) -> None:
    """Leaving the loop early cancels the generation: the BLS aborts it and frees its KV blocks."""
    metrics = triton_server.metrics_url
    aborted = metric(metrics, ABORTED)
    long = SamplingOptions(max_tokens=500, min_tokens=500)
    with client(triton_server, protocol, "tensorrt_llm_bls") as c:
        for _ in c.stream(PROMPT, long):
            break  # 499 tokens still to generate: the abort counter shows it was cut short
        assert wait_for(lambda: metric(metrics, ABORTED) == aborted + 1, timeout_s=5)
        assert wait_for(lambda: metric(metrics, KV_USED) == 0, timeout_s=5)


def test_async_cancel_aclose_and_timeout_cancel_on_the_server(triton_server: TritonServer) -> None:
    metrics = triton_server.metrics_url
    aborted = metric(metrics, ABORTED)
    long = SamplingOptions(max_tokens=500, min_tokens=500)

    async def main() -> None:
        async with AsyncClient(url=triton_server.grpc_url, model="tensorrt_llm_bls") as c:
            first_chunk = asyncio.Event()

            async def consume() -> None:
                async for _ in c.stream(PROMPT, long):
                    first_chunk.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first_chunk.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            generation = c.stream(PROMPT, long)
            await anext(aiter(generation))
            await generation.aclose()
            assert generation.result is None
        async with AsyncClient(
            url=triton_server.grpc_url, model="tensorrt_llm_bls", request_timeout_s=0.3
        ) as c:
            with pytest.raises(RequestTimeoutError, match="timed out after 0.3 s"):
                await c.generate(PROMPT, long, stream=True)

    asyncio.run(main())
    assert wait_for(lambda: metric(metrics, ABORTED) == aborted + 3, timeout_s=5)
    assert wait_for(lambda: metric(metrics, KV_USED) == 0, timeout_s=5)


def test_concurrency_slots_bound_in_flight_requests(triton_server: TritonServer) -> None:
    """With one slot, a second request waits for the first and times out while it holds the slot."""
    with client(triton_server, "grpc", "tensorrt_llm_bls", max_concurrency=1, request_timeout_s=3.0) as c:
        holder = iter(c.stream(PROMPT, SamplingOptions(max_tokens=400, min_tokens=400)))
        next(holder)
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError, match="concurrency slot"):
            c.generate(PROMPT, SamplingOptions(max_tokens=2))
        assert time.monotonic() - started >= 2.9
        holder.close()  # frees the slot (and cancels the stream)
        assert c.generate(PROMPT, SamplingOptions(max_tokens=2)).output_tokens == 2


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_clear_errors(triton_server: TritonServer, protocol: str) -> None:
    missing = client(triton_server, protocol, "no_such_model", retry=RetryPolicy(attempts=1))
    with missing as c, pytest.raises(ModelNotFoundError, match="no_such_model"):
        c.generate(PROMPT, SamplingOptions(max_tokens=2))
    with client(triton_server, protocol) as c, pytest.raises(InvalidRequestError, match="max_tokens"):
        c.generate(PROMPT, SamplingOptions(max_tokens=100_000))
    with pytest.raises(InvalidOptionError, match="^top_p:"):
        SamplingOptions(top_p=2.0)
    (port,) = free_ports(1)
    started = time.monotonic()
    with Client(url=f"127.0.0.1:{port}", protocol=protocol, retry=RetryPolicy(attempts=1)) as c:
        with pytest.raises(ServerUnavailableError, match=f"127.0.0.1:{port}|Connection refused|connect"):
            c.generate(PROMPT)
        with pytest.raises(ServerUnavailableError):
            c.health()
    assert time.monotonic() - started < 10


def test_breaker_fails_fast_then_probes() -> None:
    """Unreachable: two failures open the breaker; it then fails without connecting, and probes later."""
    (port,) = free_ports(1)
    policy = BreakerPolicy(failures=2, reset_timeout_s=0.5)
    retry = RetryPolicy(attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02, jitter_s=0.0)
    with Client(url=f"127.0.0.1:{port}", retry=retry, breaker=policy) as c, pytest.raises(CircuitOpenError):
        c.generate(PROMPT)  # attempt 2 of 3 trips the breaker, attempt 3 fails fast (and is not retried)
    with Client(url=f"127.0.0.1:{port}", retry=RetryPolicy(attempts=1), breaker=policy) as c:
        for _ in range(policy.failures):
            with pytest.raises(ServerUnavailableError):
                c.generate(PROMPT)
        assert c.breaker.state == "open"
        started = time.monotonic()
        with pytest.raises(CircuitOpenError, match="circuit breaker open"):
            c.generate(PROMPT)
        assert time.monotonic() - started < 0.1
        assert wait_for(lambda: _probe_fails_unavailable(c), timeout_s=5, step_s=0.1)
        assert c.breaker.state == "open"  # the half-open probe failed: open again


def _probe_fails_unavailable(c: Client) -> bool:
    try:
        c.generate(PROMPT)
    except CircuitOpenError:
        return False
    except ServerUnavailableError:
        return True
    return False
