"""The C++ CPU kernels (decode attention, int8 and bf16 linears) build here, for every instruction set this
CPU runs, match PyTorch, and the fallbacks are right too."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy, hf_greedy, make_engine, random_prompts, run_staggered

import tritonllm.model.llama as llama
from tritonllm.model import cpu_kernels
from tritonllm.model.cpu_kernels import NATIVE_BF16_ISAS, load_kernels, supported_isas
from tritonllm.model.kv_rows import from_rows, to_rows
from tritonllm.model.llama import gather_blocks


def torch_decode_attention(q, k_cache, v_cache, tables, lengths, scale):
    """Reference: gather the blocks, mask past each length, softmax(q k^T) v."""
    d, heads, head_dim = q.shape
    kv_heads, _, bs, _ = k_cache.shape
    keys, values = gather_blocks(k_cache, tables), gather_blocks(v_cache, tables)
    visible = torch.arange(tables.shape[1] * bs)[None, :] < lengths[:, None]
    q = q.view(d, kv_heads, -1, head_dim).transpose(0, 1)
    scores = (q @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1).reshape(d, heads, head_dim)


def test_kernel_builds_on_this_machine() -> None:
    assert load_kernels() is not None, "no compiler? the engine would fall back to the slow path"


def test_builds_use_the_pinned_ninja_whatever_is_first_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two ninja versions rebuild each other's output: every process must run the `ninja` package's."""
    import ninja

    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\necho 1.11.1\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin")
    assert shutil.which("ninja") == str(other)
    cpu_kernels.use_pinned_ninja()
    assert shutil.which("ninja") == str(Path(ninja.BIN_DIR) / "ninja")
    cpu_kernels.use_pinned_ninja()
    assert os.environ["PATH"].count(ninja.BIN_DIR) == 1, "added once"


@pytest.mark.parametrize(
    ("capability", "flags", "expected"),
    [
        (
            "AVX512",
            # Sapphire Rapids
            ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"],
            ["amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2", "generic"],
        ),
        (
            "AVX512",
            ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"],  # Zen 4/5
            ["avx512_bf16", "avx512_vnni", "avx512", "avx2", "generic"],
        ),
        # Ice Lake: VNNI without BF16
        ("AVX512", ["avx2", "avx512f", "avx512_vnni"], ["avx512_vnni", "avx512", "avx2", "generic"]),
        # BF16 without VNNI: the BF16 build needs both
        ("AVX512", ["avx2", "avx512f", "avx512_bf16"], ["avx512", "avx2", "generic"]),
        ("AVX512", ["avx2", "avx512f"], ["avx512", "avx2", "generic"]),  # Skylake-X: AVX-512 without VNNI
        ("AVX2", ["avx2", "avx512f", "avx512_vnni"], ["avx2", "generic"]),  # torch held to AVX2 (ATen's env)
        ("AVX2", ["avx2", "avx_vnni"], ["avx2", "generic"]),
    ],
)
def test_builds_are_chosen_from_the_capability_and_the_flags(
    monkeypatch: pytest.MonkeyPatch, capability: str, flags: list[str], expected: list[str]
) -> None:
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_kernels, "amx_permitted", lambda: True)
    assert supported_isas() == expected
    if "amx" in expected:  # an OS that refuses the tiles (Linux before 5.16) gets the avx512_bf16 build
        monkeypatch.setattr(cpu_kernels, "amx_permitted", lambda: False)
        assert supported_isas() == expected[1:]


# (queries, cache) dtypes: one dtype, a bf16 cache under fp32 activations (the int8 engine's), int8 rows.
DTYPES = [
    (torch.float32,) * 2,
    (torch.bfloat16,) * 2,
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.int8),
    (torch.bfloat16, torch.int8),
]
DTYPE_IDS = ["fp32", "bf16", "fp32-bf16-cache", "fp32-int8-cache", "bf16-int8-cache"]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """ATen's thread count set to `n` for the block, restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def random_cache(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Normal values [..., head_dim] as cache rows of `dtype` (int8: with their scales, kv_rows.py)."""
    return to_rows(torch.randn(shape, generator=gen), dtype)


def as_fp32(cache: torch.Tensor) -> torch.Tensor:
    """What a cache holds, in fp32: the reference attention's keys and values."""
    return from_rows(cache, torch.float32)


