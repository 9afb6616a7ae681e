"""bf16 linears on AVX512_BF16 CPUs without AMX: weights packed for vdpbf16ps (bf16_packed_linear.cpp, the
default there) against the row-major paths they replace, side by side in one process, alternating (paired
medians; these machines drift):
  linears  the body's linears (SmolLM2's 30 layers, or 4 of Llama-3.2-1B's, on 2 MB pages as the engine keeps
           them) at several token counts: the packed kernel, the row-major kernel (4 x 4 dot tiles; batch 1
           widens to fp32 on AVX2) and oneDNN's GEMM on the row-major weights (F.linear)
  engine   two bf16 engines on the same weights, packed and row-major (oneDNN from 128 tokens, the previous
           default), fresh prompts per run: prefill time, median decode-only step, output tok/s

    .venv/bin/python benchmarks/bench_bf16_packed.py                                # ~5 min on 2 cores
    .venv/bin/python benchmarks/bench_bf16_packed.py --shape 1b --model .cache/models/RandomLlama-1B

Writes results/bf16_packed.json (or --out) with the CPU flags and load average, and a plot beside it (.png):
`bench_bf16_packed.py --plot results/X.json` redraws one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import textwrap
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_bf16_gemm import engine_rows, run_calls
from bench_kv_cache import engine_run, shapes

from tritonllm.default_model import model_path_or_default
from tritonllm.engine import EngineConfig, LLMEngine
from tritonllm.model.cpu_kernels import cpu_flags, load_kernels, selected_isa
from tritonllm.model.huge_pages import huge_page_zeros

# (layer shapes, layers): enough layers that the weights stream from memory, as in a decode step.
BODIES = {
    "smol": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
    "1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 4),
}
PREVIOUS_GEMM_FROM = 128  # the row-major default on these CPUs before packing


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    out = huge_page_zeros(tuple(t.shape), t.dtype)
    return out.copy_(t)


def paired_times(paths: dict, reps: int) -> dict[str, list[float]]:
    """Each path's wall times over `reps` rounds, the paths alternating within a round."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(reps):
        for name, fn in paths.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def calls(stack: list, layer_shapes: list, inputs: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(activations, weight) for every linear of the body, in a step's order."""
    return [(inputs[k], w) for layer in stack for w, (_, k) in zip(layer, layer_shapes, strict=True)]


def linears(body: str, tokens: list[int]) -> dict[str, dict[str, float]]:
    kernels = load_kernels()
    layer_shapes, num_layers = BODIES[body]
    gen = torch.Generator().manual_seed(0)
    rows = [
        [(torch.randn(n, k, generator=gen) * 0.02).bfloat16() for n, k in layer_shapes]
        for _ in range(num_layers)
    ]
    packed = [[on_huge_pages(kernels.bf16_pack(w)) for w in layer] for layer in rows]
    rows = [[on_huge_pages(w) for w in layer] for layer in rows]
    previous = kernels.onednn_bf16_min_tokens()
    kernels.set_onednn_bf16_min_tokens(0)  # bf16_linear: the row-major kernel at every size
    result = {}
    try:
        for m in tokens:
            inputs = {k: torch.randn(m, k, generator=gen).bfloat16() for _, k in layer_shapes}

            body_packed, body_rows = calls(packed, layer_shapes, inputs), calls(rows, layer_shapes, inputs)
            times = paired_times(
                {
                    "packed": partial(run_calls, kernels.bf16_packed_linear, body_packed),
                    "tiles": partial(run_calls, kernels.bf16_linear, body_rows),
                    "gemm": partial(run_calls, F.linear, body_rows),
                },
                reps=7 if m >= 128 else 15,
            )
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            ratio = {
                f"packed_over_{name}": statistics.median(a / b for a, b in zip(times["packed"], times[name]))  # noqa: B905
                for name in ("tiles", "gemm")
            }
            macs = m * num_layers * sum(n * k for n, k in layer_shapes)
            result[str(m)] = {
                **{f"{k}_ms": v for k, v in ms.items()},
                **ratio,
                "packed_gmac_s": macs / ms["packed"] / 1e6,
            }
            gmacs = result[str(m)]["packed_gmac_s"]
            print(
                f"{body} linears, {m} tokens: packed {ms['packed']:.2f} ms ({gmacs:.0f} GMAC/s), tiles "
                f"{ms['tiles']:.2f}, GEMM {ms['gemm']:.2f}; packed / tiles {ratio['packed_over_tiles']:.3f}, "
                f"packed / GEMM {ratio['packed_over_gemm']:.3f}",
                flush=True,
            )
    finally:
        kernels.set_onednn_bf16_min_tokens(previous)
    return result


def engine_ab(model: str, seqs: int, prompt: int, out: int, rounds: int, threads: int) -> dict:
    kernels = load_kernels()
    previous = kernels.onednn_bf16_min_tokens()
    engines = {}
    try:
        for name, gemm_from in (("packed", 0), ("row_major", PREVIOUS_GEMM_FROM)):
            kernels.set_onednn_bf16_min_tokens(gemm_from)  # read when the layers are built (packs_bf16)
            engines[name] = LLMEngine(
                EngineConfig(model=model, dtype="bfloat16", quantization="none", num_threads=threads,
                             max_model_len=prompt + out + 16)
            )  # fmt: skip
        assert engines["packed"].runner.model.layers[0].qkv_proj.packed
        assert not engines["row_major"].runner.model.layers[0].qkv_proj.packed
        # Packed weights never take the GEMM; row-major ones from PREVIOUS_GEMM_FROM tokens, as before.
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in engines}
        for name, engine in engines.items():
            engine_run(engine, seqs, prompt, 4, f"warm-{name}")
        for r in range(rounds):
            for name in engines if r % 2 == 0 else reversed(engines):
                start = time.perf_counter()
                prefill, step = engine_run(engines[name], seqs, prompt, out, f"r{r}-{name}")  # no prefix hits
                runs[name].append((prefill, step, seqs * out / (time.perf_counter() - start)))
    finally:
        kernels.set_onednn_bf16_min_tokens(previous)

    def row(i: int, scale: float = 1.0) -> dict[str, float]:
        pairs = list(zip(runs["packed"], runs["row_major"], strict=True))
        return {
            "packed": statistics.median(p[i] for p, _ in pairs) * scale,
            "row_major": statistics.median(q[i] for _, q in pairs) * scale,
            "ratio": statistics.median(p[i] / q[i] for p, q in pairs),
        }

    return {"prefill_s": row(0), "decode_step_ms": row(1, 1e3), "tok_s": row(2)}


