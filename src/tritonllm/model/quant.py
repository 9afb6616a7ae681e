"""Linear layers and weight quantization.

- `int8`: int8 weights in blocks of 32 with one scale each, times int8 activations quantized per token
  and block on the fly (llama.cpp's q8_0 arithmetic), through the project's kernel (`csrc/int8_linear.cpp`);
  the lm_head too (as in llama.cpp's q8_0 files): on SmolLM2 an int8 head moved perplexity by 0.02%
  against a bf16 one, and reads 32 MB per step instead of 57 (a sixth of what batch 1 reads).
- `int7`: int8's blocks, scales, bytes and kernels, with weights held to -63..63 (7 bits). CPUs without VNNI
  (AVX2) multiply int8's signed weights with one extra sign operation per 32 products; 7-bit weights go into
  the multiply as they are (stored + 64, unsigned), and that op's pipe time goes to the products: linears
  1.2-1.3x int8's speed from 8 tokens there (decode steps 1.1x, prefill 1.2x), perplexity as int8's, greedy
  output further from fp32's (benchmarks/README.md#int7). The lm_head stays int8. The VNNI and AMX builds
  run them as int8 (vpdpbusd has no such op to save). Opt-in.
- `int4`: 4-bit weights in blocks of 32 with one fp16 scale each (llama.cpp's q4_0), through the same kernels
  (`csrc/int4_linear.cpp`): half int8's bytes, for batch-1 decode that streams every weight each token. The
  lm_head stays int8 (llama.cpp's q4_0 files keep their output tensor at higher precision too).
- `int8_wo`: int8 weights per output channel through PyTorch's int8-weight matmul (weight-only; slower
  than `int8` at every batch size here, kept for engine directories built with it).
- `fp8`: weights rounded to e4m3 and expanded at load (FP8's accuracy, the compute dtype's speed).
bf16 weights on CPU run through the project's kernel too (fp32 accumulation). Speed: benchmarks/README.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.model.cpu_kernels import load_kernels

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


# From this many tokens (prefill chunks) bf16 linears expand their whole weight to fp32 and run the BLAS
# GEMM: 25-40% faster than the kernel's tile loop at 512 tokens on SmolLM2's shapes (1 thread), and the
# expansion costs ~2% of that GEMM. Below it the kernel wins. (int8 linears run their kernel throughout.)
BLAS_MIN_TOKENS = 256


def blas_sized(x: torch.Tensor) -> bool:
    return x.numel() >= BLAS_MIN_TOKENS * x.shape[-1]


def cpu_kernels(device: torch.device):
    """The project's compiled CPU kernels for a weight on `device`, or None (other devices, no compiler)."""
    return load_kernels() if device.type == "cpu" else None