def assert_decode_matches_torch(
    got: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    isa: str,
) -> None:
    """Decode attention against the fp32 reference, within fp32's rounding except where the kernel rounds to
    bf16. bf16 queries and outputs: 2e-2. The avx512_bf16 and amx builds' vdpbf16ps path over a bf16 cache at
    head sizes 64 and 128 rounds each unnormalised probability to bf16 (unit roundoff 2^-8), so an output may
    be off by up to 2^-8 * sum_t p_t |v_t|: that bound, per element. Over 1,000 keys it averages out (~2e-4),
    over 2 keys it does not (2.7e-3 seen at query groups of 8 on a Xeon)."""
    keys, values = as_fp32(k_cache), as_fp32(v_cache)
    expected = torch_decode_attention(q.float(), keys, values, tables, lengths, scale)
    if q.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
        return
    allowed = 1e-5 * (1 + expected.abs())
    if isa in NATIVE_BF16_ISAS and k_cache.dtype == torch.bfloat16 and q.shape[-1] in (64, 128):
        allowed += 2**-8 * torch_decode_attention(q.float(), keys, values.abs(), tables, lengths, scale)
    excess = (got.float() - expected).abs() / allowed
    worst = torch.nonzero(excess == excess.max())[0].tolist()
    assert excess.max() <= 1, f"{float(excess.max()):.2f}x the allowed error at (sequence, head, dim) {worst}"


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_kernel_matches_torch(isa: str, dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    kernel = load_kernels(isa)
    dtype, cache_dtype = dtypes
    gen = torch.Generator().manual_seed(0)
    kv_heads, blocks, bs, head_dim, heads, d = 3, 64, 4, 16, 9, 7
    k_cache = random_cache((kv_heads, blocks, bs, head_dim), cache_dtype, gen)
    v_cache = random_cache((kv_heads, blocks, bs, head_dim), cache_dtype, gen)
    lengths = torch.tensor([1, 4, 5, 17, 30, 2, 32])
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:8] for _ in range(d)])
    q = torch.randn(d, heads, head_dim, generator=gen).to(dtype)
    got = kernel.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 0.25)
    assert got.dtype == dtype
    assert_decode_matches_torch(got, q, k_cache, v_cache, tables, lengths, 0.25, isa)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32,) * 2,
        (torch.float32, torch.bfloat16),
        (torch.bfloat16,) * 2,
        (torch.float32, torch.int8),
    ],
)
def test_rope_and_cache_writes_the_cache_as_pytorch_does(
    dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """The kernel's RoPE + cache write, into a bf16 cache or int8 rows, equals the PyTorch version (which
    rounds the same fp32 values to bf16, or to int8 steps of each row's largest magnitude / 127)."""
    kernels = load_kernels()
    gen = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, head_dim, blocks, bs = 5, 4, 2, 16, 6, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, head_dim, generator=gen)
    cos, sin, slots = angles.cos().to(dtype), angles.sin().to(dtype), torch.tensor([3, 0, 9, 21, 17])
    row = head_dim + 4 if cache_dtype == torch.int8 else head_dim
    results = []
    for ops in (kernels, llama.TorchLayerOps):
        caches = [torch.zeros(kv_heads, blocks, bs, row, dtype=cache_dtype) for _ in range(2)]
        qk = ops.rope_and_cache(qkv, cos, sin, slots, caches[0], caches[1], heads)
        results.append((qk, *caches))
    (qk, keys, values), (expected_qk, expected_keys, expected_values) = results
    torch.testing.assert_close(qk, expected_qk, atol=1e-6, rtol=1e-6)
    assert keys.dtype == values.dtype == cache_dtype
    # Values are written unrotated: the same rows to the bit. Rotated keys may differ in their last bits
    # (the kernel rounds as HF does), so a key may land one int8 step away.
    assert torch.equal(values, expected_values)
    written = keys.view(kv_heads, -1, row)[:, slots]
    assert written.abs().sum() > 0
    step = as_fp32(expected_keys).abs().amax() / 127 if cache_dtype == torch.int8 else 1e-6
    torch.testing.assert_close(as_fp32(keys), as_fp32(expected_keys), atol=float(step) * 1.01, rtol=1e-2)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lengths", [[1000], [1000, 7, 333]], ids=["one", "three"])
