"""The C++ varlen prefill attention (all of a step's prefill chunks in one call, from the paged cache) equals
PyTorch's causal attention chunk by chunk, for every instruction set this CPU runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine
from test_cpu_kernel import DTYPE_IDS, DTYPES, as_fp32, random_cache

from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import ScheduledChunk
from tritonllm.engine.sequence import Sequence
from tritonllm.model.cpu_kernels import NATIVE_BF16_ISAS, load_kernels, supported_isas
from tritonllm.model.llama import gather_blocks


def torch_prefill_attention(q, k_cache, v_cache, tables, starts, lengths, scale):
    """Reference: per chunk, its keys gathered from the cache, a causal mask offset by the cached prefix."""
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    out = torch.empty_like(q)
    for s in range(len(lengths)):
        first, last, context = int(starts[s]), int(starts[s + 1]), int(lengths[s])
        keys = gather_blocks(k_cache, tables[s : s + 1])[:, 0, :context]  # [kv_heads, context, d]
        values = gather_blocks(v_cache, tables[s : s + 1])[:, 0, :context]
        keys = keys.repeat_interleave(heads // kv_heads, 0)
        values = values.repeat_interleave(heads // kv_heads, 0)
        queries = q[first:last].transpose(0, 1)  # [heads, L, d]
        position = torch.arange(last - first)[:, None] + (context - (last - first))
        visible = position >= torch.arange(context)[None, :]
        scores = (queries @ keys.transpose(-1, -2)) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[first:last] = (probs @ values).transpose(0, 1)
    return out


# (queries, keys) per chunk: a whole prompt, chunks after a cached prefix (ragged and block-aligned), a chunk
# shorter than a query tile, one longer than several, one over three of the amx build's 128-key steps.
CHUNKS = [(37, 37), (5, 21), (16, 64), (1, 9), (70, 200), (40, 290)]


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunks", [CHUNKS, CHUNKS[:1]], ids=["all", "one"])
def test_prefill_kernel_matches_torch(isa, dtypes, threads, chunks) -> None:
    kernel = load_kernels(isa)
    dtype, cache_dtype = dtypes
    gen = torch.Generator().manual_seed(2)
    kv_heads, blocks, bs, head_dim, heads = 3, 96, 16, 64, 9  # SmolLM2's geometry
    k_cache = random_cache((kv_heads, blocks, bs, head_dim), cache_dtype, gen)
    v_cache = random_cache((kv_heads, blocks, bs, head_dim), cache_dtype, gen)
    width = max(-(-keys // bs) for _, keys in chunks)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:width] for _ in chunks])
    starts = torch.tensor([0] + [queries for queries, _ in chunks]).cumsum(0)
    lengths = torch.tensor([keys for _, keys in chunks])
    # Queries x 4: scores as large as SmolLM2's outlier dims make them, where rounding queries to bf16 shows.
    q = (4 * torch.randn(int(starts[-1]), heads, head_dim, generator=gen)).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lengths, 0.125)
    finally:
        torch.set_num_threads(previous)
    assert got.dtype == dtype
    expected = torch_prefill_attention(
        q.float(), as_fp32(k_cache), as_fp32(v_cache), tables, starts, lengths, 0.125
    )
    if dtype == torch.bfloat16:
        tolerance = 2e-2  # bf16 queries and output
    elif cache_dtype in (torch.bfloat16, torch.int8) and isa in NATIVE_BF16_ISAS:
        # probabilities rounded to bf16 for vdpbf16ps and AMX tiles; fp32 q split (unsplit bf16 q: 3e-2)
        tolerance = 5e-3
    else:
        tolerance = 1e-5
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("starts", "lengths", "message"),
    [
        ([0, 4], [3], "queries <= keys"),  # more queries than keys
        ([0, 4], [200], "capacity"),  # more keys than the table holds
        ([0, 3], [8], "from 0 to q's tokens"),  # queries left over
    ],
)
def test_prefill_kernel_refuses_inconsistent_metadata(starts, lengths, message) -> None:
    kernel = load_kernels()
    cache = torch.zeros(1, 4, 16, 8)
    with pytest.raises(RuntimeError, match=message):
        kernel.paged_prefill_attention(
            torch.zeros(4, 2, 8), cache, cache, torch.zeros(1, 2, dtype=torch.long),
            torch.tensor(starts), torch.tensor(lengths), 1.0,
        )  # fmt: skip


def test_engine_steps_with_the_kernel_match_the_sdpa_loop(tiny_llama_dir: Path) -> None:
    """A step mixing a decode, a chunk after a cached prefix and a whole prompt: the model's logits through
    the one kernel call equal those of PyTorch's attention run chunk by chunk (StepInputs' metadata)."""
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=64)
    runner = engine.runner
    chunks = []
    for name, (computed, length, scheduled) in {
        "decode": (9, 10, 1),
        "middle": (6, 17, 7),
        "prompt": (0, 11, 11),
    }.items():
        seq = Sequence(name, list(range(3, 3 + length)), SamplingParams())
        seq.num_computed_tokens = computed
        chunks.append(ScheduledChunk(seq, scheduled))
    tables = {"decode": [0, 1, 2], "middle": [3, 4, 5, 6, 7], "prompt": [8, 9, 10]}
    logits = []
    for varlen in (True, False):
        for layer in runner.model.layers:
            layer.varlen_prefill = varlen
        ids, positions, meta, logits_at = runner.inputs.build(chunks, tables)
        logits.append(runner.model(ids, positions, meta, runner.kv_layers, logits_at))
    assert logits[0].shape[0] == 2  # the decode and the whole prompt sample; the middle chunk does not
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
