"""Retries and the circuit breaker against a server of our own that is made busy, killed and restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from triton_fixture import start_server, tiny_server_options
from tritonllm_client import (
    AsyncClient,
    BreakerPolicy,
    CircuitOpenError,
    Client,
    GenerationInterruptedError,
    RetryPolicy,
    SamplingOptions,
    ServerBusyError,
    ServerUnavailableError,
)

from tritonllm.triton.launcher import TritonServer

RESTART_TIMEOUT_S = 240.0
LONG = SamplingOptions(max_tokens=64, min_tokens=64)


@pytest.fixture(scope="module")
def own_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """One running and one waiting request at most: a third concurrent request is refused as busy."""
    options = tiny_server_options(tiny_llama_dir, max_num_seqs=1, max_waiting=1, exit_timeout_s=2)
    server = start_server(options, tmp_path_factory.mktemp("own_triton") / "tritonserver.log")
    try:
        yield server
    finally:
        server.stop(timeout_s=10)


def crash(server: TritonServer) -> None:
    """SIGKILL the server's process group (a graceful `stop()` would drain: streams end with a reason)."""
    assert server.process is not None
    os.killpg(server.process.pid, signal.SIGKILL)  # started in its own session: pid == process group
    server.process.wait(timeout=30)
    server.stop()  # only cleans up: the process is gone


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_busy_errors_are_retried(own_server: TritonServer, protocol: str) -> None:
    url = own_server.grpc_url if protocol == "grpc" else own_server.http_url
    no_retry = RetryPolicy(attempts=1)
    patient = RetryPolicy(attempts=30, initial_backoff_s=0.05, max_backoff_s=0.5, jitter_s=0.05)
    lenient = BreakerPolicy(failures=1000)

    async def burst(retry: RetryPolicy) -> list[object]:
        async with AsyncClient(url=url, protocol=protocol, retry=retry, breaker=lenient) as client:
            calls = [client.generate(f"prompt {i}", LONG) for i in range(6)]
            return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(burst(no_retry))
    busy = [o for o in outcomes if isinstance(o, ServerBusyError)]
    assert busy and "busy" in str(busy[0])
    assert all(isinstance(o, ServerBusyError) or o.output_tokens == 64 for o in outcomes)  # type: ignore[union-attr]
    outcomes = asyncio.run(burst(patient))
    assert all(not isinstance(o, BaseException) and o.output_tokens == 64 for o in outcomes), outcomes  # type: ignore[union-attr]


def test_stop_and_restart(own_server: TritonServer) -> None:
    """A stream cut after tokens is not retried; retries carry a call over a restart; the breaker opens,
    fails fast while the server is down, and closes again after a successful probe."""
    patient = Client(
        url=own_server.grpc_url,
        retry=RetryPolicy(attempts=1000, initial_backoff_s=0.1, max_backoff_s=1.0),
        breaker=BreakerPolicy(failures=100_000),
        request_timeout_s=RESTART_TIMEOUT_S,
        count_prompt_tokens=True,  # its extra preprocessing call is retried too
    )
    fragile = Client(
        url=own_server.grpc_url,
        retry=RetryPolicy(attempts=1),
        breaker=BreakerPolicy(failures=2, reset_timeout_s=1.0),
    )
    with patient, fragile:
        stream = iter(patient.stream("The quick brown fox", SamplingOptions(max_tokens=400, min_tokens=400)))
        next(stream)
        crash(own_server)  # the stream breaks after tokens were received
        with pytest.raises(GenerationInterruptedError, match="after tokens were streamed"):
            for _ in stream:
                pass

        for _ in range(2):
            with pytest.raises(ServerUnavailableError):
                fragile.generate("hello", SamplingOptions(max_tokens=2))
        started = time.monotonic()
        with pytest.raises(CircuitOpenError):
            fragile.generate("hello", SamplingOptions(max_tokens=2))
        assert time.monotonic() - started < 0.1 and fragile.breaker.state == "open"

        outcome: dict[str, object] = {}

        def call_across_restart() -> None:
            try:
                outcome["result"] = patient.generate("hello", SamplingOptions(max_tokens=4, min_tokens=4))
            except Exception as exc:  # reported by the assertion below
                outcome["error"] = exc

        caller = threading.Thread(target=call_across_restart)
        caller.start()
        own_server.start()  # same options, same ports
        own_server.wait_ready(RESTART_TIMEOUT_S)
        caller.join(RESTART_TIMEOUT_S)
        assert not caller.is_alive() and "error" not in outcome, outcome
        assert outcome["result"].output_tokens == 4 and outcome["result"].prompt_tokens > 0  # type: ignore[attr-defined]

        # The reset timeout has long passed: the next call is the half-open probe, and it closes the breaker.
        assert fragile.generate("hello", SamplingOptions(max_tokens=2)).output_tokens == 2
        assert fragile.breaker.state == "closed"