class Bf16Linear(nn.Module):
    """y = x W^T + b with bf16 weights and fp32 accumulation; x in fp32 or bf16, y in x's dtype.

    On CPU the kernel converts weights in registers (any AVX2 CPU; no native bf16 needed), and on CPUs with
    AMX hands bf16 activations from a number of tokens on (cpu_kernels.py) to oneDNN's GEMM; without the
    kernel, F.linear in bf16. Where the build packs bf16 weights (`packs_bf16`: AVX512_BF16 without AMX; an
    even number of inputs) the weight is stored in tiles of 16 rows for vdpbf16ps
    (`csrc/bf16_packed_linear.cpp`, every batch size; activations in bf16).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.kernels = cpu_kernels(weight.device)
        self.out_features = weight.shape[0]
        self.packed = self.kernels is not None and self.kernels.packs_bf16() and weight.shape[1] % 2 == 0
        if self.kernels is not None:  # the binding this weight runs on, as BlockLinear's kernel_linear
            self.kernel_linear = self.kernels.bf16_packed_linear if self.packed else self.kernels.bf16_linear
        weight = weight.to(torch.bfloat16).contiguous()
        if self.packed:
            weight = self.kernels.bf16_pack(weight)
            if bias is not None:  # padded like the rows
                bias = F.pad(bias.float(), (0, weight.shape[0] * PACKED_BF16_ROWS - self.out_features))
        self.register_buffer("weight", weight)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            y = self.kernel_linear(x.to(torch.bfloat16).contiguous(), self.weight, self.bias)
            return y[..., : self.out_features].to(x.dtype)
        if self.kernels is not None and blas_sized(x) and not self.onednn_bf16(x):
            return F.linear(x.float(), self.weight.float(), self.bias).to(x.dtype)
        if self.kernels is not None:
            return kernel_dtypes(self.kernel_linear, x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        return F.linear(x.to(torch.bfloat16), self.weight, bias).to(x.dtype)

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows of the packed W (a new tensor [*indices.shape, K]): a tied embedding's lookups, where this
        weight is the only copy (loader.py)."""
        tiles, pairs = self.weight.shape[:2]
        by_row = self.weight.view(tiles, pairs, PACKED_BF16_ROWS, 2)
        flat = indices.reshape(-1)
        rows = by_row[flat // PACKED_BF16_ROWS, :, flat % PACKED_BF16_ROWS]  # [n, pairs, 2]
        return rows.reshape(*indices.shape, 2 * pairs)

    def onednn_bf16(self, x: torch.Tensor) -> bool:
        """Whether the kernel hands these bf16 activations to oneDNN's GEMM (native bf16; cpu_kernels.py)."""
        threshold = self.kernels.onednn_bf16_min_tokens()
        return x.dtype == torch.bfloat16 and 0 < threshold <= x.numel() // x.shape[-1]


PACKED_BF16_ROWS = 16  # rows a tile of bf16_pack


def kernel_dtypes(kernel, x: torch.Tensor, *weights) -> torch.Tensor:
    """Call a linear kernel, which takes fp32 or bf16 activations; others go through fp32."""
    if x.dtype in (torch.float32, torch.bfloat16):
        return kernel(x.contiguous(), *weights)
    return kernel(x.float().contiguous(), *weights).to(x.dtype)


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


INT8_BLOCK = 32


def quantize_int8_blocks(weight: torch.Tensor, steps: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """W ~= W_int8 * scale per block of 32 inputs: int8 [N, K'] in -steps..steps and fp32 scales [N, K'/32],
    where K' is K rounded up to 32 (zero-padded). Scales are fp16 values (the kernel's tiles store them so, as
    q8_0 does), rounded up so that no weight exceeds `steps` steps."""
    n, k = weight.shape
    padded = -(-k // INT8_BLOCK) * INT8_BLOCK
    blocks = F.pad(weight.float(), (0, padded - k)).view(n, padded // INT8_BLOCK, INT8_BLOCK)
    scale = fp16_at_least(blocks.abs().amax(dim=-1) / steps, steps)
    q = torch.round(blocks / scale.clamp(min=1e-12)[..., None]).clamp(-steps, steps).to(torch.int8)
    return q.view(n, padded), scale.contiguous()


INT7_STEPS = 63  # int7 weights: -63..63, + 64 fits maddubs' unsigned operand with 127 x 127 x 2 < 2^15


def quantize_int7_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As quantize_int8_blocks, with weights in -63..63 (the `int7` quantization)."""
    return quantize_int8_blocks(weight, INT7_STEPS)


FP16_MAX = 65504.0


def fp16_at_least(values: torch.Tensor, steps: int) -> torch.Tensor:
    """The smallest fp16 value >= each of `values` (non-negative scales of `steps` steps a side, at most
    fp16's max), in fp32."""
    if values.numel() and values.max() > FP16_MAX:
        raise ValueError(
            f"a block of weights reaches {steps * values.max().item():.3g}: int8 blocks with fp16 scales "
            f"hold at most {steps * FP16_MAX:.3g} (quantize this checkpoint with another method)"
        )
    half = values.half()
    below = half.float() < values
    return torch.where(below, torch.nextafter(half, torch.full_like(half, torch.inf)), half).float()


INT4_OFFSET = 8  # stored nibble = q + 8 for q in -8..7


def quantize_int4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W ~= scale x (nibble - 8) per block of 32 inputs, as llama.cpp's q4_0: the scale is the block's value
    of largest magnitude over -8 (so that value is exactly -8 steps), rounded to fp16. Returns uint8
    [N, K'/2], byte j of a block holding weight j in its low nibble and weight 16 + j in its high one, and
    fp32 scales [N, K'/32] (K' = K rounded up to 32, zero-padded)."""
    n, k = weight.shape
    padded = -(-k // INT8_BLOCK) * INT8_BLOCK
    blocks = F.pad(weight.float(), (0, padded - k)).view(n, padded // INT8_BLOCK, INT8_BLOCK)
    extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    if extreme.numel() and extreme.abs().max() > INT4_OFFSET * FP16_MAX:
        raise ValueError(
            f"a block of weights reaches {extreme.abs().max().item():.3g}: int4 blocks hold at most "
            f"{INT4_OFFSET * FP16_MAX:.3g} with fp16 scales (quantize this checkpoint with another method)"
        )
    scale = (extreme / -INT4_OFFSET).half().float()
    inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    q = (torch.round(blocks * inverse[..., None]).clamp(-INT4_OFFSET, INT4_OFFSET - 1) + INT4_OFFSET).to(
        torch.uint8
    )
    nibbles = q[..., : INT8_BLOCK // 2] | (q[..., INT8_BLOCK // 2 :] << 4)
    return nibbles.reshape(n, padded // 2).contiguous(), scale.contiguous()


def expand_int8_blocks(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, padded = weight.shape
    return (weight.view(n, -1, INT8_BLOCK).float() * scale.float()[..., None]).view(n, padded)


def expand_int4_blocks(nibbles: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n = nibbles.shape[0]
    halves = nibbles.view(n, -1, INT8_BLOCK // 2)
    q = torch.cat([halves & 0x0F, halves >> 4], dim=-1).float() - INT4_OFFSET
    return (q * scale.float()[..., None]).view(n, -1)


def head_quantization(quantization: str) -> str:
    """The lm_head's quantization for the layers' `quantization`: int8 under int4 and int7 (the head moves the
    logits of every token; llama.cpp's q4_0 files keep their output tensor at higher precision too). Under
    int7 a 7-bit head took perplexity / fp32's from 1.0072 to 1.0087 on SmolLM2 (test_precision.py's text;
    int8 throughout: 1.0071)."""
    return "int8" if quantization in ("int4", "int7") else quantization


QUANTIZERS = {
    "int8_wo": quantize_int8,
    "fp8": quantize_fp8,
    "int8": quantize_int8_blocks,
    "int7": quantize_int7_blocks,
    "int4": quantize_int4_blocks,
}


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


class BlockLinear(nn.Module):
    """y = x W^T + b for weights in blocks of 32 with a scale each: int8 (`quantize_int8_blocks`) or 4-bit
    (`quantize_int4_blocks`), by the subclass.

    With the CPU kernels the weights are repacked once at load into the kernels' tiles of rows (8, or 16 in
    the VNNI builds; the last tile zero-padded) and every batch runs the int8 dot product with activations
    quantized per block (`csrc/int8_linear.cpp`; faster here than fp32 FMAs or BLAS on expanded weights at
    1-512 tokens). Without the kernels the weights are expanded once at load.
    """

    kernel: str  # the kernels' `<kernel>_pack` and `<kernel>_linear`
    block_bytes: int  # a tile's bytes per row and block: 32 weights and an fp16 scale
    expand: staticmethod  # (weight, scale) -> the fp32 weights, for the path without kernels

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.kernels = cpu_kernels(weight.device)
        self.out_features = weight.shape[0]
        if self.kernels is None:
            self.register_buffer("weight", self.expand(weight, scale))
        else:
            pack = getattr(self.kernels, f"{self.kernel}_pack")
            self.kernel_linear = getattr(self.kernels, f"{self.kernel}_linear")
            self.register_buffer("weight", pack(weight.contiguous(), scale.float().contiguous()))
            if bias is not None:  # the kernels add a bias to every row, padded ones included
                bias = F.pad(bias, (0, self.weight.shape[0] * self.tile_rows - self.out_features))
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def tile_rows(self) -> int:
        """Rows per tile of the packed weight (8, or 16 in the VNNI builds)."""
        return self.weight.shape[2] // self.block_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is None:
            return F.linear(x.float(), self.weight[:, : x.shape[-1]], self.bias).to(x.dtype)
        y = kernel_dtypes(self.kernel_linear, x, self.weight, self.bias)
        return y if y.shape[-1] == self.out_features else y[..., : self.out_features]


class BlockInt8Linear(BlockLinear):
    kernel = "int8"
    block_bytes = INT8_BLOCK + 2
    expand = staticmethod(expand_int8_blocks)


def int7_runs_as_int8(device: torch.device) -> bool:
    """Whether int7 weights on `device` gain nothing over int8: the VNNI and AMX builds run them as int8 (the
    build says so), and without the CPU kernels (another device, no compiler) they are expanded as others."""
    kernels = cpu_kernels(device)
    return kernels is None or kernels.int7_runs_as_int8()


class BlockInt7Linear(BlockLinear):
    """int8's blocks holding 7-bit weights; their tiles come back from `int7_pack` as int8 tensors, which is
    how `csrc/decode_stack.cpp` tells them from int8's (the same bytes)."""

    kernel = "int7"
    block_bytes = INT8_BLOCK + 2
    expand = staticmethod(expand_int8_blocks)


class BlockInt4Linear(BlockLinear):
    kernel = "int4"
    block_bytes = INT8_BLOCK // 2 + 2
    expand = staticmethod(expand_int4_blocks)


NO_TENSOR = torch.empty(0)  # "none" in the tensor lists of csrc/decode_stack.cpp


def runs_on_kernels(linear: nn.Module) -> bool:
    """True for a linear whose `weight` the CPU kernels read as it is (packed int8 or bf16)."""
    return isinstance(linear, BlockLinear | Bf16Linear) and linear.kernels is not None


def kernel_tensors(linear: nn.Module) -> list[torch.Tensor] | None:
    """[weight, bias] of a linear that runs on the CPU kernels, as `csrc/decode_stack.cpp` takes them (an
    empty tensor for no bias), or None for any other linear, and for block ones with padded rows to drop."""
    if not runs_on_kernels(linear):
        return None
    if isinstance(linear, BlockLinear) and linear.out_features % linear.tile_rows:
        return None
    if isinstance(linear, Bf16Linear) and linear.packed and linear.out_features % PACKED_BF16_ROWS:
        return None
    return [linear.weight, NO_TENSOR if linear.bias is None else linear.bias]


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
    return Int8Linear(*quantize_int8(weight), bias)


def fp8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """Weights rounded to FP8 (e4m3, one scale per output channel), then expanded for compute.

    FP8 is a storage format here: this CPU has no FP8 (nor fast bf16) GEMM, and converting fp8 to
    fp32 in every step cost ~15 ns an element (2-3 s a step for SmolLM2), so the expansion happens
    once at load. The accuracy is FP8's; the speed and memory are the compute dtype's.
    """
    return plain_linear(expand_fp8(*quantize_fp8(weight), weight.dtype), bias)


def expand_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight.float() * scale.float()[:, None]).to(dtype)


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """Weights in the compute dtype: bf16 through the bf16 kernel on CPU, else oneDNN / F.linear."""
    if weight.dtype == torch.bfloat16 and cpu_kernels(weight.device) is not None:
        return Bf16Linear(weight, bias)
    return Linear(weight, bias)


def block_int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> BlockInt8Linear:
    return BlockInt8Linear(*quantize_int8_blocks(weight), bias)


def block_int7_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> BlockInt7Linear:
    return BlockInt7Linear(*quantize_int7_blocks(weight), bias)


def block_int4_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> BlockInt4Linear:
    return BlockInt4Linear(*quantize_int4_blocks(weight), bias)


LINEAR_TYPES = {
    "none": plain_linear,
    "int8_wo": int8_linear,
    "fp8": fp8_linear,
    "int8": block_int8_linear,
    "int7": block_int7_linear,
    "int4": block_int4_linear,
}


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str) -> nn.Module:
    return LINEAR_TYPES[quantization](weight, bias)


def prequantized_linear(
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    quantization: str,
) -> nn.Module:
    """A linear over weights quantized ahead of time (an engine directory), by their storage dtype (int7's
    and int8's are alike: by the directory's `quantization`)."""
    if quantization == "int7" and weight.dtype == torch.int8 and scale.dim() == 2:
        return BlockInt7Linear(weight, scale, bias)
    if weight.dtype == torch.int8 and scale.dim() == 2:
        return BlockInt8Linear(weight, scale, bias)
    if weight.dtype == torch.uint8:
        return BlockInt4Linear(weight, scale, bias)
    if weight.dtype == torch.int8:
        return Int8Linear(weight, scale, bias)
    if weight.dtype == torch.float8_e4m3fn:
        return plain_linear(expand_fp8(weight, scale, dtype), bias)
    raise ValueError(f"no pre-quantized linear for weights of dtype {weight.dtype}")
