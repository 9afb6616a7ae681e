"""The int8, 7-bit and 4-bit (blocks of 32, packed in tiles of 8 or 16 rows) and bf16 linear kernels, for
every instruction set this CPU runs: they match a PyTorch reference on shapes that hit every tile edge, in
both batch regimes (int8 dot products for a few tokens, fp32 expansion for more), and the PyTorch fallback
of the block linears matches the kernel."""

from __future__ import annotations

import pytest
import torch

from tritonllm.model import quant
from tritonllm.model.cpu_kernels import NATIVE_BF16_ISAS, load_kernels, selected_isa, supported_isas
from tritonllm.model.quant import (
    BlockInt4Linear,
    BlockInt7Linear,
    BlockInt8Linear,
    expand_int4_blocks,
    expand_int8_blocks,
    quantize_int4_blocks,
    quantize_int7_blocks,
    quantize_int8_blocks,
)

# (tokens, out_features, in_features): int8 runs its dot product two tokens at a time (eight in the
# VNNI builds) at every size (the amx build: AMX tiles from 16 tokens, bf16 tiles on widened weights from
# 32); bf16 takes its few-token kernel up to 8 tokens, the fp32 expansion from 9 (bf16
# activations on the avx512_bf16 build: its vdpbf16ps tiles at every size; packed: bf16_packed_linear).
# out_features not a multiple of 16 or 8 (the int8 tiles) or 4 and in_features not a multiple of 32 or 8
# exercise the edges; past 64 tokens, 416 and 576 inputs go through the amx build's bf16 tiles in two spans
# (224 + 192 and 288 + 288 inputs: amx::Bf16Tiles::input_span). The token counts leave every remainder (0-7)
# of the block kernels' passes of 8 tokens (the AVX2 and VNNI tiles).
SHAPES = [
    (1, 7, 64),
    (2, 9, 40),
    (3, 13, 576),
    (4, 4, 37),
    (1, 16, 96),
    (5, 13, 576),
    (8, 12, 64),
    (9, 12, 64),
    (15, 24, 96),
    (17, 30, 100),
    (33, 65, 256),
    (12, 40, 1536),
    (300, 13, 100),
    (64, 33, 64),
    (100, 80, 576),
    (70, 40, 416),
]


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies for a few tokens: x rounded to int8 per block of 32."""
    blocks = torch.nn.functional.pad(x, (0, -x.shape[-1] % 32)).view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks / scale.clamp(min=1e-12)) * scale
    return q.view(x.shape[0], -1)[:, : x.shape[-1]]


BLOCK_FORMATS = {"int8": BlockInt8Linear, "int7": BlockInt7Linear, "int4": BlockInt4Linear}


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_linear_matches_reference(fmt: str, isa: str, shape: tuple[int, int, int]) -> None:
    """int8 and 4-bit weights in blocks of 32: the kernel's answer is the expanded weights times the
    activations rounded to int8 per block."""
    layer, kernels = BLOCK_FORMATS[fmt], load_kernels(isa)
    pack, linear = getattr(kernels, f"{fmt}_pack"), getattr(kernels, f"{fmt}_linear")
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    q, scale = quant.QUANTIZERS[fmt](w)
    padded_k = -(-k // 32) * 32
    assert q.shape == (n, padded_k // 2 if fmt == "int4" else padded_k) and scale.shape == (n, padded_k // 32)
    weight = layer.expand(q, scale)[:, :k]
    activations = quantized_activations(x)
    expected = activations @ weight.T + bias
    packed = pack(q, scale)
    tile_rows = packed.shape[2] // layer.block_bytes
    assert tile_rows == (16 if isa in ("avx512_vnni", *NATIVE_BF16_ISAS) else 8)
    rows = packed.shape[0] * tile_rows
    assert rows == -(-n // tile_rows) * tile_rows
    padded_bias = torch.nn.functional.pad(bias, (0, rows - n))
    got = linear(x, packed, padded_bias)
    assert got.shape == (m, rows) and (got[:, n:] == 0).all()  # padded rows: zero weights, zero bias
    widened = 0 < kernels.widened_min_tokens() <= m  # the amx build's bf16 tiles: bf16 activations, weights
    if widened:
        expected = x.bfloat16().float() @ weight.bfloat16().float().T + bias
    torch.testing.assert_close(got[:, :n], expected, atol=1e-4, rtol=1e-4)
    got_bf16 = linear(x.bfloat16(), packed, padded_bias)[:, :n]
    assert got_bf16.dtype == torch.bfloat16
    expected_bf16 = quantized_activations(x.bfloat16().float()) @ weight.T + bias  # bf16 x rounds differently
    if widened:
        expected_bf16 = expected
    torch.testing.assert_close(got_bf16.float(), expected_bf16, atol=0.1, rtol=0.01)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_linears_hold_their_largest_sums(fmt: str, isa: str) -> None:
    """Weights and activations at their formats' extremes, where the AVX2 kernels' int16 sums of products are
    largest (int4 adds a block's 4 chunks in int16 before widening): every product at the top of its range,
    all of one sign, or of random signs, for 1 and 9 tokens (8-token passes and one more)."""
    kernels = load_kernels(isa)
    gen = torch.Generator().manual_seed(7)
    signs = torch.randint(0, 2, (16, 128), generator=gen).float() * 2 - 1
    top = torch.full((16, 128), 0.875)
    top[:, ::32] = -1.0  # int4's scale: the block's extreme is -8 steps, 0.875 is +7 (nibble 15)
    for w in (signs, -signs.abs(), top):
        q, scale = quant.QUANTIZERS[fmt](w)
        weight = BLOCK_FORMATS[fmt].expand(q, scale)
        packed = getattr(kernels, f"{fmt}_pack")(q, scale)
        for x in (torch.ones(9, 128), -torch.ones(1, 128), signs[:9]):
            got = getattr(kernels, f"{fmt}_linear")(x, packed)[:, :16]
            torch.testing.assert_close(got, quantized_activations(x) @ weight.T, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_linear_matches_reference(isa: str, shape: tuple[int, int, int]) -> None:
    kernels = load_kernels(isa)
    m, n, k = shape
    gen = torch.Generator().manual_seed(m + n * k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16()
    expected = x @ w.float().T
    torch.testing.assert_close(kernels.bf16_linear(x, w), expected, atol=1e-4, rtol=1e-4)
    got = kernels.bf16_linear(x.bfloat16(), w)
    torch.testing.assert_close(got.float(), x.bfloat16().float() @ w.float().T, atol=0.1, rtol=0.05)


@pytest.mark.skipif("amx" not in supported_isas(), reason="AMX tiles: Xeons from Sapphire Rapids on")
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("shape", [(16, 48, 576), (20, 33, 96), (31, 100, 1536), (17, 40, 32), (7, 70, 100)])
def test_amx_block_linears_equal_vnni_to_the_bit(fmt: str, shape: tuple[int, int, int]) -> None:
    """From 16 to 31 tokens the amx build multiplies the same tiles on AMX (tdpbsud a block of 32 inputs, 16
    tokens at a time): the same integer dot products, scaled in the same order as vpdpbusd's, so the same
    floats, in groups of 16 tokens with a short last one (fewer tokens: vpdpbusd itself; from 32, weights
    widened to bf16)."""
    amx, vnni = load_kernels("amx"), load_kernels("avx512_bf16")
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * k + n)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(-(-n // 16) * 16, generator=gen)
    weights = quant.QUANTIZERS[fmt](torch.randn(n, k, generator=gen))
    packed = getattr(amx, f"{fmt}_pack")(*weights)
    assert torch.equal(packed, getattr(vnni, f"{fmt}_pack")(*weights))  # one layout
    for activations in (x, x.bfloat16()):
        got = getattr(amx, f"{fmt}_linear")(activations, packed, bias)
        assert torch.equal(got, getattr(vnni, f"{fmt}_linear")(activations, packed, bias))


PACKING_ISAS = [isa for isa in supported_isas() if isa in NATIVE_BF16_ISAS]
# The amx build's tiles from 4 tokens on, where inputs come in blocks of 32: blocks of 32 tokens with a short
# last one, an odd number of weight tiles, a single one.
AMX_SHAPES = [(40, 100, 64), (64, 48, 96), (20, 33, 32), (4, 16, 64), (97, 40, 416)]


@pytest.mark.skipif(not PACKING_ISAS, reason="packed bf16 weights run on the avx512_bf16 and amx builds only")
@pytest.mark.parametrize("isa", PACKING_ISAS)
@pytest.mark.parametrize(
    "shape", [s for s in SHAPES if s[2] % 2 == 0] + [(6, 16, 2), (13, 70, 98), *AMX_SHAPES]
)
def test_packed_bf16_linear_matches_reference(isa: str, shape: tuple[int, int, int]) -> None:
    """bf16_pack's tiles of 16 rows x input pairs through vdpbf16ps (and AMX tiles in the amx build): every
    tile (1-4 a group) and token (1-6) edge, a bias, padded rows (zeros), bf16 rounding of the fp32 sums."""
    kernels = load_kernels(isa)
    m, n, k = shape
    gen = torch.Generator().manual_seed(m + n * k)
    x, w = torch.randn(m, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    packed = kernels.bf16_pack(w)
    assert packed.shape == (-(-n // 16), -(-k // 2), 32)
    padded_bias = torch.nn.functional.pad(bias, (0, packed.shape[0] * 16 - n))
    got = kernels.bf16_packed_linear(x, packed, padded_bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, packed.shape[0] * 16)
    expected = x.float() @ w.float().T + bias
    torch.testing.assert_close(got[:, :n].float(), expected, atol=0.1, rtol=0.01)
    assert torch.equal(got[:, n:].float(), torch.zeros(m, got.shape[1] - n))
    batched = kernels.bf16_packed_linear(x.view(1, m, k), packed)
    assert torch.equal(batched.view(m, -1), kernels.bf16_packed_linear(x, packed))


@pytest.mark.skipif(not PACKING_ISAS, reason="packed bf16 weights run on the avx512_bf16 and amx builds only")
def test_bf16_weights_are_packed_unless_onednn_takes_them() -> None:
    """The avx512_bf16 build packs bf16 weights for its own kernel unless bf16 activations go to oneDNN's
    GEMM from some number of tokens (AMX CPUs), which takes row-major weights; the layer answers the same
    either way, its padded rows dropped, in its activations' dtype."""
    kernels = load_kernels()
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(40, 100, generator=gen), torch.randn(40, generator=gen)
    x = torch.randn(5, 100, generator=gen).bfloat16()
    previous = kernels.onednn_bf16_min_tokens()
    try:
        kernels.set_onednn_bf16_min_tokens(0)
        packed = quant.Bf16Linear(w, bias)
        kernels.set_onednn_bf16_min_tokens(16)
        row_major = quant.Bf16Linear(w, bias)
    finally:
        kernels.set_onednn_bf16_min_tokens(previous)
    assert packed.packed and packed.weight.shape == (3, 50, 32) and packed.bias.shape == (48,)
    assert not row_major.packed and row_major.weight.shape == (40, 100)
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 40)
    torch.testing.assert_close(got.float(), row_major(x).float(), atol=0.05, rtol=0.01)
    assert packed(x.float()).dtype == torch.float32
    assert quant.kernel_tensors(packed) is None  # padded rows: the fused decode stack keeps to whole tiles
    assert quant.kernel_tensors(quant.Bf16Linear(w[:32]))[0].shape == (2, 50, 32)
    with pytest.raises(RuntimeError, match="activations have 98 features; the weight holds 100"):
        kernels.bf16_packed_linear(torch.zeros(1, 98, dtype=torch.bfloat16), packed.weight)
    with pytest.raises(RuntimeError, match="packed bf16 weights must be"):
        kernels.bf16_packed_linear(x, w.bfloat16())
    with pytest.raises(RuntimeError, match="take pairs of inputs; this weight has 99"):
        kernels.bf16_pack(w[:, :99].bfloat16().contiguous())
    assert not quant.Bf16Linear(w[:, :99]).packed  # odd inputs stay row-major


