"""Linear kernels side by side on SmolLM2's shapes: fp32 oneDNN (prepacked) vs the project's bf16 and int8
kernels, for 1 to 128 tokens per step. One thread, CPU time of the calling thread (so other processes on
a busy machine do not count), best of `--runs`: per-kernel costs that are stable enough to compare.

    .venv/bin/python benchmarks/bench_kernels.py [--runs 5] [--isa avx2]
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import torch

from tritonllm.model.cpu_kernels import cpu_flags, load_kernels, selected_isa
from tritonllm.model.quant import quantize_int8_blocks

# SmolLM2-135M: 30 layers of qkv (960x576), o (576x576), gate_up (3072x576), down (576x1536); lm_head.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def best_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return min(times) * 1e3


def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def time_body(linear, stack, inputs: dict[int, torch.Tensor], runs: int) -> float:
    """Best time of one pass of `linear` over every layer's weights in `stack`."""

    def run() -> None:
        for layer in stack:
            for w, (_, k) in zip(layer, LAYER_SHAPES, strict=True):
                linear(inputs[k], w)

    return best_ms(run, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--isa", help="kernel build to use (default: the best this CPU runs)")
    parser.add_argument("--tokens", default="1,8,32,128")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernels = load_kernels(args.isa)
    isa = args.isa or selected_isa()
    print(f"CPU flags: {' '.join(cpu_flags())}; kernels: {isa}; load average {os.getloadavg()}")
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in LAYER_SHAPES] for _ in range(NUM_LAYERS)]
    head = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02
    fp32 = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in weights]
    bf16 = [[w.bfloat16() for w in layer] for layer in weights]
    int8 = [[kernels.int8_pack(*quantize_int8_blocks(w)) for w in layer] for layer in weights]
    head_fp32, head_bf16 = torch.ops.mkldnn._reorder_linear_weight(head, 64), head.bfloat16()
    print("| tokens | body fp32 oneDNN ms | body bf16 | body int8 | int8 / fp32 | head fp32 | head bf16 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for m in (int(t) for t in args.tokens.split(",")):
        inputs = {k: torch.randn(m, k, generator=gen) for _, k in LAYER_SHAPES}
        t_fp32 = time_body(onednn, fp32, inputs, args.runs)
        t_bf16 = time_body(kernels.bf16_linear, bf16, inputs, args.runs)
        t_int8 = time_body(kernels.int8_linear, int8, inputs, args.runs)
        x = inputs[HIDDEN]
        h_fp32 = best_ms(partial(onednn, x, head_fp32), args.runs)
        h_bf16 = best_ms(partial(kernels.bf16_linear, x, head_bf16), args.runs)
        print(
            f"| {m} | {t_fp32:.1f} | {t_bf16:.1f} | {t_int8:.1f} | {t_int8 / t_fp32:.2f} "
            f"| {h_fp32:.1f} | {h_bf16:.1f} |"
        )


if __name__ == "__main__":
    main()
