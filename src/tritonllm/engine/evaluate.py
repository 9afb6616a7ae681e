"""Teacher-forced log-likelihood under the engine's own model code: the perplexity that accuracy checks
of dtypes and quantizations compare (tests, benchmarks/bench_precision.py).

The model runs over a scratch KV cache of its own, so a runner that serves requests is left untouched.
"""

from __future__ import annotations

import math

import torch

from tritonllm.engine.model_runner import ModelRunner
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import ScheduledChunk
from tritonllm.engine.sequence import Sequence
from tritonllm.engine.step_inputs import StepInputs


def token_logprobs(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """log p(token i | tokens before it) for i >= 1, from one causal prefill over the whole sequence."""
    n, device = len(token_ids), runner.device
    blocks = -(-n // runner.tokens_per_block)
    scratch = runner.new_kv_cache(blocks)
    # The whole sequence as one prompt chunk over the scratch blocks 0..blocks-1, as a serving step sees it.
    prompt = ScheduledChunk(Sequence("evaluate", token_ids, SamplingParams()), n)
    ids, positions, meta, _ = StepInputs(runner.tokens_per_block, device).build(
        [prompt], {"evaluate": list(range(blocks))}
    )
    caches = [(layer[0], layer[1]) for layer in scratch]
    logits = runner.model(ids, positions, meta, caches, torch.arange(n - 1, device=device))
    return torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None])[:, 0]


def perplexity(runner: ModelRunner, token_ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood), scoring `token_ids` in independent windows of `window` tokens."""
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window]
        if len(chunk) > 1:
            logprobs = token_logprobs(runner, chunk)
            total -= float(logprobs.sum())
            count += len(logprobs)
    return math.exp(total / count)
