"""Model logic without a server: preprocessing, postprocessing, BLS input mapping, metrics."""

from __future__ import annotations

import time
import types
from pathlib import Path

import numpy as np
import pytest

from tritonllm.engine import EngineConfig
from tritonllm.engine.serving import ServingEngine
from tritonllm.triton.metrics import HISTOGRAMS, MetricsReporter
from tritonllm.triton.models import PostprocessingModel, PreprocessingModel
from tritonllm.triton.models.common import request_timeout_us
from tritonllm.triton.models.tensorrt_llm import engine_config
from tritonllm.triton.tensors import RequestError, from_word_list
from tritonllm.triton.text import TextCodec
from tritonllm.triton.text_requests import TextRequests


@pytest.fixture(scope="module")
def codec(tiny_llama_dir: Path) -> TextCodec:
    return TextCodec(tiny_llama_dir)


def s(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=object)


def preprocessor(codec: TextCodec) -> PreprocessingModel:
    model = PreprocessingModel()
    model.codec = codec
    return model


def test_preprocess_outputs(codec: TextCodec) -> None:
    out = preprocessor(codec).preprocess(
        {
            "QUERY": s("The quick brown fox"),
            "REQUEST_OUTPUT_LEN": np.array([[7]], dtype=np.int32),
            "STOP_WORDS_DICT": np.array([[b" dog", b""]], dtype=object),
        }
    )
    ids = codec.encode("The quick brown fox")
    assert out["INPUT_ID"].tolist() == [ids] and out["REQUEST_INPUT_LEN"].tolist() == [[len(ids)]]
    assert from_word_list({"w": out["STOP_WORDS_IDS"]}, "w") == codec.encode_words([" dog"])
    assert from_word_list({"w": out["BAD_WORDS_IDS"]}, "w") == []
    assert out["OUT_END_ID"].tolist() == [[-1]] and out["REQUEST_OUTPUT_LEN"].tolist() == [[7]]


def test_preprocess_chat_template(codec: TextCodec) -> None:
    out = preprocessor(codec).preprocess({"QUERY": s("hi"), "REQUEST_OUTPUT_LEN": np.array([[1]])}, chat=True)
    assert "assistant" in codec.decode(out["INPUT_ID"][0].tolist())


@pytest.mark.parametrize(
    ("inputs", "tensor"),
    [
        ({"QUERY": s(""), "REQUEST_OUTPUT_LEN": np.array([[1]])}, "text_input"),
        (
            {"QUERY": s("x"), "DECODER_QUERY": s("y"), "REQUEST_OUTPUT_LEN": np.array([[1]])},
            "decoder_text_input",
        ),
        (
            {
                "QUERY": s("x"),
                "EMBEDDING_BIAS_WORDS": np.array([[b"a"]], dtype=object),
                "REQUEST_OUTPUT_LEN": np.array([[1]]),
            },
            "embedding_bias_words",
        ),
    ],
)
def test_preprocess_errors(codec: TextCodec, inputs: dict, tensor: str) -> None:
    with pytest.raises(RequestError) as info:
        preprocessor(codec).preprocess(inputs)
    assert info.value.tensor == tensor


def test_postprocess_uses_context(codec: TextCodec) -> None:
    model = PostprocessingModel()
    model.codec = codec
    prompt = codec.encode("The quick")
    new = codec.tokenizer.encode(" brown", add_special_tokens=False)
    out = model.postprocess(
        {
            "TOKENS_BATCH": np.array([[new]], dtype=np.int32),
            "SEQUENCE_LENGTH": np.array([[len(new)]], dtype=np.int32),
            "CONTEXT_IDS": np.array([prompt[-8:]], dtype=np.int32),
        }
    )
    assert out["OUTPUT"].tolist() == [b" brown"], "1-D, one string per row and beam (NVIDIA's shape)"


