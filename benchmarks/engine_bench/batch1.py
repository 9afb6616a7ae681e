"""Batch-1 decode speed of each engine against the memory-bandwidth roofline of its weight bytes."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from tritonllm.engine import LLMEngine

from .machine import BandwidthResult, log
from .workload import PromptSource, greedy


@dataclass
class Batch1Result:
    quantization: str
    prompt_tokens: int
    output_tokens: int
    decode_tokens_per_s_runs: list[float]
    decode_steps_timed: int  # over all runs; below runs x (output_tokens - 1) when cut off by the budget
    decode_tokens_per_s: float  # median over runs
    median_step_ms: float
    weight_bytes: int  # parameters + buffers (tied tensors once, inv_freq excluded)
    streamed_bytes: int  # weight_bytes minus an embedding table that is only gathered from
    roofline_tokens_per_s: float  # bandwidth / weight_bytes
    pct_of_roofline: float
    streamed_roofline_tokens_per_s: float  # bandwidth / streamed_bytes
    pct_of_streamed_roofline: float


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """Identity of a tensor's memory; oneDNN-packed weights have no data pointer, so use the object."""
    return (id(t), -1) if t.is_mkldnn else (t.data_ptr(), t.numel())


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameter + buffer bytes, bytes a decode step streams), each tensor storage counted once.

    Tied embeddings appear as two Parameter objects over one storage, so tensors are deduplicated by
    storage address, not by object. The second figure leaves out an embedding table the lm_head does
    not share (e.g. under quantization): decode only gathers one row of it.
    """
    tensors = dict(model.named_parameters(remove_duplicate=True)) | dict(model.named_buffers())
    seen: dict[tuple[int, int], tuple[str, int]] = {}
    for name, t in tensors.items():
        if name.endswith("inv_freq"):
            continue
        seen.setdefault(storage_key(t), (name, t.numel() * t.element_size()))
    total = sum(size for _, size in seen.values())
    lm_head_keys = {storage_key(t) for t in [*model.lm_head.parameters(), *model.lm_head.buffers()]}
    embed = model.embed
    if embed is None:  # tied to a packed head that holds the only copy
        return total, total
    shared = storage_key(embed) in lm_head_keys
    streamed = total - (0 if shared else embed.numel() * embed.element_size())
    return total, streamed


def batch1_decode(
    eng: LLMEngine, prompt: list[int], output_tokens: int, rid: str, budget_s: float
) -> tuple[float, list[float]]:
    """Decode tokens/s of one request alone: the first step (prefill + first token) is left out.

    A slow engine is cut off after `budget_s` seconds of decoding (at least 8 decode steps): its
    per-step cost hardly depends on the context length at these sizes, so the rate stands.
    """
    eng.add_request(rid, prompt, greedy(output_tokens))
    steps = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
        if len(steps) > 8 and sum(steps[1:]) > budget_s:
            eng.abort(rid)
    decode = steps[1:]
    return len(decode) / sum(decode), decode


def decode_runs(
    engines: dict[str, LLMEngine],
    source: PromptSource,
    runs: int,
    prompt_tokens: int,
    output_tokens: int,
    budget_s: float,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """`runs` batch-1 runs per engine, interleaved so load changes hit every engine alike:
    (decode tokens/s per run, every timed decode step) per engine."""
    log(f"batch-1 decode: {runs} runs x {len(engines)} quantizations, interleaved")
    rates: dict[str, list[float]] = {q: [] for q in engines}
    step_times: dict[str, list[float]] = {q: [] for q in engines}
    for run in tqdm(range(runs), desc="batch-1 runs", file=sys.stdout):
        for q, eng in engines.items():
            tps, steps = batch1_decode(
                eng, source.take(prompt_tokens), output_tokens, f"b1-{q}-{run}", budget_s
            )
            rates[q].append(tps)
            step_times[q].extend(steps)
    return rates, step_times


def batch1_results(
    engines: dict[str, LLMEngine],
    rates: dict[str, list[float]],
    step_times: dict[str, list[float]],
    bandwidth: BandwidthResult,
    prompt_tokens: int,
    output_tokens: int,
) -> list[Batch1Result]:
    """The median decode rate of each engine against the rooflines of its weight and streamed bytes."""
    batch1 = []
    for q, eng in engines.items():
        total, streamed = weight_bytes(eng.runner.model)
        tps = statistics.median(rates[q])
        roof, sroof = bandwidth.roofline_gbps * 1e9 / total, bandwidth.roofline_gbps * 1e9 / streamed
        batch1.append(
            Batch1Result(
                quantization=q,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                decode_tokens_per_s_runs=rates[q],
                decode_steps_timed=len(step_times[q]),
                decode_tokens_per_s=tps,
                median_step_ms=statistics.median(step_times[q]) * 1e3,
                weight_bytes=total,
                streamed_bytes=streamed,
                roofline_tokens_per_s=roof,
                pct_of_roofline=tps / roof,
                streamed_roofline_tokens_per_s=sroof,
                pct_of_streamed_roofline=tps / sroof,
            )
        )
        log(
            f"batch-1 {q}: {tps:.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in rates[q])}); "
            f"{total / 1e6:.0f} MB -> roofline {roof:.1f} tok/s = {tps / roof:.0%}; "
            f"streamed {streamed / 1e6:.0f} MB -> {sroof:.1f} tok/s = {tps / sroof:.0%}"
        )
    return batch1