def ratio_figure(
    path: Path,
    result: dict,
    lines: list[tuple[str, str]],
    bars: dict[str, dict[str, float]],
    labels: dict[str, str],
) -> None:
    """Left: the `lines` keys of result["linears"] rows (time ratios) by tokens per call; right: `bars`
    {series: {engine: ratio}}; a grey line at 1 on both. `labels`: left_title, left_ylabel, right_xlabel,
    right_ylabel, right_title and title (the CPU flags go under it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=[3, 2])
    tokens = [int(m) for m in result["linears"]]
    for key, label in lines:
        left.plot(tokens, [row[key] for row in result["linears"].values()], marker="o", label=label)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xscale="log", xlabel="tokens per call", ylabel=labels["left_ylabel"])
    left.set_xticks(tokens, [str(m) for m in tokens])
    left.set_title(labels["left_title"])
    left.legend()
    names = list(next(iter(bars.values()), {}))
    for i, (series, ratios) in enumerate(bars.items()):
        right.bar(
            [j + 0.4 * i for j in range(len(names))], [ratios[n] for n in names], width=0.4, label=series
        )
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xticks([j + 0.2 for j in range(len(names))], names, fontsize=8)
    right.set(xlabel=labels.get("right_xlabel", ""), ylabel=labels["right_ylabel"])
    right.set_title(labels["right_title"])
    right.legend()
    flags = textwrap.fill("CPU flags: " + " ".join(result["cpu_flags"]), 160)
    fig.suptitle(f"{labels['title']}\n{flags}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(result: dict, path: Path) -> None:
    """The linears' time ratios by tokens per call, and the engines' decode-step ratios."""
    lines = [
        ("packed_over_tiles", "packed / row-major vdpbf16ps / AVX2 tiles"),
        ("packed_over_gemm", "packed / oneDNN GEMM"),
    ]
    engine = result["engine"]
    bars = {
        key.split("_")[0]: {n: engine[n][key]["ratio"] for n in engine}
        for key in ("prefill_s", "decode_step_ms")
    }
    labels = {
        "left_title": f"{result['shape']} linears, paired medians",
        "left_ylabel": "time ratio (< 1: packed faster)",
        "right_xlabel": "requests x prompt tokens",
        "right_ylabel": "packed / row-major time",
        "right_title": "engine, paired rounds",
        "title": f"bf16 weights packed for vdpbf16ps, {result['isa']} build",
    }
    ratio_figure(path, result, lines, bars, labels)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(BODIES), default="smol", help="linears: whose layer shapes")
    parser.add_argument("--model", help="engine: HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,512", help="linears: tokens per call")
    parser.add_argument(
        "--shapes", type=shapes, default="1x128,32x128,16x512", help="engine: sequences x prompt"
    )
    parser.add_argument("--out-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bf16_packed.json"))
    parser.add_argument("--plot", metavar="JSON", help="only redraw the plot of an earlier run")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)
    if not load_kernels().packs_bf16():
        raise SystemExit(
            f"bf16 weights are not packed here ({selected_isa()} build, or oneDNN takes them: AMX)"
        )
    result = {
        "cpu_flags": cpu_flags(),
        "isa": selected_isa(),
        "load_average": os.getloadavg(),
        "shape": args.shape,
    }
    print(f"CPU flags: {' '.join(cpu_flags())}; kernels {selected_isa()}; load {os.getloadavg()[0]:.2f}")
    result["linears"] = linears(args.shape, [int(t) for t in args.tokens.split(",")])
    model = model_path_or_default(args.model)
    result["engine"] = engine_rows(
        args.shapes,
        args.out_tokens,
        "packed / row-major",
        ("packed", "row_major"),
        lambda seqs, prompt: engine_ab(model, seqs, prompt, args.out_tokens, args.rounds, args.threads),
    )
    result["load_average_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=1))
    plot(result, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} and its .png")


if __name__ == "__main__":
    main()