@pytest.mark.parametrize("isa", [isa for isa in supported_isas() if isa not in NATIVE_BF16_ISAS])
def test_other_builds_keep_bf16_weights_row_major(isa: str) -> None:
    """Only vdpbf16ps runs packed bf16 weights: the other builds refuse them with a clear message."""
    kernels = load_kernels(isa)
    assert not kernels.packs_bf16()
    packed = kernels.bf16_pack(torch.randn(16, 8).bfloat16())  # packing itself is portable
    with pytest.raises(RuntimeError, match="need the avx512_bf16 or amx build"):
        kernels.bf16_packed_linear(torch.zeros(1, 8, dtype=torch.bfloat16), packed)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("tokens", [1, 9])
def test_threads_share_the_rows_so_each_is_computed_once(isa: str, tokens: int) -> None:
    """csrc/work_split.h: each thread takes its own range of row tiles from the front, and a thread that is
    done takes the rest of the others' from the back, on OpenMP's threads or on the kernels' own pool. Three
    threads on this machine's fewer cores lose their core now and then, so ranges get finished by other
    threads: every row must still come out exactly as one thread computes it (an untouched or half-written
    row would not)."""
    kernels = load_kernels(isa)
    gen = torch.Generator().manual_seed(tokens)
    x, w = torch.randn(tokens, 96, generator=gen), torch.randn(4000, 96, generator=gen)
    packed = kernels.int8_pack(*quantize_int8_blocks(w))
    packed4 = kernels.int4_pack(*quantize_int4_blocks(w))
    packed7 = kernels.int7_pack(*quantize_int7_blocks(w))
    packs = kernels.packs_bf16()
    packed_bf16 = kernels.bf16_pack(w.bfloat16())
    previous = torch.get_num_threads()
    results = []
    try:
        for threads, pool in ((1, 0), (2, 0), (3, 0), (1, 2), (1, 3)):
            torch.set_num_threads(threads)
            kernels.use_thread_pool(pool)  # 2 and 3 threads of csrc/thread_pool.h
            results.append(
                [kernels.int8_linear(x, packed) for _ in range(20)]
                + [kernels.int4_linear(x, packed4) for _ in range(20)]
                + [kernels.int7_linear(x, packed7) for _ in range(20)]
                + [kernels.bf16_linear(x, w.bfloat16()) for _ in range(20)]
                + [kernels.bf16_packed_linear(x.bfloat16(), packed_bf16) for _ in range(20 * bool(packs))]
            )
    finally:
        kernels.use_thread_pool(0)
        torch.set_num_threads(previous)
    for got in results[1:]:
        for a, b in zip(results[0], got, strict=True):
            assert torch.equal(a, b)