def test_text_requests_map_ensemble_names_and_report_them(codec: TextCodec) -> None:
    """What the BLS and the front door (calling tensorrt_llm itself) send the engine."""
    text = TextRequests(codec)
    inputs = {
        "text_input": s("hello"),
        "max_tokens": np.array([[5]], dtype=np.int32),
        "top_p": np.array([[0.5]], dtype=np.float32),
        "stream": np.array([[True]]),
    }
    out = text.engine_inputs(inputs, chat=False)
    assert out["request_output_len"].tolist() == [[5]] and out["streaming"].tolist() == [[True]]
    assert out["runtime_top_p"].tolist() == [[0.5]] and out["input_ids"].tolist() == [codec.encode("hello")]
    inputs["top_p"] = np.array([[3.0]], dtype=np.float32)
    with pytest.raises(RequestError, match=r"^input 'top_p': "):
        text.engine_inputs(inputs, chat=False)
    inputs["top_p"] = np.array([[0.5]], dtype=np.float32)
    with pytest.raises(RequestError, match=r"^input 'stream': needs the decoupled model"):
        text.engine_inputs(inputs, decoupled=False)


def test_engine_config_from_parameters() -> None:
    config = engine_config(
        {"engine_dir": "/m", "num_threads": "1", "max_num_seqs": "", "quantization": "fp8"}
    )
    assert (config.model, config.num_threads, config.max_num_seqs, config.quantization) == (
        "/m",
        1,
        64,
        "fp8",
    )


class FakeMetric:
    def __init__(self) -> None:
        self.ops: list[tuple[str, float]] = []

    def increment(self, v: float) -> None:
        self.ops.append(("inc", v))

    def set(self, v: float) -> None:
        self.ops.append(("set", v))

    def observe(self, v: float) -> None:
        self.ops.append(("obs", v))


def fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    families: dict[str, list[FakeMetric]] = {}

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name, self.kind = name, kind
            families[name] = []

        def Metric(self, labels=None, buckets=None):  # noqa: N802 -- pb_utils' name
            assert (buckets is not None) == (self.kind == "histogram")
            metric = FakeMetric()
            families[self.name].append(metric)
            return metric

    pb.MetricFamily = MetricFamily  # type: ignore[attr-defined]
    pb.families = families  # type: ignore[attr-defined]
    return pb


def test_metrics_reporter_publishes(tiny_llama_dir: Path) -> None:
    from tritonllm.triton.bridge import EngineBridge
    from tritonllm.triton.tensors import parse_engine_request

    pb = fake_pb_utils()
    bridge = EngineBridge(
        EngineConfig(model=str(tiny_llama_dir), tokens_per_block=4, num_kv_blocks=64, num_threads=1)
    )
    reporter = MetricsReporter(pb, bridge.engine, interval_s=0.01)
    bridge._on_finished = reporter.record_finished
    try:

        class Chan:
            done = False

            def send(self, outputs, error, final):
                Chan.done = Chan.done or final

            def is_cancelled(self):
                return False

        req = parse_engine_request(
            {
                "input_ids": np.array([[5, 6, 7]], dtype=np.int32),
                "request_output_len": np.array([[4]], dtype=np.int32),
                "min_tokens": np.array([[4]], dtype=np.int32),
            }
        )
        bridge.submit("m", [req], Chan())
        deadline = time.monotonic() + 120  # may include building the C++ kernel
        while not Chan.done and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        bridge.shutdown(1)
        reporter.close()
    for name in HISTOGRAMS:
        assert pb.families[name][0].ops, name
    generated = bridge.engine.stats().generated_tokens
    assert generated > 0
    assert (
        sum(v for op, v in pb.families["tritonllm_generation_tokens_total"][0].ops if op == "inc")
        == generated
    )
    assert isinstance(bridge.engine, ServingEngine)


@pytest.mark.parametrize(
    ("triton_timeout_us", "params", "expected"),
    [(0, {}, 0), (2_500_000, {}, 2_500_000), (0, {"timeout": 1234}, 1234), (7, {"timeout": 1234}, 7)],
)
def test_request_timeout_is_tritons_own_else_the_parameter(
    triton_timeout_us: int, params: dict, expected: int
) -> None:
    request = types.SimpleNamespace(timeout=lambda: triton_timeout_us)
    assert request_timeout_us(request, params) == expected


@pytest.mark.parametrize("value", [-1, 1.5, "100", True])
def test_a_bad_timeout_parameter_names_it(value: object) -> None:
    request = types.SimpleNamespace(timeout=lambda: 0)
    with pytest.raises(RequestError, match="timeout"):
        request_timeout_us(request, {"timeout": value})
