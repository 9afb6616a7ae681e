"""Workloads: token-length control with the model's own tokenizer, seeds, distributions, shapes."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tritonllm_loadtest.distributions import IntDistribution
from tritonllm_loadtest.shapes import ShapeConfig
from tritonllm_loadtest.workload import Workload, WorkloadConfig, bundled_prompts


def workload(model_dir: Path, input_tokens: str, prompts: str = "synthetic", seed: int = 0) -> Workload:
    config = WorkloadConfig(
        tokenizer=str(model_dir),
        input_tokens=IntDistribution.parse(input_tokens),
        max_tokens=IntDistribution.parse("uniform:4,12"),
        prompts=prompts,
        seed=seed,
    )
    return Workload(config)


@pytest.mark.parametrize("model", ["tiny_llama_dir", pytest.param("smollm2_dir", marks=pytest.mark.slow)])
def test_synthetic_prompts_have_the_sampled_length_in_model_tokens(model: str, request) -> None:
    model_dir = request.getfixturevalue(model)
    w = workload(model_dir, "uniform:16,300")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(0)
    exact = 0
    for wanted in range(16, 300, 6):
        prompt, measured = w.synthetic_prompt(rng, wanted)
        assert measured == len(tokenizer.encode(prompt, add_special_tokens=False).ids)
        assert abs(measured - wanted) <= 2
        exact += measured == wanted
    assert exact >= 45  # of 48
    stream = w.stream(0)
    for _ in range(20):
        req = stream.next()
        assert 14 <= req.input_tokens <= 302 and 4 <= req.max_tokens <= 12


def test_seeded_streams_repeat_and_differ(tiny_llama_dir: Path) -> None:
    first = [workload(tiny_llama_dir, "normal:64,16").stream(3).next() for _ in range(2)]
    again = workload(tiny_llama_dir, "normal:64,16").stream(3)
    assert first[0] == again.next()
    other_stream = workload(tiny_llama_dir, "normal:64,16").stream(4).next()
    other_seed = workload(tiny_llama_dir, "normal:64,16", seed=1).stream(3).next()
    assert other_stream != first[0] and other_seed != first[0]


def test_normal_input_lengths_follow_the_distribution(tiny_llama_dir: Path) -> None:
    stream = workload(tiny_llama_dir, "normal:100,20").stream(0)
    lengths = [stream.next().input_tokens for _ in range(300)]
    assert 95 <= statistics.mean(lengths) <= 105
    assert 15 <= statistics.stdev(lengths) <= 25


def test_bundled_prompts_are_measured(tiny_llama_dir: Path) -> None:
    stream = workload(tiny_llama_dir, "fixed:8", prompts="bundled").stream(0)
    requests = [stream.next() for _ in range(20)]
    assert {r.prompt for r in requests} <= set(bundled_prompts())
    assert len(bundled_prompts()) >= 10 and all(r.input_tokens > 0 for r in requests)


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        workload(tmp_path, "fixed:8")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fixed:0", "integer N >= 1"),
        ("uniform:9,3", "LO <= HI"),
        ("normal:10", "use fixed:N"),
        ("poisson:3", "use fixed:N"),
        ("fixed:x", "must be numbers"),
    ],
)
def test_bad_distribution_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        IntDistribution.parse(spec)


def test_step_ramp_schedule() -> None:
    shape = ShapeConfig(shape="step", users=6, step_users=2, step_duration_s=10, duration_s=40)
    assert [shape.users_at(t) for t in (0, 9.9, 10, 25, 35)] == [2, 2, 4, 6, 6]
    assert shape.users_at(40) is None


def test_spike_and_poisson_schedules() -> None:
    spike = ShapeConfig("spike", users=2, spike_users=10, spike_at_s=5, spike_duration_s=3, duration_s=20)
    assert [spike.users_at(t) for t in (0, 5, 7.9, 8)] == [2, 10, 10, 2]
    poisson = ShapeConfig(shape="poisson", rate=6, arrival_users=3, duration_s=5)
    assert poisson.users_at(1) == 3 and poisson.rate_per_arrival_user == 2 and poisson.open_loop


def test_bad_shape_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="shape must be one of"):
        ShapeConfig(shape="sine")
    with pytest.raises(ValueError, match="rate must be > 0"):
        ShapeConfig(shape="poisson", rate=0)
