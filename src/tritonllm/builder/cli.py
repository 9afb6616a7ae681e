"""`python build_engines/build.py`: HF checkpoint -> engine directory (and optionally a model repository)."""

from __future__ import annotations

import argparse
import sys

from tritonllm.builder.options import KV_CACHE_DTYPES, BuildError, BuildOptions
from tritonllm.engine_format import BACKENDS, EngineDirError
from tritonllm.model.args import UnsupportedModelError
from tritonllm.precision import DTYPES, QUANTIZATIONS

DESCRIPTION = """\
Build what the server runs from a Hugging Face checkpoint (config.json + *.safetensors + tokenizer).

On a machine with an NVIDIA GPU and TensorRT-LLM 1.2.x the result is a TensorRT-LLM engine (quantized
with ModelOpt, compiled by trtllm-build with a paged KV cache); elsewhere it is the project's engine
format (safetensors, weights quantized ahead of time). Either way the output folder holds config.json
(with a "tritonllm_build" block saying what was built, from what, with which versions), the tokenizer
and the weights or engine plan, and `tritonllm launch --model OUTPUT` serves it without the checkpoint.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="build_engines/build.py",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="HF checkpoint directory to build from")
    p.add_argument(
        "--output", required=True, help="engine directory to write (refused if not empty: --force)"
    )
    p.add_argument(
        "--backend",
        choices=("auto", *BACKENDS),
        default="auto",
        help="tensorrt_llm (GPU + TensorRT-LLM 1.2.x), torch (the project's engine, any machine), or auto: "
        "tensorrt_llm when it is installed and a GPU is present, else torch (default: auto)",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="weights: none; int8 (the project's engine: int8 weights and activations in blocks of 32, "
        "llama.cpp's q8_0 arithmetic, lm_head too; the most accurate fast choice on CPUs); int7 (int8's "
        "blocks with 7-bit weights, an int8 lm_head: on CPUs without VNNI (AVX2) decode 1.1x and prefill "
        "1.2x int8's speed from 8 tokens, perplexity as int8's, greedy output further from fp32's; run as "
        "int8 elsewhere); int4 (the "
        "project's engine: llama.cpp's q4_0, 4-bit weights in blocks of 32 with an int8 lm_head; the "
        "fastest at batch 1, at a cost in accuracy: benchmarks/README.md); int8_wo / int4_wo (weight-only, "
        "per channel); fp8 (e4m3 per channel; on CPUs a storage format, computed in the dtype); int8_sq "
        "(SmoothQuant) and int4_awq (AWQ) need calibration and TensorRT-LLM. The torch backend supports "
        "none, int8, int7, int4, int8_wo and fp8 (default: none)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache precision (TensorRT-LLM only; fp8 goes with --quantization fp8); auto: compute dtype",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="dtype of the unquantized weights and activations; auto keeps the checkpoint's (default: auto)",
    )
    p.add_argument("--max-batch-size", type=int, default=64, help="requests batched together (default: 64)")
    p.add_argument("--max-input-len", type=int, help="longest prompt, tokens (default: max-seq-len / 2)")
    p.add_argument(
        "--max-seq-len",
        type=int,
        help="longest prompt + output, tokens (default: the model's context, at most 4096)",
    )
    p.add_argument(
        "--max-num-tokens",
        type=int,
        help="tokens computed per step across the batch (default: 512 torch, 8192 tensorrt_llm)",
    )
    p.add_argument(
        "--tokens-per-block",
        type=int,
        help="tokens per paged KV-cache block (default: 16 torch, 32 tensorrt_llm)",
    )
    p.add_argument(
        "--tp-size", type=int, default=1, help="tensor-parallel GPUs (tensorrt_llm only; default: 1)"
    )
    p.add_argument(
        "--calib-dataset",
        help="calibration data for fp8/int8_sq/int4_awq (tensorrt_llm only): a HF dataset name or local path "
        "(default: TensorRT-LLM's, cnn_dailymail)",
    )
    p.add_argument("--calib-size", type=int, help="calibration samples (tensorrt_llm only; default: 512)")
    p.add_argument(
        "--model-repository",
        help="also write a ready-to-serve Triton model repository for the engine into this folder",
    )
    p.add_argument(
        "--force", action="store_true", help="replace a non-empty --output (once the build has worked)"
    )
    return p


def options_from_args(args: argparse.Namespace) -> BuildOptions:
    return BuildOptions(**vars(args))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from tritonllm.builder.builder import build

    try:
        build(options_from_args(args))
    except (BuildError, EngineDirError, UnsupportedModelError, FileExistsError) as exc:
        print(f"build_engines/build.py: error: {exc}", file=sys.stderr)
        return 2
    return 0