def test_long_contexts_split_across_threads_match_torch(
    isa: str, dtypes: tuple[torch.dtype, torch.dtype], threads: int, lengths: list[int]
) -> None:
    """SmolLM2's geometry (9 heads, 3 kv heads, head_dim 64, blocks of 16): fewer (sequence, kv head) pairs
    than 4 per thread are cut into spans merged by log-sum-exp (one sequence always; three with 2 threads);
    runs of 8 keys and 32 value lanes take the vector paths, a ragged last block the scalar ones."""
    kernel = load_kernels(isa)
    dtype, cache_dtype = dtypes
    gen = torch.Generator().manual_seed(1)
    kv_heads, blocks, bs, head_dim, heads = 3, 160, 16, 64, 9
    k_cache = random_cache((kv_heads, blocks, bs, head_dim), cache_dtype, gen)
    v_cache = random_cache((kv_heads, blocks, bs, head_dim), cache_dtype, gen)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:63] for _ in lengths])
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
    with torch_threads(threads):
        got = kernel.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lengths), 0.125)
    assert_decode_matches_torch(got, q, k_cache, v_cache, tables, torch.tensor(lengths), 0.125, isa)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_cache_at_llama_head_sizes_matches_torch(isa: str, dtype: torch.dtype, head_dim: int) -> None:
    """A bf16 cache at head sizes 64 and 128, the ones the avx512_bf16 build runs through vdpbf16ps (fp32
    queries as two bf16 parts, 16 keys a group, values two at a time) and the amx build scores on AMX tiles
    (where the parts fit four weight tiles: head size 64, and 128 with bf16 queries; fp32 queries at 128 take
    vdpbf16ps there too): groups of fewer than 16 keys (lengths
    not a multiple of 16), spans that start inside a block (the lone 707-key sequence is cut at 354 keys on
    one thread, 177 on two), odd runs of values, and a scale that leaves bf16 queries' low parts non-zero. The
    queries carry SmolLM2-like outlier dims (scores ~10x), where rounding fp32 queries to one bf16 part would
    miss the tolerance."""
    kernel = load_kernels(isa)
    gen = torch.Generator().manual_seed(2)
    kv_heads, blocks, bs, heads = 2, 80, 16, 6
    k_cache = random_cache((kv_heads, blocks, bs, head_dim), torch.bfloat16, gen)
    v_cache = random_cache((kv_heads, blocks, bs, head_dim), torch.bfloat16, gen)
    scale = head_dim**-0.5 * 0.9
    for lengths in (torch.tensor([707, 1, 15, 17, 250]), torch.tensor([707])):
        tables = torch.stack([torch.randperm(blocks, generator=gen)[:45] for _ in range(len(lengths))])
        q = torch.randn(len(lengths), heads, head_dim, generator=gen)
        q[..., :4] *= 12
        q = q.to(dtype)
        for threads in (1, 2):
            with torch_threads(threads):
                got = kernel.paged_decode_attention(q, k_cache, v_cache, tables, lengths, scale)
            assert_decode_matches_torch(got, q, k_cache, v_cache, tables, lengths, scale, isa)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("group", [1, 2, 4, 8], ids=lambda g: f"group{g}")
def test_bf16_cache_with_other_query_groups_matches_torch(isa: str, group: int) -> None:
    """Query heads per kv head other than SmolLM2's 3 (Llama-3.2-1B has 4, Llama-3-8B 4, Llama-2 1): the
    vector paths take a group's heads 3 at a time (sums in registers), so 1, 2 and 3 + 1 each take their own
    path. Last runs of 1-3 keys (lengths 1, 2, 19, 35), and a lone 301-key sequence cut into spans that
    start inside a block (151 keys a span on one thread, 76 on two: fewer (sequence, kv head) pairs than 4
    a thread)."""
    kernel = load_kernels(isa)
    gen = torch.Generator().manual_seed(3)
    kv_heads, blocks, bs, head_dim = 2, 40, 16, 64
    k_cache = random_cache((kv_heads, blocks, bs, head_dim), torch.bfloat16, gen)
    v_cache = random_cache((kv_heads, blocks, bs, head_dim), torch.bfloat16, gen)
    for lengths in (torch.tensor([1, 2, 19, 35, 301]), torch.tensor([301])):
        tables = torch.stack([torch.randperm(blocks, generator=gen)[:20] for _ in range(len(lengths))])
        q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=gen)
        for threads in (1, 2):
            with torch_threads(threads):
                got = kernel.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 0.125)
            assert_decode_matches_torch(got, q, k_cache, v_cache, tables, lengths, 0.125, isa)