def test_int8_quantization_error_is_small() -> None:
    """Blocks of 32 keep weights within half a step of their block's scale."""
    w = torch.randn(64, 576) * torch.logspace(-3, 0, 576)  # channels of very different magnitudes
    q, scale = quantize_int8_blocks(w)
    error = (expand_int8_blocks(q, scale) - w).abs()
    assert (error <= scale.repeat_interleave(32, dim=1) / 2 + 1e-7).all()
    assert q.abs().max() <= 127


@pytest.mark.parametrize("isa", supported_isas())
def test_int7_weights_stay_within_63_steps_and_pack_as_int8_tensors(isa: str) -> None:
    """int7: int8's blocks with weights in -63..63, each within half a step of its fp16 scale (x 63 >= the
    block's largest weight); int7_pack refuses anything past 63 steps (the AVX2 kernel stores them + 64 as
    maddubs' unsigned operand, where 64 + 64 would wrap) and returns int8's tile bytes as an int8 tensor."""
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 0, 576)
    q, scale = quantize_int7_blocks(w)
    assert q.dtype == torch.int8 and q.abs().max() == 63 and torch.equal(scale.half().float(), scale)
    assert (scale * 63 >= w.abs().view(64, 18, 32).amax(-1)).all()
    error = (expand_int8_blocks(q, scale) - w).abs()
    assert (error <= scale.repeat_interleave(32, dim=1) / 2 + 1e-7).all()
    kernels = load_kernels(isa)
    packed = kernels.int7_pack(q, scale)
    assert packed.dtype == torch.int8 and packed.shape == kernels.int8_pack(q, scale).shape
    too_far = q.clone()
    too_far[3, 7] = 64
    with pytest.raises(RuntimeError, match="int7 weights must lie in -63..63"):
        kernels.int7_pack(too_far, scale)


