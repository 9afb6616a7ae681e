"""The engine's request API: validation, busy rejection, priorities, cancellation, statistics."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy, hf_greedy, make_engine

from tritonllm.engine import EngineBusyError, EngineConfig, FinishReason, InvalidRequestError, model_runner
from tritonllm.model import quant
from tritonllm.model.cpu_kernels import load_kernels, selected_isa

PROMPT = list(range(50, 70))


@pytest.mark.parametrize(
    ("field", "prompt", "max_tokens"),
    [
        ("input_ids", [], 4),
        ("input_ids", [5, 512, 6], 4),  # vocabulary is 512
        ("input_ids", [5, -1], 4),
        ("input_ids", [7] * 64, 4),  # limit below is 64
        ("max_tokens", [7] * 60, 5),
    ],
)
def test_bad_requests_name_the_field(
    tiny_llama_dir: Path, field: str, prompt: list[int], max_tokens: int
) -> None:
    engine = make_engine(tiny_llama_dir, max_model_len=64)
    with pytest.raises(InvalidRequestError, match=field):
        engine.add_request("bad", prompt, greedy(max_tokens))
    assert engine.generate([PROMPT], greedy(3))[0] == hf_greedy(tiny_llama_dir, PROMPT, 3), (
        "engine still works"
    )


def test_duplicate_request_id_and_unknown_stop_ids(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    engine.add_request("x", PROMPT, greedy(3))
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request("x", PROMPT, greedy(3))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.add_request("y", PROMPT, greedy(3, stop_token_ids=[[1, 100_000]]))


def test_impossible_limits_are_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(tiny_llama_dir, num_kv_blocks=4, max_model_len=64)  # 4 blocks of 4 hold 16 tokens
    with pytest.raises(ValueError, match="tokens_per_block"):
        EngineConfig(model=str(tiny_llama_dir), tokens_per_block=0)
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=str(tiny_llama_dir), quantization="int3")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", kv_cache_dtype="float32")


def test_kv_cache_is_smaller_under_int8_where_the_kernels_run(tiny_llama_dir: Path) -> None:
    """fp32 stays the exact reference (KV included); int8 on the CPU kernels keeps its KV in bf16, or as int8
    rows on the amx build (its decode steps wait on the cache), and an explicit bf16 cache under fp32
    activations is allowed everywhere."""
    config = partial(EngineConfig, model=str(tiny_llama_dir))
    assert config(dtype="float32").kv_cache_dtype == "float32"
    assert config(dtype="bfloat16").kv_cache_dtype == "bfloat16"
    on_kernels = load_kernels() is not None
    under_int8 = ("int8" if selected_isa() == "amx" else "bfloat16") if on_kernels else "float32"
    assert config(quantization="int8").kv_cache_dtype == under_int8
    assert config(quantization="int4", dtype="auto").kv_cache_dtype == under_int8
    assert config(kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    engine = make_engine(tiny_llama_dir, quantization="int8", kv_cache_dtype="bfloat16")
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    stats = engine.stats()
    assert (stats.dtype, stats.quantization, stats.kv_cache_dtype) == ("float32", "int8", "bfloat16")
    assert len(engine.generate([PROMPT], greedy(8))[0]) == 8


def test_int7_warns_where_it_runs_as_int8(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """int7 is only faster on the kernel builds without VNNI (avx2, avx512); elsewhere the engine says at
    start that int8 would be as fast and more accurate, and runs int7 all the same."""
    caplog.set_level(logging.WARNING, logger="tritonllm.engine.model_runner")
    fast = load_kernels() is not None and selected_isa() in ("avx2", "avx512")  # the builds without VNNI
    assert quant.int7_runs_as_int8(torch.device("cpu")) is not fast
    make_engine(tiny_llama_dir, quantization="int7")
    assert ("gains no speed" in caplog.text) is not fast
    caplog.clear()
    monkeypatch.setattr(model_runner, "int7_runs_as_int8", lambda device: True)  # as on a VNNI or AMX build
    engine = make_engine(tiny_llama_dir, quantization="int7")
    assert "quantization=int7 gains no speed" in caplog.text
    assert len(engine.generate([PROMPT], greedy(4))[0]) == 4


def test_int8_kv_cache_holds_twice_the_tokens_of_bf16_in_the_same_memory(tiny_llama_dir: Path) -> None:
    """int8 rows are head_dim bytes and a 4-byte scale (model/kv_rows.py); allowed under fp32 and bf16
    activations, refused under fp16, where the kernels take no int8 cache."""
    budget = 1 << 20
    pools = {
        kv: make_engine(tiny_llama_dir, kv_cache_dtype=kv, num_kv_blocks=None, kv_cache_memory_bytes=budget)
        for kv in ("bfloat16", "int8")
    }
    head_dim = pools["int8"].runner.args.head_dim
    assert pools["int8"].runner.kv_cache.dtype == torch.int8
    assert pools["int8"].runner.kv_cache.shape[-1] == head_dim + 4
    ratio = pools["int8"].runner.num_blocks / pools["bfloat16"].runner.num_blocks
    assert ratio == pytest.approx(2 * head_dim / (head_dim + 4), rel=0.01)
    assert pools["int8"].stats().kv_cache_dtype == "int8"
    assert len(pools["int8"].generate([PROMPT], greedy(8))[0]) == 8
    assert (
        EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", kv_cache_dtype="int8").kv_cache_dtype
        == "int8"
    )
    with pytest.raises(ValueError, match="int8 under float32 or bfloat16"):
        EngineConfig(model=str(tiny_llama_dir), dtype="float16", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model=str(tiny_llama_dir), kv_cache_dtype="fp8")


def test_full_waiting_queue_rejects_with_busy(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, max_waiting=3)
    for i in range(3):
        engine.add_request(str(i), PROMPT, greedy(2))
    with pytest.raises(EngineBusyError, match="busy"):
        engine.add_request("over", PROMPT, greedy(2))
    engine.step()  # admits the waiting requests: room again
    engine.add_request("later", PROMPT, greedy(2))


def test_priority_orders_admission(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, max_num_seqs=1)
    engine.add_request("low", PROMPT, greedy(2), priority=5)
    engine.add_request("high", PROMPT[:10], greedy(2), priority=0)
    engine.add_request("mid", PROMPT[:12], greedy(2), priority=1)
    order = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
    assert order == ["high", "mid", "low"]


def test_preemption_takes_lowest_priority_newest(tiny_llama_dir: Path) -> None:
    # 12 blocks of 4 tokens: three 12-token prompts fill 9 blocks; decoding soon needs more.
    engine = make_engine(tiny_llama_dir, num_kv_blocks=12, max_model_len=48)
    for rid, priority in (("a", 0), ("b", 2), ("c", 2)):
        engine.add_request(rid, list(range(100 + priority, 112 + priority)), greedy(20), priority=priority)
    preempted_first = None
    while engine.has_unfinished():
        engine.step()
        if preempted_first is None and engine.scheduler.num_preemptions:
            preempted_first = next(s.request_id for s in engine._requests.values() if s.num_preemptions)
    assert preempted_first == "c"
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding"])
def test_abort_frees_blocks_at_any_stage(tiny_llama_dir: Path, stage: str) -> None:
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=1)
    if stage == "waiting":
        engine.add_request("keep", PROMPT, greedy(30))  # holds the only running slot
    engine.add_request("victim", list(range(200, 230)), greedy(30))
    for _ in range({"waiting": 1, "prefilling": 1, "decoding": 6}[stage]):
        engine.step()
    victim = engine._requests["victim"]
    assert victim.status.value == ("waiting" if stage == "waiting" else "running")
    if stage == "prefilling":
        assert 0 < victim.num_computed_tokens < victim.num_prompt_tokens
    if stage == "decoding":
        assert victim.num_output_tokens > 0
    final = engine.abort("victim")
    assert final.finished and final.finish_reason is FinishReason.ABORT
    assert engine.kv.block_table("victim") == []
    engine.abort("keep")
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()
    assert engine.abort("victim") is None, "a second abort is a no-op"


def test_stats_track_work(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    engine.add_request("a", PROMPT, greedy(5))
    engine.add_request("b", PROMPT + [9], greedy(5))
    engine.step()
    mid = engine.stats()
    assert mid.num_running == 2 and mid.kv_blocks_used > 0 and 0 < mid.kv_usage < 1
    while engine.has_unfinished():
        engine.step()
    end = engine.stats()
    assert end.generated_tokens == 10 and end.finished == {"length": 2}
    assert end.prompt_tokens + end.prefix_hit_tokens >= 2 * len(PROMPT)
    assert end.kv_blocks_used == 0 and end.kv_blocks_free == end.kv_blocks_total
