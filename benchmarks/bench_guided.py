"""What constrained decoding costs: 32 concurrent requests with 0%, 50% and 100% under a JSON schema.

In-process `LLMEngine` on SmolLM2-135M-Instruct (fp32), greedy chat prompts. Every request generates
exactly `--max-tokens` tokens (unconstrained ones with `ignore_eos`, constrained ones under a schema
whose `notes` string is longer than that), so each mix runs the same batch shape step for step and
the differences are the cost of the grammar: matchers, masks, and the sampler path they take.
The mixes run interleaved, rotated every round; medians over rounds, ratios against 0%.

Also measured: the mask alone (`TokenMasks.apply`) for 1, 8 and 32 rows over SmolLM2's 49k vocabulary,
and grammar compile times (tokenizer conversion on first use, a new schema, a cached one).

    .venv/bin/python benchmarks/bench_guided.py                  # 3 rounds x 3 mixes, 64 tokens
    .venv/bin/python benchmarks/bench_guided.py --rounds 5 --max-tokens 32 --threads 2

Writes `results/guided.json` and `results/guided.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from tritonllm.default_model import model_path_or_default
from tritonllm.engine import EngineConfig, LLMEngine, SamplingParams
from tritonllm.engine.guided import GuideCompiler, TokenMasks
from tritonllm.engine.sampler import Sampler
from tritonllm.tokenization import encode_prompt, load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "notes": {"type": "string", "minLength": 2000},  # never closed within max_tokens
    },
    "required": ["name", "age", "city", "notes"],
    "additionalProperties": False,
}
TOPICS = ["a baker", "a sailor", "a teacher", "an astronaut", "a farmer", "a doctor", "a painter", "a pilot"]
MIXES = (0.0, 0.5, 1.0)


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
                return " ".join(f for f in wanted if f in flags)
    except OSError:
        pass
    return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class TimedSampler(Sampler):
    """The engine's sampler, timing each call (the mask is applied inside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def __call__(self, logits, seqs):
        start = time.perf_counter()
        result = super().__call__(logits, seqs)
        self.times.append(time.perf_counter() - start)
        return result


def run_mix(engine: LLMEngine, prompts: list[list[int]], fraction: float, max_tokens: int) -> dict:
    """All requests at once; throughput, median full-batch step time and sampler time."""
    sampler = TimedSampler()
    engine.runner.sampler = sampler
    schema = json.dumps(SCHEMA)
    n_guided = round(fraction * len(prompts))
    for i, prompt in enumerate(prompts):
        guided = i % len(prompts) < n_guided
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=not guided,
            guided_decoding_guide_type="json_schema" if guided else None,
            guided_decoding_guide=schema if guided else None,
        )
        engine.add_request(f"{fraction}-{i}", prompt, params)
    steps, tokens = [], 0
    start = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append((time.perf_counter() - t0, len(outs)))
        tokens += sum(len(o.new_token_ids) for o in outs)
        for out in outs:
            if out.finished and out.finish_reason.value != "length":
                raise RuntimeError(
                    f"{out.request_id} ended with {out.finish_reason}: the shapes would differ"
                )
    elapsed = time.perf_counter() - start
    full = [t for t, n in steps if n == len(prompts)]
    decode_sampler = [t for t, (_, n) in zip(sampler.times, steps, strict=False) if n == len(prompts)]
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tok_per_s": tokens / elapsed,
        "step_ms": statistics.median(full) * 1e3,
        "sampler_ms": statistics.median(decode_sampler) * 1e3,
    }


