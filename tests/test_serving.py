"""The threaded serving API: concurrent submitters, streaming, callbacks, cancel, timeout, shutdown."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from engine_helpers import greedy, hf_greedy, make_engine, random_prompts

from tritonllm.engine import EngineBusyError, EngineConfig, EngineDeadError, FinishReason, InvalidRequestError
from tritonllm.engine.protocol import Engine
from tritonllm.engine.serving import ServingEngine

WAIT_S = 60.0


@pytest.fixture
def serving(tiny_llama_dir: Path):
    engine = ServingEngine(make_engine(tiny_llama_dir, max_num_batched_tokens=16))
    yield engine
    engine.shutdown()


def test_concurrent_submitters_get_hf_outputs(serving: ServingEngine, tiny_llama_dir: Path) -> None:
    prompts = random_prompts(12, vocab=512, seed=11)

    def run(i: int) -> list[int]:
        stream = serving.submit(f"r{i}", prompts[i], greedy(8))
        tokens = []
        for out in stream.outputs(WAIT_S):
            assert len(out.new_token_ids) <= 1
            tokens += out.new_token_ids
        return tokens

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(run, range(len(prompts))))
    assert results == [hf_greedy(tiny_llama_dir, p, 8) for p in prompts]
    assert serving.num_in_flight == 0


def test_serving_engine_satisfies_the_engine_protocol(serving: ServingEngine) -> None:
    assert isinstance(serving, Engine) and serving.alive


def test_callback_receives_every_token_then_final(serving: ServingEngine) -> None:
    seen = []
    done = threading.Event()

    def on_output(out) -> None:
        seen.append(out)
        if out.finished:
            done.set()

    serving.submit("cb", list(range(30, 45)), greedy(6), on_output=on_output)
    assert done.wait(WAIT_S)
    assert sum(len(o.new_token_ids) for o in seen) == 6 and seen[-1].finish_reason is FinishReason.LENGTH
    assert seen[-1].first_token_time_ns >= seen[-1].arrival_time_ns > 0


def test_cancel_mid_stream_frees_blocks(serving: ServingEngine) -> None:
    stream = serving.submit("long", list(range(30, 45)), greedy(200))
    outputs = stream.outputs(WAIT_S)
    next(outputs)
    assert serving.cancel("long")
    final = list(outputs)[-1]
    assert final.finished and final.finish_reason is FinishReason.ABORT and final.num_output_tokens < 200
    assert serving.engine.kv.block_table("long") == []
    assert not serving.cancel("long"), "nothing left to cancel"


def test_timeout_ends_request(serving: ServingEngine) -> None:
    result = serving.submit("slow", list(range(30, 45)), greedy(400), timeout_s=0.05).result(WAIT_S)
    assert result.finish_reason is FinishReason.TIMEOUT and len(result.token_ids) < 400


def test_bad_input_fails_alone(serving: ServingEngine, tiny_llama_dir: Path) -> None:
    good = serving.submit("good", list(range(30, 45)), greedy(5))
    with pytest.raises(InvalidRequestError, match="input_ids"):
        serving.submit("bad", [], greedy(5))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        serving.submit("too-long", [3] * 10, greedy(10_000))
    assert good.result(WAIT_S).token_ids == hf_greedy(tiny_llama_dir, list(range(30, 45)), 5)


def test_busy_when_waiting_queue_full(tiny_llama_dir: Path) -> None:
    serving = ServingEngine(make_engine(tiny_llama_dir, max_waiting=2, max_num_seqs=1))
    try:
        accepted, rejected = [], 0
        for i in range(20):
            try:
                accepted.append(serving.submit(str(i), list(range(30, 60)), greedy(30)))
            except EngineBusyError:
                rejected += 1
        assert rejected > 0
        assert all(s.result(WAIT_S).finish_reason is FinishReason.LENGTH for s in accepted)
    finally:
        serving.shutdown()


def test_shutdown_aborts_in_flight_and_refuses_new(tiny_llama_dir: Path) -> None:
    serving = ServingEngine(make_engine(tiny_llama_dir))
    stream = serving.submit("run", list(range(30, 45)), greedy(400))
    serving.shutdown(drain_timeout_s=0.0)
    assert stream.result(WAIT_S).finish_reason is FinishReason.ABORT
    with pytest.raises(EngineDeadError):
        serving.submit("late", [5, 6], greedy(2))


def test_shutdown_drains_within_bound(tiny_llama_dir: Path) -> None:
    serving = ServingEngine(make_engine(tiny_llama_dir))
    stream = serving.submit("short", list(range(30, 45)), greedy(4))
    serving.shutdown(drain_timeout_s=WAIT_S)
    assert stream.result(WAIT_S).finish_reason is FinishReason.LENGTH


def test_failed_step_fails_its_requests_only(serving: ServingEngine, monkeypatch) -> None:
    runner = serving.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def flaky(plan, tables):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real_execute(plan, tables)

    monkeypatch.setattr(runner, "execute", flaky)
    doomed = serving.submit("doomed", list(range(30, 45)), greedy(4))
    with pytest.raises(Exception, match="simulated kernel failure"):
        doomed.result(WAIT_S)
    assert serving.engine.kv.num_used_blocks == 0
    assert (
        serving.submit("after", list(range(30, 45)), greedy(4)).result(WAIT_S).finish_reason
        is FinishReason.LENGTH
    )


def test_engine_from_config_is_built_on_the_loop_thread(tiny_llama_dir: Path, monkeypatch) -> None:
    """Only the loop thread may run OpenMP regions: a second team stops libgomp spinning (2x slower)."""
    import tritonllm.engine.serving as serving_module

    built_on: list[str] = []

    class RecordingEngine(serving_module.LLMEngine):
        def __init__(self, config: EngineConfig) -> None:
            built_on.append(threading.current_thread().name)
            super().__init__(config)

    monkeypatch.setattr(serving_module, "LLMEngine", RecordingEngine)
    engine = ServingEngine(
        EngineConfig(model=str(tiny_llama_dir), tokens_per_block=4, num_kv_blocks=64, num_threads=1)
    )
    try:
        assert engine.submit("a", [1, 2, 3], greedy(4)).result(WAIT_S).token_ids == hf_greedy(
            tiny_llama_dir, [1, 2, 3], 4
        )
    finally:
        engine.shutdown()
    assert built_on == ["tritonllm-engine"]


def test_engine_build_error_is_raised_by_the_constructor(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="config.json|No such file|not found|does not exist"):
        ServingEngine(EngineConfig(model=str(tmp_path / "missing")))
    assert not any(t.name == "tritonllm-engine" and t.is_alive() for t in threading.enumerate())
