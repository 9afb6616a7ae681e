"""The KV cache's dtype, side by side in one process: bf16 rows against int8 rows with a scale each.

Two measures, each alternating the two caches round by round (paired medians; this machine drifts):
  kernel  decode attention over one cache per layer (30 for SmolLM2), as a decode step reads them, at
          several (sequences x context) shapes: time a step, and int8 / bf16
  engine  two engines (default weights, dtype auto) on the same prompts: prefill time (until every
          request has its first token) and the median decode-only step, int8 / bf16

    .venv/bin/python benchmarks/bench_kv_cache.py                      # ~3 min on 2 cores
    .venv/bin/python benchmarks/bench_kv_cache.py --shapes 32x128,16x768 --rounds 7

Writes results/kv_cache.json (or --out) with the CPU flags and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from tritonllm.default_model import model_path_or_default
from tritonllm.engine import EngineConfig, LLMEngine, SamplingParams
from tritonllm.model.cpu_kernels import cpu_flags, load_kernels, selected_isa
from tritonllm.model.kv_rows import to_rows

CACHES = ("bfloat16", "int8")


def paired(measure, rounds: int) -> dict[str, list[float]]:
    """measure(cache) for both caches each round, the order swapped every round."""
    times: dict[str, list[float]] = {c: [] for c in CACHES}
    for r in range(rounds):
        for cache in CACHES if r % 2 == 0 else CACHES[::-1]:
            times[cache].append(measure(cache))
    return times


def ratio(times: dict[str, list[float]]) -> float:
    return statistics.median(a / b for a, b in zip(times["int8"], times["bfloat16"], strict=True))


def kernel_step(seqs: int, context: int, layers: int, rounds: int) -> dict[str, float]:
    """Decode attention of one step over `layers` caches of SmolLM2's geometry, blocks scattered."""
    kernels = load_kernels()
    kv_heads, block, head_dim, heads = 3, 16, 64, 9
    width = -(-context // block)
    blocks = seqs * width + 8
    caches = {
        c: [
            tuple(to_rows(torch.randn(kv_heads, blocks, block, head_dim), getattr(torch, c)) for _ in "kv")
            for _ in range(layers)
        ]
        for c in CACHES
    }
    order = torch.randperm(blocks)
    tables = torch.stack([order[i * width : (i + 1) * width] for i in range(seqs)])
    lengths, q = torch.full((seqs,), context), torch.randn(seqs, heads, head_dim)

    def step(cache: str) -> float:
        started = time.perf_counter()
        for _ in range(3):
            for k, v in caches[cache]:
                kernels.paged_decode_attention(q, k, v, tables, lengths, 0.125)
        return (time.perf_counter() - started) / 3

    times = paired(step, rounds)
    return {"bf16_ms": statistics.median(times["bfloat16"]) * 1e3, "int8_over_bf16": ratio(times)}


def engine_run(engine: LLMEngine, seqs: int, context: int, out: int, tag: str) -> tuple[float, float]:
    """(seconds until every request has its first token, median decode-only step in seconds)."""
    rng = random.Random(tag)
    params = SamplingParams(max_tokens=out, min_tokens=out, temperature=0.0)
    for i in range(seqs):
        engine.add_request(f"{tag}-{i}", [rng.randrange(100, 20000) for _ in range(context)], params)
    prefill, steps, started = 0.0, [], set()
    while engine.has_unfinished():
        decoding = len(started) == seqs
        t = time.perf_counter()
        started.update(o.request_id for o in engine.step())
        elapsed = time.perf_counter() - t
        if decoding:
            steps.append(elapsed)
        else:
            prefill += elapsed
    return prefill, statistics.median(steps)


def engine_ab(model: str, seqs: int, context: int, out: int, rounds: int, threads: int) -> dict[str, float]:
    engines = {
        c: LLMEngine(
            EngineConfig(
                model=model,
                dtype="auto",
                quantization="auto",
                kv_cache_dtype=c,
                num_threads=threads,
                max_model_len=context + out + 16,
            )  # fmt: skip
        )
        for c in CACHES
    }
    for c, engine in engines.items():
        engine_run(engine, seqs, context, 8, f"warm-{c}")
    runs: dict[str, list[tuple[float, float]]] = {c: [] for c in CACHES}
    for r in range(rounds):
        for c in CACHES if r % 2 == 0 else CACHES[::-1]:
            runs[c].append(engine_run(engines[c], seqs, context, out, f"r{r}"))  # same prompts for both
    prefill = {c: [p for p, _ in runs[c]] for c in CACHES}
    decode = {c: [d for _, d in runs[c]] for c in CACHES}
    return {
        "bf16_prefill_s": statistics.median(prefill["bfloat16"]),
        "prefill_int8_over_bf16": ratio(prefill),
        "bf16_decode_step_ms": statistics.median(decode["bfloat16"]) * 1e3,
        "decode_int8_over_bf16": ratio(decode),
    }


def shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in shape.split("x")) for shape in text.split(",")]  # type: ignore[misc]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--kernel-shapes", type=shapes, default="32x200,32x400,16x900,1x1000,1x4000")
    parser.add_argument(
        "--shapes", type=shapes, default="8x128,32x128,16x768", help="engine: sequences x prompt"
    )
    parser.add_argument("--out-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_cache.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"cpu_flags": cpu_flags(), "isa": selected_isa(), "load_average": os.getloadavg()}
    result["kernel"], result["engine"] = {}, {}
    print(
        f"CPU flags: {' '.join(result['cpu_flags'])}; kernels {result['isa']}; load {result['load_average']}"
    )
    for seqs, context in args.kernel_shapes:
        row = kernel_step(seqs, context, 30, 9)
        result["kernel"][f"{seqs}x{context}"] = row
        print(
            f"kernel {seqs} x {context}: bf16 {row['bf16_ms']:.2f} ms a step, "
            f"int8/bf16 {row['int8_over_bf16']:.3f}",
            flush=True,
        )
    model = model_path_or_default(args.model)
    for seqs, context in args.shapes:
        row = engine_ab(model, seqs, context, args.out_tokens, args.rounds, args.threads)
        result["engine"][f"{seqs}x{context}"] = row
        print(
            f"engine {seqs} x {context}+{args.out_tokens}: prefill bf16 {row['bf16_prefill_s']:.2f} s, "
            f"int8/bf16 {row['prefill_int8_over_bf16']:.3f}; "
            f"decode step bf16 {row['bf16_decode_step_ms']:.2f} ms, "
            f"int8/bf16 {row['decode_int8_over_bf16']:.3f}",
            flush=True,
        )
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
