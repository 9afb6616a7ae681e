"""Retries and the circuit breaker against a server of our own that is made busy, killed and restarted."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_test_helpers import ABORTED, metric, wait_for
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


class TcpProxy:
    """A real TCP hop to the server whose `cut()` drops every connection, as a network failure would.

    (Killing the server instead would leak its Python backend's /dev/shm regions.)
    """

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:  # closed by cut()
                return
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
            self.sockets += [downstream, upstream]
            for src, dst in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)

    def cut(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_stream_cut_after_tokens_is_not_retried(own_server: TritonServer) -> None:
    proxy = TcpProxy(own_server.grpc_url)
    aborted = metric(own_server.metrics_url, ABORTED)
    retry = RetryPolicy(attempts=10, initial_backoff_s=0.01, max_backoff_s=0.05)
    with Client(url=proxy.url, model="tensorrt_llm_bls", retry=retry) as client:
        stream = iter(client.stream("The quick brown fox", SamplingOptions(max_tokens=500, min_tokens=500)))
        next(stream)
        proxy.cut()
        started = time.monotonic()
        with pytest.raises(GenerationInterruptedError, match="after tokens were streamed"):
            for _ in stream:
                pass
        assert time.monotonic() - started < 5  # no retries (they would fail for ~0.3 s at least)
    # The server saw the client go: the BLS aborted the generation.
    assert wait_for(lambda: metric(own_server.metrics_url, ABORTED) == aborted + 1, timeout_s=10)


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
    """Retries carry a call over a restart; the breaker opens, fails fast while the server is down, and
    closes again after a successful probe."""
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
        own_server.stop()
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
