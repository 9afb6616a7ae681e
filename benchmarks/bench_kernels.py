"""Linear kernels side by side on SmolLM2's shapes: fp32 oneDNN (prepacked) vs the project's bf16 and int8
kernels, for 1 to 128 tokens per step; where oneDNN has a bf16 path (AVX-512 BF16 or AMX CPUs), also its
bf16 GEMM on bf16 activations (AMX tiles where the CPU has them), on the weights as the bf16 kernel keeps
them (F.linear) and prepacked (a second copy of the weights). One thread, CPU time of the calling thread
(so other processes on a busy machine do not count), best of `--runs`: per-kernel costs that are stable
enough to compare.

    .venv/bin/python benchmarks/bench_kernels.py [--runs 5] [--isa avx2]
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import torch
import torch.nn.functional as F

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
    onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if onednn_bf16:
        packed_bf16 = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in bf16]
        head_packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(head_bf16, 64)
    kernels.set_onednn_bf16_min_tokens(0)  # the kernels themselves; oneDNN's bf16 GEMM has its own columns
    print(
        "| tokens | body fp32 oneDNN ms | body bf16 | body bf16, bf16 x | body int8 | int8 / fp32 "
        "| body bf16 F.linear | body bf16 oneDNN | head fp32 | head bf16 | head bf16 oneDNN |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in (int(t) for t in args.tokens.split(",")):
        inputs = {k: torch.randn(m, k, generator=gen) for _, k in LAYER_SHAPES}
        bf16_inputs = {k: v.bfloat16() for k, v in inputs.items()}
        t_fp32 = time_body(onednn, fp32, inputs, args.runs)
        t_bf16 = time_body(kernels.bf16_linear, bf16, inputs, args.runs)
        t_bf16_x = time_body(kernels.bf16_linear, bf16, bf16_inputs, args.runs)
        t_int8 = time_body(kernels.int8_linear, int8, inputs, args.runs)
        x = inputs[HIDDEN]
        h_fp32 = best_ms(partial(onednn, x, head_fp32), args.runs)
        h_bf16 = best_ms(partial(kernels.bf16_linear, x, head_bf16), args.runs)
        t_linear_bf16 = t_onednn_bf16 = h_onednn_bf16 = "-"
        if onednn_bf16:
            t_linear_bf16 = f"{time_body(F.linear, bf16, bf16_inputs, args.runs):.1f}"
            t_onednn_bf16 = f"{time_body(onednn, packed_bf16, bf16_inputs, args.runs):.1f}"
            h_onednn_bf16 = f"{best_ms(partial(onednn, x.bfloat16(), head_packed_bf16), args.runs):.1f}"
        print(
            f"| {m} | {t_fp32:.1f} | {t_bf16:.1f} | {t_bf16_x:.1f} | {t_int8:.1f} | {t_int8 / t_fp32:.2f} "
            f"| {t_linear_bf16} | {t_onednn_bf16} | {h_fp32:.1f} | {h_bf16:.1f} | {h_onednn_bf16} |"
        )


if __name__ == "__main__":
    main()
