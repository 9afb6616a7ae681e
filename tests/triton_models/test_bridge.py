"""The engine bridge with fake response channels: streaming, whole responses, errors, cancellation."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from triton_fixture import wait_for

from tritonllm.engine import EngineConfig
from tritonllm.triton.bridge import CANCEL_CHECKS_PER_S, EngineBridge, FinishedRequest, cancel_check_interval
from tritonllm.triton.tensors import EngineRequest, parse_engine_request

WAIT_S = 60.0


class FakeChannel:
    def __init__(self) -> None:
        self.responses: list[tuple[dict | None, str | None, bool]] = []
        self.done = threading.Event()
        self.cancelled = False
        self.checks = 0

    def send(self, outputs, error, final) -> None:
        assert not self.done.is_set(), "a response after the final one"
        self.responses.append((outputs, error, final))
        if final:
            self.done.set()

    def is_cancelled(self) -> bool:
        self.checks += 1
        return self.cancelled

    def tokens(self) -> list[int]:
        return [int(t) for out, _, _ in self.responses if out for t in out["output_ids"].reshape(-1)]


def request(prompt: list[int], max_tokens: int, **extra) -> list[EngineRequest]:
    """A one-row request as `EngineBridge.submit` takes it."""
    inputs = {
        "input_ids": np.array([prompt], dtype=np.int32),
        "input_lengths": np.array([[len(prompt)]], dtype=np.int32),
        "request_output_len": np.array([[max_tokens]], dtype=np.int32),
        "min_tokens": np.array([[max_tokens]], dtype=np.int32),  # no early EOS: lengths are predictable
    }
    inputs.update({k: np.array([[v]]) for k, v in extra.items()})
    return [parse_engine_request(inputs)]


@pytest.fixture(scope="module")
def bridge(tiny_llama_dir: Path):
    finished: list[FinishedRequest] = []
    b = EngineBridge(
        EngineConfig(model=str(tiny_llama_dir), tokens_per_block=4, num_kv_blocks=128, num_threads=1),
        on_finished=finished.append,
    )
    b.finished = finished  # type: ignore[attr-defined]
    yield b
    b.shutdown(drain_timeout_s=1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read back from /proc")
def test_engine_loop_and_sender_carry_their_names_at_the_os_level(bridge: EngineBridge) -> None:
    """So a profile of the `tensorrt_llm` stub can tell the engine's threads from the response sender's."""

    def os_name(thread: threading.Thread) -> str:
        return Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip()

    engine_thread = bridge.engine._thread  # type: ignore[attr-defined]
    assert wait_for(lambda: os_name(bridge._sender) == "tritonllm-send", WAIT_S)
    assert os_name(engine_thread) == "tritonllm-engin"  # named before the engine was built


def test_streaming_sends_one_response_per_token(bridge: EngineBridge) -> None:
    prompt = list(range(20, 32))
    chan = FakeChannel()
    bridge.submit("s1", request(prompt, 6, streaming=True), chan)
    assert chan.done.wait(WAIT_S)
    data = [r for r in chan.responses if r[0] is not None]
    assert len(data) == 6 and all(r[1] is None for r in chan.responses)
    assert chan.responses[-1][2]
    first = data[0][0]
    assert first["output_context_ids"].reshape(-1).tolist() == prompt[-8:]
    assert first["output_ids"].shape == (1, 1, 1) and first["sequence_length"].tolist() == [[1]]
    assert data[-1][0]["finish_reason"][0, 0] == "length"
    assert bridge.num_in_flight == 0


@pytest.mark.parametrize(("max_tokens", "sizes"), [(10, [1, 3, 3, 3]), (9, [1, 3, 3, 2])])
def test_stream_interval_sends_the_first_token_alone_then_chunks(
    bridge: EngineBridge, tiny_llama_dir: Path, max_tokens: int, sizes: list[int]
) -> None:
    """Same tokens, log-probs and context as one response per token, in fewer responses; the last
    response carries what is left and the final flag."""
    prompt = list(range(100, 112))
    per_token, chunked = FakeChannel(), FakeChannel()
    config = EngineConfig(model=str(tiny_llama_dir), tokens_per_block=4, num_kv_blocks=64, num_threads=1)
    with pytest.raises(ValueError, match="stream_interval"):
        EngineBridge(config, stream_interval=0)
    every3 = EngineBridge(config, stream_interval=3)
    try:
        for b, chan in ((bridge, per_token), (every3, chunked)):
            b.submit("i", request(prompt, max_tokens, streaming=True, return_log_probs=True), chan)
            assert chan.done.wait(WAIT_S)
    finally:
        every3.shutdown(drain_timeout_s=1)
    data = [out for out, error, _ in chunked.responses if out is not None and error is None]
    assert [out["output_ids"].size for out in data] == sizes and len(data) == len(chunked.responses)
    assert [out["sequence_length"].tolist() for out in data] == [[[n]] for n in sizes]
    assert [final for *_, final in chunked.responses] == [False] * (len(sizes) - 1) + [True]
    assert chunked.tokens() == per_token.tokens() and len(per_token.tokens()) == max_tokens

    def logprobs(chan: FakeChannel) -> list[float]:
        return [float(x) for out, _, _ in chan.responses if out for x in out["output_log_probs"].reshape(-1)]

    assert logprobs(chunked) == pytest.approx(logprobs(per_token))
    seen = prompt
    for out in data:  # each response's context is the 8 tokens before its own
        assert out["output_context_ids"].reshape(-1).tolist() == seen[-8:]
        seen = seen + out["output_ids"].reshape(-1).tolist()
    assert data[-1]["finish_reason"][0, 0] == "length"


def test_whole_response_matches_stream_and_includes_prompt(bridge: EngineBridge) -> None:
    prompt = list(range(40, 50))
    streamed, whole, excluded = FakeChannel(), FakeChannel(), FakeChannel()
    bridge.submit("a", request(prompt, 5, streaming=True), streamed)
    bridge.submit("b", request(prompt, 5), whole)
    bridge.submit("c", request(prompt, 5, exclude_input_in_output=True), excluded)
    for chan in (streamed, whole, excluded):
        assert chan.done.wait(WAIT_S)
    assert len(whole.responses) == 1 and whole.responses[0][2]
    assert whole.tokens() == prompt + streamed.tokens()
    assert excluded.tokens() == streamed.tokens()
    assert excluded.responses[0][0]["output_context_ids"].reshape(-1).tolist() == prompt[-8:]
    assert whole.responses[0][0]["output_context_ids"].size == 0


def test_invalid_request_gets_final_error_naming_tensor(bridge: EngineBridge) -> None:
    chan = FakeChannel()
    bridge.submit("too-long", request([5] * 10, 100_000), chan)
    assert chan.done.wait(1)
    ((outputs, error, final),) = chan.responses
    assert outputs is None and final and "'request_output_len'" in error


def test_client_cancellation_frees_blocks_within_a_step(bridge: EngineBridge) -> None:
    chan = FakeChannel()
    bridge.submit("long", request(list(range(60, 70)), 400, streaming=True), chan)
    assert wait_for(lambda: len(chan.responses) >= 3, WAIT_S)
    chan.cancelled = True
    assert chan.done.wait(5)
    assert len(chan.tokens()) < 400
    last, error, _ = chan.responses[-1]
    assert error is None and last["finish_reason"].reshape(-1)[0] == "abort", "the last response says why"
    # Stats are refreshed at the end of the step that aborted it.
    assert wait_for(lambda: bridge.engine.stats().kv_blocks_used == 0, 5)
    assert bridge.finished[-1].reason == "abort"


def test_cancellation_checks_share_a_budget_per_second(bridge: EngineBridge) -> None:
    """Each check is an IPC round trip: one request is checked every 50 ms, 32 every 0.32 s, so 32 streams
    cost about CANCEL_CHECKS_PER_S checks a second, not 640."""
    assert cancel_check_interval(0.05, 1) == 0.05
    assert cancel_check_interval(0.05, 32) == pytest.approx(32 / CANCEL_CHECKS_PER_S)
    channels = [FakeChannel() for _ in range(32)]
    start = time.monotonic()
    for i, chan in enumerate(channels):
        bridge.submit(f"budget{i}", request(list(range(60, 70)), 40, streaming=True), chan)
    assert all(chan.done.wait(WAIT_S) for chan in channels)
    elapsed = time.monotonic() - start
    checks = sum(chan.checks for chan in channels)
    assert checks <= CANCEL_CHECKS_PER_S * elapsed * 1.5 + len(channels), (checks, elapsed)


def test_stop_input_cancels_by_triton_request_id(bridge: EngineBridge) -> None:
    chan, stopper = FakeChannel(), FakeChannel()
    bridge.submit("victim", request(list(range(70, 80)), 400, streaming=True), chan)
    assert wait_for(lambda: bool(chan.responses), WAIT_S)
    stop = parse_engine_request(
        {
            "input_ids": np.array([[1]], dtype=np.int32),
            "input_lengths": np.array([[1]], dtype=np.int32),
            "request_output_len": np.array([[1]], dtype=np.int32),
            "stop": np.array([[True]]),
        }
    )
    bridge.submit("victim", [stop], stopper)
    assert stopper.done.is_set() and stopper.responses == [(None, None, True)]
    assert chan.done.wait(5) and len(chan.tokens()) < 400


def test_full_queue_rejects_at_once_with_busy_error(tiny_llama_dir: Path) -> None:
    rejected: list[bool] = []
    config = EngineConfig(
        model=str(tiny_llama_dir),
        tokens_per_block=4,
        num_kv_blocks=128,
        num_threads=1,
        max_num_seqs=1,
        max_waiting=1,
    )
    small = EngineBridge(config, on_rejected=lambda: rejected.append(True))
    try:
        running, waiting, third = FakeChannel(), FakeChannel(), FakeChannel()
        small.submit("run", request(list(range(20, 30)), 300, streaming=True), running)
        while not running.responses:
            time.sleep(0.005)
        small.submit("wait", request(list(range(30, 40)), 4), waiting)
        # ServingEngine counts its inbox plus the waiting queue as of the last step; a request taken
        # from the inbox during a step is counted by neither until the step ends, so wait for it.
        deadline = time.monotonic() + WAIT_S
        while small.engine.stats().num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        small.submit("third", request(list(range(40, 50)), 4), third)
        assert third.done.is_set(), "rejected at once, not queued"
        ((outputs, error, final),) = third.responses
        assert outputs is None and final and error.startswith("server busy") and rejected == [True]
        small.stop("run")
        assert running.done.wait(WAIT_S) and waiting.done.wait(WAIT_S)
        assert waiting.responses[-1][1] is None
    finally:
        small.shutdown(drain_timeout_s=1)
