"""Decode-step (or prefill) time of one engine with this tree's CPU kernels (A) against another tree's (B), in
one process.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/bench_kernels_ab.py --against /tmp/base --quantization int8 --batch 1
    .venv/bin/python benchmarks/bench_kernels_ab.py --against /tmp/base --prefill --prompt-tokens 1024
    .venv/bin/python benchmarks/bench_kernels_ab.py --quantization int7 --quantization-b int8 --batch 32

Both builds are loaded (B compiled from `<against>/src/tritonllm/model/csrc` under its own name); the engine
runs the same requests with A, then B, alternating the order each round, and prints each round's median
step time and the paired B/A ratios (> 1: A is faster). Runs in separate processes differ by up to 30% on
a shared 2-core VM; alternating in one process pairs rounds under the same conditions. Both builds must
take the same packed weights (the kernels' int8 layout) and have the bindings the model calls.
With --quantization-b, B is a second engine of this tree with other weights, run the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torch.utils.cpp_extension import load  # noqa: E402

from tritonllm.default_model import default_model_path  # noqa: E402
from tritonllm.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tritonllm.model import cpu_kernels, llama, quant  # noqa: E402

USERS = (llama, quant)  # the model's users of load_kernels() (the sampler keeps A's argmax)


def build_other(tree: Path):
    """The other tree's kernels for this CPU's instruction set, under a name of their own."""
    csrc = tree / "src" / "tritonllm" / "model" / "csrc"
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(csrc.iterdir()) if p.is_file())).hexdigest()
    isa = cpu_kernels.selected_isa()
    return load(
        name=f"tritonllm_ab_{isa}_{digest[:8]}",
        sources=[str(csrc / "bindings.cpp")],
        extra_cflags=["-O3", "-fopenmp", "-ffast-math", *cpu_kernels.ISA_FLAGS[isa]],
        extra_ldflags=["-fopenmp"],
    )


def use(kernels, engine: LLMEngine) -> None:
    for module in USERS:
        module.load_kernels = lambda *_, k=kernels: k
    # Each build threads its own loops: its own pool (csrc/thread_pool.h), or OpenMP in trees before it.
    if engine.runner.pool_threads:
        engine.runner.use_thread_pool = getattr(kernels, "use_thread_pool", None)


def round_ms(engine: LLMEngine, tag: str, batch: int, prompt: int, tokens: int, prefill: bool) -> float:
    """Median decode-step time (ms) of `batch` requests generating `tokens` each; with `prefill`, the time
    until every one of them has its first token."""
    params = SamplingParams(max_tokens=1 if prefill else tokens, min_tokens=0 if prefill else tokens, top_k=1)
    started_all = time.perf_counter_ns()
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [100 + i, *range(101, 100 + prompt)], params)
    steps = []
    while engine.has_unfinished():
        started = time.perf_counter_ns()
        engine.step()
        steps.append(time.perf_counter_ns() - started)
    if prefill:
        return (time.perf_counter_ns() - started_all) / 1e6
    return statistics.median(steps[batch + 1 :]) / 1e6  # after the prefill steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--against", type=Path, help="the other tree (a git worktree)")
    parser.add_argument("--model", default=None, help="an HF model directory (default: SmolLM2)")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--quantization-b", help="B: this tree's engine with these weights (not --against)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", action="store_true", help="time the prompts' prefill, not decode steps")
    args = parser.parse_args()
    if (args.against is None) == (args.quantization_b is None):
        parser.error("give one of --against and --quantization-b")
    this = cpu_kernels.load_kernels()
    builds = {"A": this, "B": build_other(args.against) if args.against else this}

    def engine_with(quantization: str) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=args.model or str(default_model_path()),
                num_threads=args.threads,
                dtype=args.dtype,
                quantization=quantization,
                kv_cache_memory_bytes=256 << 20,
                # every round's prompts are the same: cached, no prefill
                enable_prefix_caching=not args.prefill,
            )
        )

    engine = engine_with(args.quantization)
    engines = {"A": engine, "B": engine_with(args.quantization_b) if args.quantization_b else engine}
    print(f"CPU flags: {' '.join(cpu_kernels.cpu_flags())}; load average {os.getloadavg()}")
    print(
        f"A: {args.quantization}, this tree; "
        f"B: {args.quantization_b or args.quantization}, {args.against or 'this tree'}"
    )
    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            use(builds[name], engines[name])
            step_ms = round_ms(
                engines[name], f"{name}{r}", args.batch, args.prompt_tokens, args.max_tokens, args.prefill
            )
            times[name].append(step_ms)
        a, b = times["A"][-1], times["B"][-1]
        print(f"round {r + 1}/{args.rounds}: A {a:.2f} ms, B {b:.2f} ms", flush=True)
    ratios = [b / a for a, b in zip(times["A"], times["B"], strict=True)]
    what = f"prefill of {args.batch} x {args.prompt_tokens} tokens" if args.prefill else "step"
    print(
        f"{args.quantization} batch {args.batch}: {what} A {statistics.median(times['A']):.2f} ms, "
        f"B {statistics.median(times['B']):.2f} ms; B/A paired median {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
