"""The engine under load: everything submitted at once, stepped to completion, KV cache sampled per step."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from tritonllm.engine import EngineConfig, LLMEngine

from .workload import Request, ThroughputResult, greedy

# Every engine's scheduler and cache shape, also recorded in the report's settings.
ENGINE_SETTINGS = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "tokens_per_block": 16}


def build_engine(model: Path, variant: str, threads: int, kv_bytes: int) -> LLMEngine:
    """`variant`: a quantization, or `dtype:quantization` (float32 when no dtype is given)."""
    dtype, _, quantization = variant.rpartition(":")
    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype=dtype or "float32",
            quantization=quantization,
            num_threads=threads,
            kv_cache_memory_bytes=kv_bytes,
            **ENGINE_SETTINGS,
        )
    )


@dataclass
class KVSample:
    t: float  # seconds since submission, at the end of the step
    dt: float  # the step's duration
    stored: int
    reserved: int  # kv_blocks_used * tokens_per_block
    running: int


@dataclass
class KVUtilResult:
    paged_time_avg: float  # kv_tokens_stored / (kv_blocks_used * tokens_per_block), step-time weighted
    contiguous_time_avg: float  # kv_tokens_stored / (num_running * max_model_len), step-time weighted
    paged_min: float
    max_model_len: int
    tokens_per_block: int
    num_steps: int
    peak_blocks_used: int
    kv_blocks_total: int


def run_engine(
    eng: LLMEngine, requests: list[Request], name: str, max_model_len: int
) -> tuple[ThroughputResult, dict, KVUtilResult, list[KVSample]]:
    """Submit everything at once and step to completion, sampling the KV cache after every step."""
    useful = sum(r.max_tokens for r in requests)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    first_token_ns: dict[str, int] = {}
    samples: list[KVSample] = []
    progress = tqdm(total=useful, desc=name, unit="tok", mininterval=5, file=sys.stdout)
    preempt0 = eng.stats().num_preemptions
    submit_ns = time.time_ns()
    t0 = time.perf_counter()
    for r in requests:
        eng.add_request(r.request_id, r.prompt, greedy(r.max_tokens))
    while eng.has_unfinished():
        ts = time.perf_counter()
        outs = eng.step()
        te = time.perf_counter()
        st = eng.stats()
        samples.append(
            KVSample(
                te - t0, te - ts, st.kv_tokens_stored, st.kv_blocks_used * st.tokens_per_block, st.num_running
            )
        )
        for o in outs:
            if o.error:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            outputs[o.request_id].extend(o.new_token_ids)
            first_token_ns.setdefault(o.request_id, o.first_token_time_ns)
            progress.update(len(o.new_token_ids))
    wall = time.perf_counter() - t0
    progress.close()
    got = sum(len(v) for v in outputs.values())
    if got != useful:
        raise RuntimeError(f"{name}: engine produced {got} tokens, {useful} requested")
    ttft = [(first_token_ns[r.request_id] - submit_ns) / 1e9 for r in requests]
    st = eng.stats()
    result = ThroughputResult.measured(
        name,
        requests,
        got,
        wall,
        ttft,
        num_preemptions=st.num_preemptions - preempt0,
        extra={"num_steps": len(samples)},
    )
    return (
        result,
        outputs,
        kv_utilisation(samples, max_model_len, st.tokens_per_block, st.kv_blocks_total),
        samples,
    )


def kv_utilisation(
    samples: list[KVSample], max_model_len: int, tokens_per_block: int, total: int
) -> KVUtilResult:
    live = [s for s in samples if s.running and s.reserved]
    weight = sum(s.dt for s in live) or 1.0
    paged = [s.stored / s.reserved for s in live]
    contiguous = [s.stored / (s.running * max_model_len) for s in live]
    return KVUtilResult(
        paged_time_avg=sum(p * s.dt for p, s in zip(paged, live, strict=True)) / weight,
        contiguous_time_avg=sum(c * s.dt for c, s in zip(contiguous, live, strict=True)) / weight,
        paged_min=min(paged, default=float("nan")),
        max_model_len=max_model_len,
        tokens_per_block=tokens_per_block,
        num_steps=len(samples),
        peak_blocks_used=max((s.reserved // tokens_per_block for s in samples), default=0),
        kv_blocks_total=total,
    )