def test_int4_quantization_is_q4_0s() -> None:
    """llama.cpp's q4_0: a block's value of largest magnitude is exactly -8 steps of its fp16 scale, every
    other weight within half a step (or one step, clamped at +7, for the opposite extreme); nibbles in q4_0's
    order."""
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 0, 576)
    nibbles, scale = quantize_int4_blocks(w)
    assert (
        nibbles.dtype == torch.uint8
        and nibbles.shape == (64, 288)
        and torch.equal(scale.half().float(), scale)
    )
    steps = scale.abs().repeat_interleave(32, dim=1)
    error = (expand_int4_blocks(nibbles, scale) - w).abs()
    # One step, plus the fp16 rounding of the scale (2^-11 relative): the clamped extreme can sit 8.004 out.
    assert (error <= 1.004 * steps).all() and (error <= steps / 2 + 1e-7).float().mean() > 0.95
    blocks = w.view(64, 18, 32)
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(scale * -8, extreme, rtol=1e-3, atol=0)
    one = torch.zeros(1, 32)
    one[0, 0], one[0, 16], one[0, 5] = -8.0, 7.0, 1.0  # scale 1: nibbles 0, 15, 9; the rest 8
    packed, unit = quantize_int4_blocks(one)
    assert unit.item() == 1.0 and packed[0, 0] == 0x0 | 15 << 4 and packed[0, 5] == 9 | 8 << 4
    with pytest.raises(ValueError, match="int4 blocks hold at most"):
        quantize_int4_blocks(torch.full((8, 32), 1e7))


