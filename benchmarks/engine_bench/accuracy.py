"""Accuracy of each engine against the unquantized one: greedy token agreement, perplexity."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from tritonllm.engine import LLMEngine
from tritonllm.engine.evaluate import perplexity

from .machine import log
from .workload import greedy


@dataclass
class AccuracyResult:
    quantization: str
    num_prompts: int
    tokens_per_prompt: int
    agreement_before_divergence: float  # mean over prompts of (identical prefix length / tokens)
    agreement_overall: float  # identical positions / all positions
    perplexity: float
    perplexity_tokens: int


def token_agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    before, same, total = [], 0, 0
    for ref, out in zip(reference, other, strict=True):
        prefix = next(
            (i for i, (x, y) in enumerate(zip(ref, out, strict=False)) if x != y), min(len(ref), len(out))
        )
        before.append(prefix / len(ref))
        same += sum(x == y for x, y in zip(ref, out, strict=False))
        total += len(ref)
    return statistics.mean(before), same / total


def measure_accuracy(
    engines: dict[str, LLMEngine], prompts: list[list[int]], tokens: int, ppl_ids: list[int]
) -> list[AccuracyResult]:
    """Every engine's greedy outputs against the `none` engine's, and its perplexity on `ppl_ids`."""
    generated = {q: eng.generate(prompts, greedy(tokens)) for q, eng in engines.items()}
    accuracy = []
    for q, eng in engines.items():
        before, overall = token_agreement(generated["none"], generated[q])
        ppl = perplexity(eng.runner, ppl_ids, window=len(ppl_ids))
        accuracy.append(AccuracyResult(q, len(prompts), tokens, before, overall, ppl, len(ppl_ids)))
        log(f"  {q}: agreement {before:.1%} before divergence, {overall:.1%} overall; perplexity {ppl:.4f}")
    return accuracy
