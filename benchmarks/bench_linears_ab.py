"""SmolLM2's linears alone (30 layers: qkv, o, gate_up, down) with this tree's CPU kernels (A) against another
tree's (B), in one process, at several token counts.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/bench_linears_ab.py --against /tmp/base --tokens 16,32,48,64,128,512

or two weight formats in this tree: `--format int7 --format-b int8` (B: int8 on this build).

bench_kernels_ab.py times whole engines, whose linear modules keep the build they were made with (only
decode steps under 256 tokens switch, through decode_layers); this times the linears themselves: each build
packs the same random weights, and every round times 3 passes over the 30 layers with A, then B (the order
alternating), on bf16 activations as the int8 engine gives them. Prints the median ms per pass of each, the
paired B/A ratios (> 1: A is faster) and whether both builds' outputs are equal to the bit. Random weights;
only the shapes matter to the time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels_ab import build_other  # noqa: E402

from tritonllm.model import cpu_kernels, quant  # noqa: E402

# (out, in): SmolLM2's fused qkv, o, fused gate_up, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def packed_layers(kernels, fmt: str, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each weight in the build's layout for `fmt` (int8 / int7 / int4: block formats; bf16: bf16_pack's
    tiles)."""
    if fmt == "bf16":
        return [kernels.bf16_pack(w.bfloat16()) for w in weights]
    return [getattr(kernels, f"{fmt}_pack")(*quant.QUANTIZERS[fmt](w)) for w in weights]


def linear(kernels, fmt: str):
    return kernels.bf16_packed_linear if fmt == "bf16" else getattr(kernels, f"{fmt}_linear")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    formats = ("int8", "int7", "int4", "bf16")
    parser.add_argument("--against", type=Path, help="the other tree (a git worktree); default: this one")
    parser.add_argument("--tokens", default="16,32,48,64,128,512", help="token counts, comma-separated")
    parser.add_argument("--format", choices=formats, default="int8")
    parser.add_argument("--format-b", choices=formats, help="B's weight format (default: --format)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    this = cpu_kernels.load_kernels()
    if this is None:
        print("no CPU kernels on this machine: nothing to compare")
        return 0
    builds = {"A": this, "B": build_other(args.against) if args.against else this}
    fmt = {"A": args.format, "B": args.format_b or args.format}
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(LAYERS) for n, k in SHAPES]
    packed = {name: packed_layers(kernels, fmt[name], weights) for name, kernels in builds.items()}
    print(f"CPU flags: {' '.join(cpu_kernels.cpu_flags())}; load average {os.getloadavg()}")
    isa = cpu_kernels.selected_isa()
    print(
        f"{LAYERS} layers, {isa} build; A: {fmt['A']}, this tree; "
        f"B: {fmt['B']}, {args.against or 'this tree'}"
    )
    for m in (int(t) for t in args.tokens.split(",")):
        x = {k: torch.randn(m, k, generator=gen).bfloat16() for k in {k for _, k in SHAPES}}
        first: dict[str, list[torch.Tensor]] = {}  # one layer's outputs from each build
        for name in builds:
            run = linear(builds[name], fmt[name])
            pairs = zip(weights[:4], packed[name][:4], strict=True)
            first[name] = [run(x[w.shape[1]], p, None) for w, p in pairs]
        same = all(torch.equal(a, b) for a, b in zip(first["A"], first["B"], strict=True))
        times: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                run = linear(builds[name], fmt[name])
                started = time.perf_counter()
                for _ in range(3):
                    for w, p in zip(weights, packed[name], strict=True):
                        run(x[w.shape[1]], p, None)
                times[name].append((time.perf_counter() - started) / 3 * 1e3)
        ratios = sorted(b / a for a, b in zip(times["A"], times["B"], strict=True))
        a, b = statistics.median(times["A"]), statistics.median(times["B"])
        print(
            f"{m:5d} tokens: A {a:7.2f} ms, B {b:7.2f} ms; "
            f"B/A paired median {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}); "
            f"outputs {'equal to the bit' if same else 'differ'}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