def mask_cost(model: str, vocab_size: int, eos_ids: list[int], repeats: int = 50) -> dict:
    """`TokenMasks.apply` alone: rows at the schema's start and inside its long string."""
    tokenizer = load_tokenizer(model)
    timings = {}
    start = time.perf_counter()
    compiler = GuideCompiler(model, vocab_size, eos_ids)
    compiler.tokenizer()
    timings["tokenizer_conversion_ms"] = (time.perf_counter() - start) * 1e3
    schema = json.dumps(SCHEMA)
    start = time.perf_counter()
    compiler.compile("json_schema", schema)
    timings["compile_new_schema_ms"] = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    for _ in range(repeats):
        compiler.matcher("json_schema", schema)
    timings["cached_matcher_us"] = (time.perf_counter() - start) / repeats * 1e6
    prefix = tokenizer.encode(
        '{"name": "Ada", "age": 36, "city": "Paris", "notes": "She', add_special_tokens=False
    )
    masks = TokenMasks()
    for rows in (1, 8, 32):
        for state in ("start", "in_string"):
            matchers = [compiler.matcher("json_schema", schema) for _ in range(rows)]
            if state == "in_string":
                for m in matchers:
                    for t in prefix:
                        assert m.accept(t), m.error
            logits = torch.randn(rows, vocab_size)
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                masks.apply(logits, list(range(rows)), matchers, [set(eos_ids)] * rows)
                samples.append(time.perf_counter() - t0)
            timings[f"mask_{rows}_rows_{state}_ms"] = statistics.median(samples) * 1e3
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF checkpoint or engine directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()

    model = model_path_or_default(args.model)
    tokenizer = load_tokenizer(model)
    prompts = [
        encode_prompt(
            tokenizer, f"Describe {TOPICS[i % len(TOPICS)]} number {i} as a JSON record.", chat=True
        )
        for i in range(args.requests)
    ]
    engine = LLMEngine(
        EngineConfig(model=model, num_threads=args.threads, max_num_seqs=args.requests, num_kv_blocks=1024)
    )
    load_before = load_average()
    print("mask alone and compile times ...", file=sys.stderr, flush=True)
    masks = mask_cost(model, engine.vocab_size, sorted(engine.eos_ids))
    run_mix(engine, prompts[:4], 1.0, 4)  # warm-up: kernels, first steps
    runs: dict[float, list[dict]] = {m: [] for m in MIXES}
    for r in range(args.rounds):
        order = MIXES[r % 3 :] + MIXES[: r % 3]
        for fraction in order:
            runs[fraction].append(run_mix(engine, prompts, fraction, args.max_tokens))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    summary = {}
    for fraction in MIXES:
        summary[f"{fraction:.0%}"] = {
            key: statistics.median(run[key] for run in runs[fraction])
            for key in ("tok_per_s", "step_ms", "sampler_ms")
        }
    base = summary["0%"]
    for s in summary.values():
        s["tok_per_s_ratio"] = s["tok_per_s"] / base["tok_per_s"]
        s["step_ratio"] = s["step_ms"] / base["step_ms"]
    meta = {
        "model": Path(model).name,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "threads": args.threads,
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "load_average": [load_before, load_average()],
        "torch": torch.__version__,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "guided.json").write_text(
        json.dumps({"config": meta, "mixes": summary, "mask": masks}, indent=2) + "\n"
    )
    lines = [
        f"`{meta['model']}` fp32, {args.requests} concurrent greedy requests x {args.max_tokens} tokens, "
        f"{args.threads} threads, {args.rounds} rounds (medians); {meta['cpu']} ({meta['cpu_flags']}), "
        f"load average {load_before:.1f} -> {meta['load_average'][1]:.1f}.",
        "",
        "| constrained | output tok/s | ratio | full-batch step ms | ratio | sampler ms per step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['tok_per_s']:.1f} | {s['tok_per_s_ratio']:.3f} | {s['step_ms']:.1f} | "
            f"{s['step_ratio']:.3f} | {s['sampler_ms']:.2f} |"
        )
    lines += ["", "| grammar cost outside the engine | value |", "| --- | --- |"]
    lines += [f"| {key} | {value:.3f} |" for key, value in masks.items()]
    (out / "guided.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
