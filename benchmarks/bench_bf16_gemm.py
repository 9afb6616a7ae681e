"""bf16 linears: the project's kernel against oneDNN's GEMM (ATen's mm), side by side in one process.

On CPUs with AMX the kernels hand bf16 activations of `ONEDNN_BF16_MIN_TOKENS` tokens or more to the GEMM
(cpu_kernels.py); with AVX512_BF16 alone they did from 128 tokens until bf16 weights were packed
(bench_bf16_packed.py), and TRITONLLM_ONEDNN_BF16_MIN_TOKENS=N brings that path back. Two measures, each
alternating the two paths (paired medians; this machine drifts):
  linears  SmolLM2's 120 body linears (bf16 weights, bf16 activations) at several token counts: wall time
           of the kernel and of the GEMM, GEMM / kernel; where the crossover lies
  engine   one bf16 engine, the GEMM threshold 0 (kernels only) against the CPU's default, on fresh
           prompts per run: prefill time, median decode-only step, output tok/s, default / kernels only

    .venv/bin/python benchmarks/bench_bf16_gemm.py                 # ~4 min on 2 cores
    TRITONLLM_ONEDNN_BF16_MIN_TOKENS=8 .venv/bin/python benchmarks/bench_bf16_gemm.py --shapes 8x128

Writes results/bf16_gemm.json (or --out) with the CPU flags and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_kernels import LAYER_SHAPES, NUM_LAYERS
from bench_kv_cache import engine_run, shapes

from tritonllm.default_model import model_path_or_default
from tritonllm.engine import EngineConfig, LLMEngine
from tritonllm.model.cpu_kernels import cpu_flags, load_kernels, onednn_bf16_min_tokens, selected_isa


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_calls(linear, calls: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, w in calls:
        linear(x, w)


def linears(tokens: list[int]) -> dict[str, dict[str, float]]:
    """Wall time of the body's linears through the kernel and through ATen's mm (the GEMM path)."""
    kernels = load_kernels()
    previous = kernels.onednn_bf16_min_tokens()
    kernels.set_onednn_bf16_min_tokens(0)
    gen = torch.Generator().manual_seed(0)
    layers = [[(torch.randn(n, k, generator=gen) * 0.02).bfloat16() for n, k in LAYER_SHAPES]]
    layers += [[w.clone() for w in layers[0]] for _ in range(NUM_LAYERS - 1)]  # 30 layers' bytes, as a step
    rows = {}
    try:
        for m in tokens:
            calls = [
                (torch.randn(m, k, generator=gen).bfloat16(), w)
                for layer in layers
                for w, (_, k) in zip(layer, LAYER_SHAPES, strict=True)
            ]
            reps = 7 if m >= 128 else 15
            kernel = median_ms(partial(run_calls, kernels.bf16_linear, calls), reps)
            gemm = median_ms(partial(run_calls, F.linear, calls), reps)
            rows[str(m)] = {"kernel_ms": kernel, "gemm_ms": gemm, "gemm_over_kernel": gemm / kernel}
            print(
                f"linears, {m} tokens: kernel {kernel:.2f} ms, GEMM {gemm:.2f} ms ({gemm / kernel:.2f})",
                flush=True,
            )
    finally:
        kernels.set_onednn_bf16_min_tokens(previous)
    return rows


def engine_ab(model: str, seqs: int, prompt: int, out: int, rounds: int, threads: int, default: int) -> dict:
    kernels = load_kernels()
    engine = LLMEngine(
        EngineConfig(model=model, dtype="bfloat16", quantization="none", num_threads=threads,
                     max_model_len=prompt + out + 16)
    )  # fmt: skip
    engine_run(engine, seqs, prompt, 4, "warm")
    runs: dict[int, list[tuple[float, float, float]]] = {0: [], default: []}
    try:
        for r in range(rounds):
            for threshold in (0, default) if r % 2 == 0 else (default, 0):
                kernels.set_onednn_bf16_min_tokens(threshold)
                start = time.perf_counter()
                prefill, step = engine_run(engine, seqs, prompt, out, f"r{r}-{threshold}")  # no prefix hits
                runs[threshold].append((prefill, step, seqs * out / (time.perf_counter() - start)))
    finally:
        kernels.set_onednn_bf16_min_tokens(default)

    def paired(i: int) -> float:
        return statistics.median(a[i] / b[i] for a, b in zip(runs[default], runs[0], strict=True))

    def median(threshold: int, i: int) -> float:
        return statistics.median(run[i] for run in runs[threshold])

    return {
        "prefill_s": {"kernels": median(0, 0), "default": median(default, 0), "ratio": paired(0)},
        "decode_step_ms": {
            "kernels": median(0, 1) * 1e3,
            "default": median(default, 1) * 1e3,
            "ratio": paired(1),
        },
        "tok_s": {"kernels": median(0, 2), "default": median(default, 2), "ratio": paired(2)},
    }


def engine_rows(shapes: list, out_tokens: int, label: str, keys: tuple[str, str], ab) -> dict[str, dict]:
    """ab(seqs, prompt) for each shape, printed as it comes: each measure's two sides (`keys`) and ratio."""
    rows = {}
    for seqs, prompt in shapes:
        row = rows[f"{seqs}x{prompt}"] = ab(seqs, prompt)
        measures = "; ".join(
            f"{k} {v[keys[0]]:.3g} / {v[keys[1]]:.3g} ({v['ratio']:.3f})" for k, v in row.items()
        )
        print(f"engine {seqs} x {prompt}+{out_tokens}, {label}: {measures}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", default="1,4,8,16,32,64,128,256,512", help="linears: tokens per call")
    parser.add_argument(
        "--shapes", type=shapes, default="1x128,8x128,32x128,16x512", help="engine: sequences x prompt"
    )
    parser.add_argument("--out-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bf16_gemm.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    default = onednn_bf16_min_tokens()
    if default == 0:
        raise SystemExit(
            "no GEMM here (only AMX CPUs take it; with AVX512_BF16 alone bf16 weights run packed: "
            "bench_bf16_packed.py): set TRITONLLM_ONEDNN_BF16_MIN_TOKENS=N to try one"
        )
    result = {"cpu_flags": cpu_flags(), "isa": selected_isa(), "load_average": os.getloadavg()}
    result["threshold"] = default
    print(f"CPU flags: {' '.join(cpu_flags())}; kernels {selected_isa()}; GEMM from {default} tokens")
    result["linears"] = linears([int(t) for t in args.tokens.split(",")])
    model = model_path_or_default(args.model)
    result["engine"] = engine_rows(
        args.shapes,
        args.out_tokens,
        f"kernels only / GEMM from {default} tokens",
        ("kernels", "default"),
        lambda seqs, prompt: engine_ab(
            model, seqs, prompt, args.out_tokens, args.rounds, args.threads, default
        ),
    )
    result["load_average_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
