"""Linear layers and weight-only quantization: INT8 per output channel, FP8 (e4m3) rounding.

INT8 uses PyTorch's int8-weight matmul kernel, which reads a quarter of fp32's bytes per step: faster
at batch 1 (memory-bound), slower at large batches on CPUs without an int8-weight GEMM (measured in
benchmarks/). FP8 keeps FP8's accuracy but computes in the model dtype (see `fp8_linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_MAX = 448.0  # largest finite float8_e4m3fn


class Linear(nn.Module):
    """y = x W^T + b with W in the compute dtype.

    On CPU in fp32 the weight is repacked once into oneDNN's blocked layout: its GEMM ran 1.3-2x
    faster than the default BLAS call on this project's machines (AMD EPYC, AVX2), at batch 1 and 32.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_available()
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
        self.register_buffer("weight", weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


ONEDNN_BATCH_HINT = 64  # rows per GEMM the packing is tuned for; measured good from 1 to 512


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W ~= scale[:, None] * W_int8: int8 weights, one fp32 scale per output channel (symmetric, absmax)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W ~= scale[:, None] * W_fp8: e4m3 weights and one fp32 scale per output channel."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale


QUANTIZERS = {"int8_wo": quantize_int8, "fp8": quantize_fp8}


class Int8Linear(nn.Module):
    """y = x (scale[:, None] * W_int8)^T + b.

    The CPU kernel is fast with bf16 activations (3x fp32 at batch 1 here) and slow with fp32 ones,
    so activations go through it in bf16 and come back in the compute dtype.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight, self.scale)
        y = y.reshape(*shape[:-1], -1).to(x.dtype)
        return y if self.bias is None else y + self.bias


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
    return Int8Linear(*quantize_int8(weight), bias)


def fp8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """Weights rounded to FP8 (e4m3, one scale per output channel), then expanded for compute.

    FP8 is a storage format here: this CPU has no FP8 (nor fast bf16) GEMM, and converting fp8 to
    fp32 in every step cost ~15 ns an element (2-3 s a step for SmolLM2), so the expansion happens
    once at load. The accuracy is FP8's; the speed and memory are the compute dtype's.
    """
    return Linear(expand_fp8(*quantize_fp8(weight), weight.dtype), bias)


def expand_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight.float() * scale.float()[:, None]).to(dtype)


LINEAR_TYPES = {"none": Linear, "int8_wo": int8_linear, "fp8": fp8_linear}


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str) -> nn.Module:
    return LINEAR_TYPES[quantization](weight, bias)


def prequantized_linear(
    weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> nn.Module:
    """A linear over weights quantized ahead of time (an engine directory), by their storage dtype."""
    if weight.dtype == torch.int8:
        return Int8Linear(weight, scale, bias)
    if weight.dtype == torch.float8_e4m3fn:
        return Linear(expand_fp8(weight, scale, dtype), bias)
    raise ValueError(f"no pre-quantized linear for weights of dtype {weight.dtype}")