def test_pytorch_fallback_matches_hf(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama, "load_kernels", lambda: None)
    prompts = random_prompts(8, vocab=512, seed=5)
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=8)
    got = run_staggered(engine, prompts, [greedy(10)] * 8, [0, 0, 1, 1, 2, 3, 5, 8])
    assert got == [hf_greedy(tiny_llama_dir, p, 10) for p in prompts]


def test_stale_build_lock_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build killed midway leaves torch's lock file; the next build must not wait on it forever."""
    from tritonllm.model import cpu_kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    stale = Path(_get_build_directory("tritonllm_stale_test", verbose=False)) / "lock"
    stale.write_text("")
    with cpu_kernels.exclusive_build("tritonllm_stale_test", wait_s=5):
        assert not stale.exists()


@pytest.mark.parametrize(
    ("quantization", "dtype", "kv_cache_dtype"),
    [
        ("int8", "float32", "auto"),
        ("int7", "float32", "auto"),
        ("none", "bfloat16", "auto"),
        ("int8", "float32", "int8"),
    ],
)
def test_fused_decode_layers_match_the_python_loop_to_the_bit(
    tiny_llama_dir: Path, quantization: str, dtype: str, kv_cache_dtype: str
) -> None:
    """Decode-only steps run all layers in one C++ call (csrc/decode_stack.cpp): the same kernels in the same
    order, so every decode step's logits equal the Python layer loop's exactly."""
    engine = make_engine(
        tiny_llama_dir, quantization=quantization, dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_num_seqs=4
    )
    model = engine.runner.model
    assert model.packed_layers is not None, "int8, int7 and bf16 linears run on the kernels"
    forward, differences = model.forward, []

    def both_paths(input_ids, positions, meta, kv_caches, logits_indices):
        fused = forward(input_ids, positions, meta, kv_caches, logits_indices)
        if not meta.prefills:  # rerun the step through the loop (it rewrites the same cache slots)
            model.fused_decode = False
            looped = forward(input_ids, positions, meta, kv_caches, logits_indices)
            model.fused_decode = True
            differences.append((fused - looped).abs().max().item())
        return fused

    model.forward = both_paths
    engine.generate(random_prompts(3, vocab=512, seed=5), greedy(6))
    assert differences and max(differences) == 0.0


def test_fp32_models_keep_the_python_loop(tiny_llama_dir: Path) -> None:
    """Plain fp32 linears (oneDNN) do not run on the kernels: no packed layers, the loop runs."""
    assert make_engine(tiny_llama_dir, dtype="float32").runner.model.packed_layers is None


@pytest.mark.parametrize("isa", supported_isas())
def test_greedy_tokens_pick_what_torch_argmax_picks(isa: str) -> None:
    """First maximum on ties, the first NaN when a row has one, index 0 for an all -inf row; widths that
    leave vector tails, one row and many (threads split the rows)."""
    kernels = load_kernels(isa)
    gen = torch.Generator().manual_seed(0)
    for width in (1, 7, 16, 17, 49152, 49157):
        rows = torch.randn(33, width, generator=gen)
        rows[1] = float("-inf")
        rows[2] = 0.0
        rows[3, -1] = rows[3].max() + 1  # the maximum in the tail
        rows[4, width // 2 :] = float("nan")
        rows[5, width // 3] = float("nan")
        rows[6] = rows[6].round()  # many ties
        rows[7, 0] = float("inf")
        rows[8, -1] = -0.0
        rows[8, :-1] = float("-inf")
        for batch in (rows[:1], rows[3:4], rows):
            got = kernels.greedy_tokens(batch)
            assert got.dtype == torch.int64
            assert torch.equal(got, torch.argmax(batch, dim=-1)), (isa, width)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.greedy_tokens(torch.zeros(2, 4, dtype=torch.bfloat16))
