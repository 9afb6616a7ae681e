"""Decode attention alone, this tree's CPU kernels (A) against another tree's (B), in one process.

SmolLM2's geometry (9 query heads over 3 kv heads of 64, blocks of 16 tokens), one cache per layer (30) on
huge pages as the engine allocates them, blocks scattered: a decode step's attention over `--seqs`
sequences of `--context` keys. Each round times 3 steps with A, then B (the order alternating); with
`--cold` (the default) a 256 MB read before each step takes the caches out of L3, as the weights' stream
does in a real step, `--hot` leaves them there (one layer's cache read 30 times, so it fits). Prints the
median step of each, the paired B/A (> 1: A is faster) and whether both outputs are equal to the bit.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/bench_attention_ab.py --against /tmp/base --seqs 32 --context 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels_ab import build_other  # noqa: E402

from tritonllm.model.cpu_kernels import cpu_flags, load_kernels  # noqa: E402
from tritonllm.model.huge_pages import huge_page_zeros  # noqa: E402

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 16


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", required=True, help="the other tree (a git worktree)")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=200, help="keys each sequence attends to")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the cache's")
    parser.add_argument("--hot", action="store_true", help="caches left in L3 (one layer's, read 30 times)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    kernels = {"A": load_kernels(), "B": build_other(Path(args.against))}
    width = -(-args.context // BLOCK)
    blocks = args.seqs * width + 8
    shape = (LAYERS, 2, KV_HEADS, blocks, BLOCK, HEAD_DIM)
    cache = huge_page_zeros(shape, getattr(torch, args.dtype), populate=True)
    cache.copy_(torch.randn(shape))
    order = torch.randperm(blocks)
    tables = torch.stack([order[i * width : (i + 1) * width] for i in range(args.seqs)])
    lengths = torch.full((args.seqs,), args.context)
    q = torch.randn(args.seqs, HEADS, HEAD_DIM)
    evict = torch.ones(64 << 20)  # 256 MB

    def step(k) -> float:
        if not args.hot:
            evict.sum()
        started = time.perf_counter()
        for layer in range(LAYERS):
            kv = cache[0 if args.hot else layer]
            k.paged_decode_attention(q, kv[0], kv[1], tables, lengths, 0.125)
        return time.perf_counter() - started

    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            times[name].append(statistics.median(step(kernels[name]) for _ in range(3)))
    ratios = [b / a for a, b in zip(times["A"], times["B"], strict=True)]
    same = torch.equal(*(k.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lengths, 0.125)
                         for k in kernels.values()))  # fmt: skip
    keys = args.seqs * args.context * KV_HEADS * LAYERS
    step_bytes = keys * 2 * HEAD_DIM * cache.element_size()  # its keys and values
    a_ms, b_ms = (statistics.median(times[n]) * 1e3 for n in "AB")
    print(f"CPU flags: {' '.join(cpu_flags())}; {torch.get_num_threads()} threads")
    print(f"{args.seqs} x {args.context} keys, {args.dtype} cache, {'hot' if args.hot else 'cold'}: "
          f"A {a_ms:.2f} ms a step ({step_bytes / a_ms / 1e6:.1f} GB/s of keys and values), "
          f"B {b_ms:.2f} ms; B/A paired median {statistics.median(ratios):.3f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}); outputs equal to the bit: {same}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
