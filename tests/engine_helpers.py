"""Helpers shared by the engine tests: prompts and HF transformers reference outputs."""

from __future__ import annotations

import os
import random
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tritonllm.engine import EngineConfig, LLMEngine, SamplingParams

# Where the engine tests run the engine and HF: "cpu" here and in CI; "cuda" for a check on a GPU machine
# (`TRITONLLM_TEST_DEVICE=cuda pytest tests/test_engine_matches_hf.py ...`, see benchmarks/README.md).
TEST_DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")


def random_prompts(n: int, vocab: int, seed: int, min_len: int = 1, max_len: int = 60) -> list[list[int]]:
    """Prompts of mixed lengths; every third one shares a prefix with an earlier one."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        if i % 3 == 2 and prompts:
            base = rng.choice(prompts)
            prompts.append(base + [rng.randrange(3, vocab) for _ in range(max(1, length // 4))])
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(length)])
    return prompts


# Short English and code prompts for greedy comparisons on the default model (SmolLM2).
SMOLLM2_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "My favourite food is",
]


@lru_cache(maxsize=8)
def _hf_model(path: str, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(TEST_DEVICE).eval()


def hf_greedy(
    path: Path,
    prompt: list[int],
    max_new_tokens: int,
    bad_words_ids: list[list[int]] | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[int]:
    """HF transformers greedy `generate()` for one prompt, EOS ignored (memoised across tests)."""
    bad = tuple(tuple(w) for w in bad_words_ids) if bad_words_ids else None
    return list(_hf_greedy(str(path), tuple(prompt), max_new_tokens, bad, dtype))


@lru_cache(maxsize=1024)
def _hf_greedy(
    path: str,
    prompt: tuple[int, ...],
    max_new_tokens: int,
    bad_words_ids: tuple[tuple[int, ...], ...] | None,
    dtype: torch.dtype,
) -> tuple[int, ...]:
    bad = [list(w) for w in bad_words_ids] if bad_words_ids else None
    return tuple(_generate(_hf_model(path, dtype), [list(prompt)], max_new_tokens, bad)[0])


def _generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    bad_words_ids: list[list[int]] | None,
) -> list[list[int]]:
    """Greedy `generate()` over left-padded prompts, through EOS like the engine's ignore_eos."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=TEST_DEVICE)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=TEST_DEVICE)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            bad_words_ids=bad_words_ids,
        )
    return [row[width:].tolist() for row in out]


def hf_greedy_batch(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF greedy `generate()` for many prompts in one left-padded fp32 batch, EOS ignored. On a 2-core CPU 5x
    faster than one call a prompt, and the same tokens there (22 SmolLM2 prompts x 24); bf16 batches are not:
    padding changes its roundings, so bf16 references use `hf_greedy`."""
    return _generate(_hf_model(str(path), torch.float32), prompts, max_new_tokens, None)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def make_engine(path: Path, **overrides) -> LLMEngine:
    config = {
        "model": str(path),
        "device": TEST_DEVICE,
        "tokens_per_block": 4,
        "num_kv_blocks": 256,
        "num_threads": 1,
    }
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], arrivals: list[int]
) -> list[list[int]]:
    """Add request i before step `arrivals[i]`, run to completion, return output tokens per request."""
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    step = 0
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params[i])
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        step += 1
        assert step < 10_000, "engine made no progress"
    return [outputs[str(i)] for i in range(len(prompts))]


def agreement_before_divergence(got: list[list[int]], expected: list[list[int]]) -> float:
    """Mean fraction of tokens generated before the first one that differs from the reference."""
    fractions = []
    for g, e in zip(got, expected, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(g, e, strict=False)) if a != b), min(len(g), len(e)))
        fractions.append(same / len(e))
    return sum(fractions) / len(fractions)