def test_int8_block_scales_are_fp16_values_rounded_up() -> None:
    """The kernels' tiles store scales in fp16: the quantizer picks fp16 values, never below a block's largest
    weight / 127 (so no weight is clipped), and refuses weights no fp16 scale can reach."""
    w = torch.randn(16, 96) * torch.logspace(-6, 2, 96)
    _, scale = quantize_int8_blocks(w)
    assert torch.equal(scale.half().float(), scale)
    assert (scale * 127 >= w.abs().view(16, 3, 32).amax(-1)).all()
    with pytest.raises(ValueError, match="int8 blocks with fp16 scales hold at most"):
        quantize_int8_blocks(torch.full((8, 32), 1e7))


@pytest.mark.parametrize("rows", [32, 24, 13])
@pytest.mark.parametrize("tokens", [2, 8])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_linear_fallback_without_kernels(
    monkeypatch: pytest.MonkeyPatch, fmt: str, rows: int, tokens: int
) -> None:
    """No compiler: the layer expands its weights once and gives the kernel's answer, with the kernel's padded
    rows (13 is not a multiple of its tile of 8 or 16, 24 not of 16) dropped; such a layer stays out of the
    fused decode stack."""
    gen = torch.Generator().manual_seed(3)
    w, x, bias = (
        torch.randn(rows, 96, generator=gen),
        torch.randn(tokens, 96, generator=gen),
        torch.randn(rows),
    )
    layer, quantize = BLOCK_FORMATS[fmt], quant.QUANTIZERS[fmt]
    with_kernel = layer(*quantize(w), bias)
    padded = rows % with_kernel.tile_rows != 0
    assert (quant.kernel_tensors(with_kernel) is None) == padded
    monkeypatch.setattr(quant, "cpu_kernels", lambda device: None)
    fallback = layer(*quantize(w), bias)
    assert fallback.weight.dtype == torch.float32
    expected = fallback(quantized_activations(x))
    assert with_kernel(x).shape == (tokens, rows)
    torch.testing.assert_close(with_kernel(x), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
def test_prefill_sized_bf16_batches_take_blas_with_the_kernels_answer(
    monkeypatch: pytest.MonkeyPatch, activations: torch.dtype
) -> None:
    """From BLAS_MIN_TOKENS tokens a bf16 linear expands its weight for the BLAS GEMM: same answer as the
    kernel's tile loop (which it uses again when the threshold is raised)."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(40, 100, generator=gen)
    x = torch.randn(quant.BLAS_MIN_TOKENS + 3, 100, generator=gen).to(activations)
    layer = quant.Bf16Linear(w)
    blas = layer(x)
    monkeypatch.setattr(quant, "BLAS_MIN_TOKENS", 10**9)
    tolerance = 1e-4 if activations == torch.float32 else 2e-2
    assert blas.dtype == activations
    torch.testing.assert_close(blas, layer(x), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("isa", supported_isas())
def test_shape_mismatches_raise_with_the_sizes_in_the_message(isa: str) -> None:
    """Messages that carry numbers are built without std::ostream (csrc/errors.h): streaming an integer into
    a check's message crashed the process on one machine's toolchain instead of raising."""
    kernels = load_kernels(isa)
    with pytest.raises(RuntimeError, match="activations have 3 features; the weight expects 5"):
        kernels.bf16_linear(torch.zeros(2, 3), torch.zeros(4, 5, dtype=torch.bfloat16))
    q, scale = quantize_int8_blocks(torch.randn(8, 64))
    packed = kernels.int8_pack(q, scale)
    with pytest.raises(RuntimeError, match="activations have 100 features; the weight holds 64"):
        kernels.int8_linear(torch.zeros(1, 100), packed)
    packed4 = kernels.int4_pack(*quantize_int4_blocks(torch.randn(8, 64)))
    with pytest.raises(RuntimeError, match="activations have 100 features; the weight holds 64"):
        kernels.int4_linear(torch.zeros(1, 100), packed4)
    with pytest.raises(RuntimeError, match="packed int4 weights must be"):
        kernels.int4_linear(torch.zeros(1, 64), packed)  # int8 tiles are not int4 tiles
    packed7 = kernels.int7_pack(*quantize_int7_blocks(torch.randn(8, 64)))
    with pytest.raises(RuntimeError, match="packed int7 weights must be"):
        kernels.int7_linear(torch.zeros(1, 64), packed)  # same bytes, told apart by the dtype
    with pytest.raises(RuntimeError, match="packed int8 weights must be"):
        kernels.int8_linear(torch.zeros(1, 64), packed7)


def calls_aten_mm(kernels, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The kernel's answer, and whether it went through ATen's GEMM (the profiler sees its C++ call)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        y = kernels.bf16_linear(x, w)
    return y, any(event.name == "aten::mm" for event in profile.events())


@pytest.mark.parametrize("isa", supported_isas())
def test_bf16_activations_from_the_threshold_take_the_gemm_with_the_kernels_answer(isa: str) -> None:
    """On native-bf16 CPUs bf16 linears from `onednn_bf16_min_tokens` tokens on run ATen's GEMM (oneDNN);
    forced here on any CPU (ATen's own bf16 GEMM where oneDNN has none). Fewer tokens and fp32 activations
    keep the kernel; the GEMM's answer is within a bf16 rounding of the kernel's."""
    kernels = load_kernels(isa)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(40, 100, generator=gen).bfloat16()
    x = torch.randn(12, 100, generator=gen)
    previous = kernels.onednn_bf16_min_tokens()
    try:
        kernels.set_onednn_bf16_min_tokens(0)
        expected = kernels.bf16_linear(x.bfloat16(), w)
        kernels.set_onednn_bf16_min_tokens(8)
        got, routed = calls_aten_mm(kernels, x.bfloat16(), w)
        assert routed
        torch.testing.assert_close(got.float(), expected.float(), atol=0.07, rtol=0.01)
        few, routed = calls_aten_mm(kernels, x[:7].bfloat16(), w)
        assert not routed and torch.equal(few, expected[:7])
        _, routed = calls_aten_mm(kernels, x, w)
        assert not routed
        with pytest.raises(RuntimeError, match="or 0 for never"):
            kernels.set_onednn_bf16_min_tokens(-1)
    finally:
        kernels.set_onednn_bf16_min_tokens(previous)


@pytest.mark.parametrize(
    ("flags", "threshold"),
    [
        (["avx2", "fma"], 0),
        (["avx2", "avx512_vnni"], 0),
        (["avx512_bf16", "avx512_vnni"], 0),
        (["amx_bf16", "avx512_bf16"], 16),
        (["amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni"], 0),
    ],
)
def test_the_gemm_threshold_follows_native_bf16_unless_set(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], threshold: int
) -> None:
    """oneDNN's bf16 GEMM only with AMX and no amx build (cpu_kernels.py): without native bf16 it converts,
    and the kernels were 1.8-3.7x faster; with AVX512_BF16 alone the packed bf16 kernel beat it at every size,
    and the amx build's own tiles beat it on AMX."""
    from tritonllm.model import cpu_kernels

    monkeypatch.delenv("TRITONLLM_ONEDNN_BF16_MIN_TOKENS", raising=False)
    monkeypatch.delenv("TRITONLLM_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu_kernels, "amx_permitted", lambda: True)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu_kernels.onednn_bf16_min_tokens() == threshold
    monkeypatch.setenv("TRITONLLM_ONEDNN_BF16_MIN_TOKENS", "0")
    assert cpu_kernels.onednn_bf16_min_tokens() == 0
    monkeypatch.setenv("TRITONLLM_ONEDNN_BF16_MIN_TOKENS", "many")
    with pytest.raises(RuntimeError, match="a number of tokens"):
        cpu_kernels.onednn_bf16_min_tokens()


def test_engine_stats_name_the_gemm_threshold() -> None:
    from tritonllm.engine.model_runner import describe_kernels

    kernels = load_kernels()
    previous = kernels.onednn_bf16_min_tokens()
    try:
        kernels.set_onednn_bf16_min_tokens(0)
        described = describe_kernels(torch.device("cpu"))
        assert "onednn" not in described
        assert (", bf16 weights packed (" in described) == (selected_isa() in NATIVE_BF16_ISAS)
        kernels.set_onednn_bf16_min_tokens(16)
        assert ", bf16 from 16 tokens: onednn (" in describe_kernels(torch.device("cpu"))
    finally:
        kernels.set_onednn_bf16_min_tokens(previous)
