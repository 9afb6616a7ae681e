"""The TensorRT-LLM path, checked WITHOUT TensorRT-LLM: it is not installed here (no GPU, multi-GB wheels).

These tests pin the mapping from our options to TensorRT-LLM 1.2's command-line flags and executor API
(names taken from the 1.2 sources), using recorded commands and a fake `tensorrt_llm.bindings.executor`
module injected into `sys.modules`. That the real tools accept them is NOT verified here.
"""

from __future__ import annotations

import datetime
import enum
import json
import queue
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tritonllm.builder import options, trtllm_build
from tritonllm.builder.builder import build
from tritonllm.builder.options import BuildOptions, Limits
from tritonllm.engine import trtllm_executor
from tritonllm.engine.errors import InvalidRequestError
from tritonllm.engine.protocol import Engine
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.sequence import FinishReason
from tritonllm.engine.trtllm_executor import ExecutorSettings, TrtllmEngine, settings_from_parameters
from tritonllm.engine_format import engine_backend, engine_defaults, read_build_info
from tritonllm.tokenization import load_tokenizer
from tritonllm.triton.models.tensorrt_llm import engine_config

WAIT_S = 10.0


@pytest.fixture
def trtllm_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend TensorRT-LLM 1.2.1 and a GPU are there (neither is)."""
    monkeypatch.setattr(trtllm_executor, "tensorrt_llm_installed", lambda: True)
    monkeypatch.setattr(trtllm_executor, "tensorrt_llm_version", lambda: "1.2.1")
    monkeypatch.setattr(trtllm_executor, "gpu_available", lambda: True)


def trt_options(tiny_llama_dir: Path, out: Path, **kwargs: Any) -> BuildOptions:
    return BuildOptions(model=str(tiny_llama_dir), output=str(out), backend="tensorrt_llm", **kwargs)


def test_auto_picks_tensorrt_llm_with_a_gpu_without_tensorrt_llm(
    trtllm_present: None, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    opts = BuildOptions(model=str(tiny_llama_dir), output=str(tmp_path / "e"), quantization="int8_sq")
    assert opts.backend == "tensorrt_llm"
    assert (
        Limits.resolve(opts, 512).tokens_per_block == 32 and Limits.resolve(opts, 512).max_num_tokens == 8192
    )


def test_fp8_commands_without_tensorrt_llm(
    trtllm_present: None, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    opts = trt_options(
        tiny_llama_dir,
        tmp_path / "e",
        quantization="fp8",
        kv_cache_dtype="fp8",
        calib_dataset="/data/calib",
        calib_size=64,
        tp_size=2,
        max_input_len=100,
        max_seq_len=200,
    )
    script, ckpt, dest = Path("/x/quantize.py"), tmp_path / "ckpt", tmp_path / "plan"
    quantize = trtllm_build.quantize_command(opts, tiny_llama_dir, ckpt, "float16", script)
    assert quantize == [
        sys.executable,
        "/x/quantize.py",
        "--model_dir",
        str(tiny_llama_dir),
        "--output_dir",
        str(ckpt),
        "--dtype",
        "float16",
        "--qformat",
        "fp8",
        "--tp_size",
        "2",
        "--calib_size",
        "64",
        "--kv_cache_dtype",
        "fp8",
        "--calib_dataset",
        "/data/calib",
    ]
    cmd = trtllm_build.trtllm_build_command(opts, ckpt, dest, Limits.resolve(opts, 512))
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert cmd[0].endswith("trtllm-build")
    assert flags == {
        "--checkpoint_dir": str(ckpt),
        "--output_dir": str(dest),
        "--max_batch_size": "64",
        "--max_input_len": "100",
        "--max_seq_len": "200",
        "--max_num_tokens": "8192",
        "--kv_cache_type": "paged",
        "--tokens_per_block": "32",
        "--remove_input_padding": "enable",
        "--use_paged_context_fmha": "enable",
        "--gemm_plugin": "auto",
        "--gpt_attention_plugin": "auto",
        "--use_fp8_context_fmha": "enable",
    }


@pytest.mark.parametrize(
    ("quantization", "qformat"),
    [
        ("none", "full_prec"),
        ("int8_sq", "int8_sq"),
        ("int8_wo", "int8_wo"),
        ("int4_awq", "int4_awq"),
        ("int4_wo", "int4_wo"),
    ],
)
def test_qformat_per_quantization_without_tensorrt_llm(
    trtllm_present: None, tiny_llama_dir: Path, tmp_path: Path, quantization: str, qformat: str
) -> None:
    opts = trt_options(tiny_llama_dir, tmp_path / "e", quantization=quantization)
    cmd = trtllm_build.quantize_command(opts, tiny_llama_dir, tmp_path, "float16", Path("q.py"))
    assert cmd[cmd.index("--qformat") + 1] == qformat
    assert "--kv_cache_dtype" not in cmd and "--calib_dataset" not in cmd
    build_cmd = trtllm_build.trtllm_build_command(opts, tmp_path, tmp_path, Limits.resolve(opts, 512))
    assert "--use_fp8_context_fmha" not in build_cmd


def test_missing_quantize_script_is_named_without_tensorrt_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(trtllm_build.QUANTIZE_SCRIPT_ENV, "/nowhere/quantize.py")
    monkeypatch.setattr(trtllm_build, "QUANTIZE_SCRIPTS", ())
    with pytest.raises(
        options.BuildError, match=r"quantize\.py not found .*/nowhere/quantize\.py.*TRTLLM_QUANTIZE"
    ):
        trtllm_build.quantize_script()


@pytest.fixture
def fake_tools(trtllm_present: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """quantize.py and trtllm-build replaced by stand-ins that write what they would: checkpoint, plan."""
    script = tmp_path / "quantize.py"
    script.write_text("")
    monkeypatch.setenv(trtllm_build.QUANTIZE_SCRIPT_ENV, str(script))
    steps: list[str] = []

    def run(cmd: list[str], step: str) -> None:
        steps.append(step)
        out = Path(cmd[cmd.index("--output_dir") + 1])
        if step == "quantize":
            out.mkdir()
        else:
            (out / "config.json").write_text(json.dumps({"version": "1.2.1", "build_config": {}}))
            (out / "rank0.engine").write_bytes(b"plan")

    monkeypatch.setattr(trtllm_build, "run", run)
    return steps


def test_engine_dir_of_a_trtllm_build_without_tensorrt_llm(
    fake_tools: list[str], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = build(trt_options(tiny_llama_dir, tmp_path / "engine", quantization="fp8", kv_cache_dtype="fp8"))
    assert fake_tools == ["quantize", "trtllm-build"]
    config = json.loads((out / "config.json").read_text())
    assert config["version"] == "1.2.1"  # TensorRT-LLM's own config is kept
    info = read_build_info(out)
    assert (info["backend"], info["quantization"], info["kv_cache_dtype"]) == ("tensorrt_llm", "fp8", "fp8")
    assert info["versions"]["tensorrt_llm"] == "1.2.1"
    assert (out / "rank0.engine").is_file() and (out / "tokenizer.json").is_file()
    assert not (out / ".trtllm_checkpoint").exists()
    assert engine_backend(out) == "tensorrt_llm"
    assert "quantization" not in engine_defaults(out)  # the project's engine must not try to load it
    assert engine_config({"engine_dir": str(out)}).max_model_len == 512


# The executor adapter, over a fake `tensorrt_llm.bindings.executor`.


class Recorded:
    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs


class FakeFinishReason(enum.Enum):
    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


class FakeExecutor:
    leader = True  # False: an MPI worker rank of a tensor-parallel engine

    def __init__(self, path: str, model_type: str, config: Recorded):
        self.path, self.model_type, self.config = path, model_type, config
        self.requests: dict[int, Recorded] = {}
        self.cancelled: list[int] = []
        self.responses: queue.Queue = queue.Queue()
        self.iteration_stats: list[Any] = []
        self.is_shut_down = False

    def can_enqueue_requests(self) -> bool:
        return self.leader

    def enqueue_request(self, request: Recorded) -> int:
        self.requests[len(self.requests) + 1] = request
        return len(self.requests)

    def respond(self, request_id: int, tokens: list[int], final: FakeFinishReason | None = None) -> None:
        result = SimpleNamespace(
            output_token_ids=[tokens],
            log_probs=None,
            is_final=final is not None,
            finish_reasons=[final or FakeFinishReason.NOT_FINISHED],
        )
        self.responses.put(SimpleNamespace(request_id=request_id, has_error=lambda: False, result=result))

    def await_responses(self, timeout: datetime.timedelta) -> list[Any]:
        try:
            return [self.responses.get(timeout=timeout.total_seconds())]
        except queue.Empty:
            return []

    def cancel_request(self, request_id: int) -> None:
        self.cancelled.append(request_id)
        self.respond(request_id, [], FakeFinishReason.CANCELLED)

    def get_latest_iteration_stats(self) -> list[Any]:
        stats, self.iteration_stats = self.iteration_stats, []
        return stats

    def shutdown(self) -> None:
        self.is_shut_down = True


@pytest.fixture
def fake_executor_module(monkeypatch: pytest.MonkeyPatch, trtllm_present: None) -> types.ModuleType:
    executor = types.ModuleType("tensorrt_llm.bindings.executor")
    for name in (
        "ExecutorConfig",
        "KvCacheConfig",
        "SchedulerConfig",
        "SamplingConfig",
        "OutputConfig",
        "Request",
    ):
        setattr(executor, name, type(name, (Recorded,), {}))
    executor.GuidedDecodingConfig = type(
        "GuidedDecodingConfig",
        (Recorded,),
        {"GuidedDecodingBackend": enum.Enum("GuidedDecodingBackend", "XGRAMMAR LLGUIDANCE")},
    )
    executor.GuidedDecodingParams = type(
        "GuidedDecodingParams",
        (Recorded,),
        {"GuideType": enum.Enum("GuideType", "JSON JSON_SCHEMA REGEX EBNF_GRAMMAR STRUCTURAL_TAG")},
    )
    executor.CapacitySchedulerPolicy = enum.Enum(
        "CapacitySchedulerPolicy", "GUARANTEED_NO_EVICT MAX_UTILIZATION"
    )
    executor.ModelType = SimpleNamespace(DECODER_ONLY="DECODER_ONLY")
    executor.FinishReason = FakeFinishReason
    executor.Executor = FakeExecutor
    bindings = types.ModuleType("tensorrt_llm.bindings")
    bindings.executor = executor
    package = types.ModuleType("tensorrt_llm")
    package.bindings = bindings
    monkeypatch.setitem(sys.modules, "tensorrt_llm", package)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings", bindings)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings.executor", executor)
    return executor


@pytest.fixture
def engine(fake_executor_module: types.ModuleType, tmp_path: Path):
    settings = ExecutorSettings(
        max_seq_len=64,
        max_input_len=32,
        tokens_per_block=32,
        eos_token_ids=(2,),
        free_gpu_memory_fraction=0.8,
    )
    engine = TrtllmEngine(tmp_path, settings)
    yield engine
    engine.shutdown(drain_timeout_s=0.0)


def test_adapter_satisfies_the_engine_protocol_without_tensorrt_llm(engine: TrtllmEngine) -> None:
    assert isinstance(engine, Engine) and engine.alive


def test_executor_config_without_tensorrt_llm(engine: TrtllmEngine, tmp_path: Path) -> None:
    executor = engine.executor
    assert (executor.path, executor.model_type) == (str(tmp_path), "DECODER_ONLY")
    config = executor.config.kwargs
    assert config["max_beam_width"] == 1 and config["enable_chunked_context"] is True
    assert config["max_queue_size"] == 256
    assert config["kv_cache_config"].kwargs == {"free_gpu_memory_fraction": 0.8, "enable_block_reuse": True}
    assert config["scheduler_config"].args[0].name == "GUARANTEED_NO_EVICT"


def test_request_mapping_without_tensorrt_llm(engine: TrtllmEngine) -> None:
    engine.submit(
        "greedy", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[[9, 10]])
    )
    engine.submit(
        "sampled",
        [5],
        SamplingParams(
            max_tokens=3, temperature=0.7, top_p=0.9, seed=3, min_tokens=1, ignore_eos=True, logprobs=True
        ),
    )
    greedy, sampled = engine.executor.requests[1].kwargs, engine.executor.requests[2].kwargs
    assert (greedy["input_token_ids"], greedy["max_tokens"], greedy["streaming"]) == ([5, 6, 7], 4, True)
    assert (greedy["end_id"], greedy["stop_words"], greedy["bad_words"]) == (2, [[9, 10]], None)
    assert greedy["sampling_config"].kwargs == {"beam_width": 1, "top_k": 1}
    assert greedy["output_config"].kwargs == {"return_log_probs": False, "exclude_input_from_output": True}
    assert sampled["end_id"] == -1
    assert sampled["sampling_config"].kwargs == {
        "beam_width": 1,
        "top_p": 0.9,
        "temperature": 0.7,
        "seed": 3,
        "min_tokens": 1,
    }


def test_streamed_outputs_and_finish_reasons_without_tensorrt_llm(engine: TrtllmEngine) -> None:
    stream = engine.submit("a", [1, 2], SamplingParams(max_tokens=3, temperature=0.0))
    engine.executor.respond(1, [7])
    engine.executor.respond(1, [8, 9], FakeFinishReason.LENGTH)
    outs = list(stream.outputs(timeout_s=WAIT_S))
    assert [o.new_token_ids for o in outs] == [[7], [8, 9]]
    assert outs[-1].finished and outs[-1].finish_reason == FinishReason.LENGTH
    assert (outs[-1].num_prompt_tokens, outs[-1].num_output_tokens) == (2, 3)
    assert engine.num_in_flight == 0


def test_cancel_reaches_the_executor_without_tensorrt_llm(engine: TrtllmEngine) -> None:
    stream = engine.submit("b", [1], SamplingParams(max_tokens=8))
    assert engine.cancel("b") and not engine.cancel("unknown")
    final = list(stream.outputs(timeout_s=WAIT_S))[-1]
    assert engine.executor.cancelled == [1] and final.finish_reason == FinishReason.ABORT


def test_limits_are_checked_before_enqueueing_without_tensorrt_llm(engine: TrtllmEngine) -> None:
    with pytest.raises(
        InvalidRequestError, match=r"input_ids: 33 tokens exceed the engine's max_input_len=32"
    ):
        engine.submit("long", list(range(33)), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match=r"max_tokens: prompt \(30\) \+ max_tokens \(40\) exceed"):
        engine.submit("long", list(range(30)), SamplingParams(max_tokens=40))
    assert engine.executor.requests == {}


@pytest.fixture
def guided_engine(fake_executor_module: types.ModuleType, tiny_llama_dir: Path):
    """An engine whose directory holds a tokenizer (the tiny model's: EOS 2, 512 tokens); its
    generation config's EOS is 5."""
    settings = ExecutorSettings(max_seq_len=64, max_input_len=32, tokens_per_block=32, eos_token_ids=(5,))
    engine = TrtllmEngine(tiny_llama_dir, settings)
    yield engine
    engine.shutdown(drain_timeout_s=0.0)


def guided(guide_type: str, guide: str | None = None, **kwargs: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=4, guided_decoding_guide_type=guide_type, guided_decoding_guide=guide, **kwargs
    )


def test_guided_decoding_config_from_the_engine_tokenizer_with_a_fake_executor(
    guided_engine: TrtllmEngine, fake_executor_module: types.ModuleType, tiny_llama_dir: Path
) -> None:
    """The executor is faked: this pins the xgrammar config TensorRT-LLM 1.2 would be given, not its use."""
    config = guided_engine.executor.config.kwargs["guided_decoding_config"]
    backend = fake_executor_module.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR
    assert config.kwargs.keys() == {"backend", "encoded_vocab", "tokenizer_str", "stop_token_ids"}
    assert config.kwargs["backend"] is backend
    vocab = load_tokenizer(tiny_llama_dir).get_vocab()
    assert len(config.kwargs["encoded_vocab"]) == len(vocab) == 512
    assert all(config.kwargs["encoded_vocab"][i] == token for token, i in vocab.items())  # in id order
    assert json.loads(config.kwargs["tokenizer_str"]) == json.loads(
        (tiny_llama_dir / "tokenizer.json").read_text()
    )
    assert config.kwargs["stop_token_ids"] == [2, 5]  # the tokenizer's EOS and the engine's


def test_an_engine_without_a_tokenizer_has_no_guided_decoding_with_a_fake_executor(
    engine: TrtllmEngine,
) -> None:
    """The executor is faked: it starts without a guided decoding config and guided requests are refused."""
    assert engine.executor.config.kwargs["guided_decoding_config"] is None
    with pytest.raises(
        InvalidRequestError, match="guided_decoding_guide_type: guided decoding is off: no usable"
    ):
        engine.submit("g", [1], guided("regex", "a+"))
    assert engine.executor.requests == {}


def test_guided_requests_map_to_guided_decoding_params_with_a_fake_executor(
    guided_engine: TrtllmEngine, fake_executor_module: types.ModuleType
) -> None:
    """The executor is faked: the four guide types map to NVIDIA's `GuideType` members, the guide as is."""
    schema = '{"type": "object"}'
    cases = {
        "json": (guided("json"), "JSON", None),
        "json_schema": (guided("json_schema", schema), "JSON_SCHEMA", schema),
        "regex": (guided("regex", "[0-9]+", end_id=2), "REGEX", "[0-9]+"),
        "ebnf_grammar": (guided("ebnf_grammar", 'root ::= "a"'), "EBNF_GRAMMAR", 'root ::= "a"'),
    }
    for rid, (params, _, _) in cases.items():
        guided_engine.submit(rid, [1], params)
    guided_engine.submit("plain", [1], SamplingParams(max_tokens=4))
    requests = [r.kwargs for r in guided_engine.executor.requests.values()]
    guide_type = fake_executor_module.GuidedDecodingParams.GuideType
    for request, (_, member, guide) in zip(requests[:4], cases.values(), strict=True):
        assert request["guided_decoding_params"].kwargs == {"guide_type": guide_type[member], "guide": guide}
    assert [r["end_id"] for r in requests] == [5, 5, 2, 5, 5]
    assert requests[-1]["guided_decoding_params"] is None


def test_guided_requests_that_cannot_end_on_a_stop_token_are_refused_with_a_fake_executor(
    guided_engine: TrtllmEngine,
) -> None:
    """The executor is faked: xgrammar allows only its stop tokens once the grammar is complete, so a
    guided request without an end id (ignore_eos) or with another one is refused before enqueueing."""
    with pytest.raises(InvalidRequestError, match=r"ignore_eos: .* stop tokens \[2, 5\]"):
        guided_engine.submit("a", [1], guided("json", ignore_eos=True))
    with pytest.raises(InvalidRequestError, match=r"end_id: .* stop tokens \[2, 5\]"):
        guided_engine.submit("b", [1], guided("regex", "a+", end_id=7))
    assert guided_engine.executor.requests == {}
    guided_engine.submit("c", [1], SamplingParams(max_tokens=4, ignore_eos=True))  # unguided: allowed
    assert len(guided_engine.executor.requests) == 1


def test_iteration_stats_map_to_engine_stats_without_tensorrt_llm(engine: TrtllmEngine) -> None:
    kv = SimpleNamespace(
        max_num_blocks=100,
        used_num_blocks=30,
        free_num_blocks=70,
        tokens_per_block=32,
        reused_blocks=4,
        missed_blocks=6,
    )
    ifb = SimpleNamespace(num_scheduled_requests=3, num_ctx_tokens=50)
    it = SimpleNamespace(
        num_active_requests=5, num_queued_requests=2, kv_cache_stats=kv, inflight_batching_stats=ifb
    )
    engine.executor.iteration_stats = [it, it]
    stream = engine.submit("c", [1], SamplingParams(max_tokens=1))
    engine.executor.respond(1, [4], FakeFinishReason.END_ID)
    list(stream.outputs(timeout_s=WAIT_S))
    deadline = time.monotonic() + WAIT_S  # the adapter polls the statistics every 0.1 s
    while engine.stats().prompt_tokens == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (3, 4)
    assert (stats.kv_blocks_total, stats.kv_blocks_used, stats.kv_blocks_free) == (100, 30, 70)
    assert (stats.prefix_hit_tokens, stats.prefix_queried_tokens) == (128, 320)
    assert stats.prompt_tokens == 100 and stats.kv_usage == 0.3


def test_shutdown_stops_the_executor_without_tensorrt_llm(engine: TrtllmEngine) -> None:
    stream = engine.submit("d", [1], SamplingParams(max_tokens=8))
    engine.shutdown(drain_timeout_s=0.0)
    assert engine.executor.is_shut_down
    assert list(stream.outputs(timeout_s=WAIT_S))[-1].finish_reason == FinishReason.ABORT


def test_worker_rank_waits_for_the_leader_without_tensorrt_llm(
    fake_executor_module: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that cannot enqueue (MPI rank > 0) shuts its executor down at once, as NVIDIA's model does
    (the real `shutdown()` blocks until the leader's does), and runs no response thread."""
    monkeypatch.setattr(FakeExecutor, "leader", False)
    settings = ExecutorSettings(max_seq_len=64, max_input_len=32, tokens_per_block=32, eos_token_ids=(2,))
    worker = TrtllmEngine(tmp_path, settings)
    assert worker.executor.is_shut_down and not worker.is_leader
    assert not worker._thread.is_alive()
    worker.shutdown(drain_timeout_s=0.0)


def test_executor_settings_from_model_parameters_without_tensorrt_llm(
    fake_tools: list[str], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = build(trt_options(tiny_llama_dir, tmp_path / "engine", max_seq_len=256))
    params = {
        "kv_cache_free_gpu_mem_fraction": "0.5",
        "enable_kv_cache_reuse": "false",
        "batch_scheduler_policy": "max_utilization",
        "max_waiting": "",
    }
    settings = settings_from_parameters(out, params)
    assert (settings.free_gpu_memory_fraction, settings.enable_block_reuse, settings.scheduler_policy) == (
        0.5,
        False,
        "max_utilization",
    )
    assert (
        settings.max_waiting,
        settings.max_seq_len,
        settings.max_input_len,
        settings.tokens_per_block,
    ) == (256, 256, 128, 32)
    assert settings.eos_token_ids == (2,)
    with pytest.raises(ValueError, match="scheduler_policy must be one of"):
        settings_from_parameters(out, {"batch_scheduler_policy": "fifo"})
