"""The amx build against the avx512_bf16 build on a CPU with AMX, side by side (paired medians; these
machines drift):
  linears  the body's linears (SmolLM2's 30 layers, or 4 of Llama-3.2-1B's, on 2 MB pages) at several token
           counts, in one process: int8 on the amx build (tdpbsud from 16 tokens, weights widened to bf16
           for tdpbf16ps from 32) and on the avx512_bf16 build (vpdpbusd); packed bf16 on the amx build
           (tdpbf16ps from 4 tokens) and on the avx512_bf16 build (vdpbf16ps); oneDNN's bf16 GEMM on row-major
           weights (what the avx512_bf16 build hands 16 tokens or more on AMX CPUs)
  attention  decode attention (30 layers' bf16 caches) and prefill attention (one prompt), fp32 and bf16
           queries: the amx build (keys scored on tiles; prefill's scores and value sums on tiles) against
           the avx512_bf16 build (vdpbf16ps), in one process
  engine   whole engines (int8, and bf16 with --quantization none), one process per build and round,
           alternating (TRITONLLM_CPU_ISA=amx or avx512_bf16, each build's defaults): the time until every
           prompt has its first token, and the median decode-only step

    .venv/bin/python benchmarks/bench_amx.py                        # ~8 min on 2 cores
    .venv/bin/python benchmarks/bench_amx.py --shape 1b --engine-shapes ""

Writes results/amx.json (or --out) with the CPU flags and load average, and a plot beside it (.png):
`bench_amx.py --plot results/X.json` redraws one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from bench_bf16_packed import BODIES, on_huge_pages, paired_times, ratio_figure

from tritonllm.default_model import model_path_or_default
from tritonllm.engine import EngineConfig, LLMEngine, SamplingParams
from tritonllm.model.cpu_kernels import cpu_flags, load_kernels, supported_isas
from tritonllm.model.quant import quantize_int8_blocks

BUILDS = ("amx", "avx512_bf16")


RATIOS = {
    "int8_amx_over_vnni": ("int8_amx", "int8_vnni"),
    "bf16_amx_over_vdpbf16ps": ("bf16_amx", "bf16_vdpbf16ps"),
    "bf16_amx_over_onednn": ("bf16_amx", "bf16_onednn"),
}


def paths(amx, other, calls: list) -> dict:
    """One pass over the body's linears per path; calls: (activations, int8, packed bf16, row-major bf16)."""
    by_name = {
        "int8_amx": lambda: [amx.int8_linear(a, w) for a, w, _, _ in calls],
        "int8_vnni": lambda: [other.int8_linear(a, w) for a, w, _, _ in calls],
        "bf16_amx": lambda: [amx.bf16_packed_linear(a, p) for a, _, p, _ in calls],
        "bf16_vdpbf16ps": lambda: [other.bf16_packed_linear(a, p) for a, _, p, _ in calls],
        "bf16_onednn": lambda: [F.linear(a, r) for a, _, _, r in calls],
    }
    for fn in by_name.values():
        fn()  # warm-up
    return by_name


def linears(body: str, tokens: list[int], rounds: int) -> dict[str, dict[str, float]]:
    amx, other = load_kernels("amx"), load_kernels("avx512_bf16")
    layer_shapes, num_layers = BODIES[body]
    gen = torch.Generator().manual_seed(0)
    rows = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in layer_shapes] for _ in range(num_layers)]
    int8 = [[on_huge_pages(amx.int8_pack(*quantize_int8_blocks(w))) for w in layer] for layer in rows]
    packed = [[on_huge_pages(amx.bf16_pack(w.bfloat16())) for w in layer] for layer in rows]
    row_major = [[on_huge_pages(w.bfloat16()) for w in layer] for layer in rows]
    out: dict[str, dict[str, float]] = {}
    for m in tokens:
        x = {k: torch.randn(m, k, generator=gen).bfloat16() for _, k in layer_shapes}
        calls = [
            (x[k], i8, p, r)
            for l8, lp, lr in zip(int8, packed, row_major, strict=True)
            for (_, k), i8, p, r in zip(layer_shapes, l8, lp, lr, strict=True)
        ]
        times = paired_times(paths(amx, other, calls), rounds)
        row = {f"{name}_ms": statistics.median(t) * 1e3 for name, t in times.items()}
        for key, (a, b) in RATIOS.items():
            row[key] = statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))
        out[str(m)] = row
        print(
            f"{m:4d} tokens: int8 amx/vnni {row['int8_amx_over_vnni']:.2f}, bf16 amx/vdpbf16ps "
            f"{row['bf16_amx_over_vdpbf16ps']:.2f}, amx/oneDNN {row['bf16_amx_over_onednn']:.2f} "
            f"(int8 amx {row['int8_amx_ms']:.2f} ms, bf16 amx {row['bf16_amx_ms']:.2f} ms)",
            flush=True,
        )
    return out


def decode_layers(kernels: ModuleType, q: torch.Tensor, layers: list, tables, lengths) -> list:
    """One decode step's attention over every layer's (keys, values) caches."""
    return [kernels.paged_decode_attention(q, k, v, tables, lengths, 0.125) for k, v in layers]


def prefill_prompt(kernels: ModuleType, q: torch.Tensor, layers: list, tables, lengths) -> torch.Tensor:
    """One prompt's prefill attention over its own keys (layers: one (keys, values) pair)."""
    (keys, values), starts = layers[0], torch.tensor([0, q.shape[0]])
    return kernels.paged_prefill_attention(q, keys, values, tables, starts, lengths, 0.125)


def attention(decode: list[tuple[int, int]], prefill: list[int], rounds: int) -> dict[str, dict]:
    """Decode and prefill attention over bf16 caches (SmolLM2's geometry: 9 heads, 3 kv heads, head size 64,
    blocks of 16), the amx build's tile products against the avx512_bf16 build's vdpbf16ps, in one process:
    decode over 30 layers' caches (shuffled blocks), prefill of one prompt over its own keys; fp32 queries
    (the int8 engine's) and bf16 (the bf16 engine's)."""
    builds = {"amx": load_kernels("amx"), "avx512_bf16": load_kernels("avx512_bf16")}
    gen = torch.Generator().manual_seed(0)
    kv_heads, heads, head_dim, block = 3, 9, 64, 16
    # (name, step, queries a layer, sequences, keys each, layers)
    cases = [("decode", decode_layers, seqs, seqs, keys, 30) for seqs, keys in decode]
    cases += [("prefill", prefill_prompt, length, 1, length, 1) for length in prefill]
    out: dict[str, dict] = {}
    for kind, step, queries, seqs, keys, count in cases:
        per_seq = -(-keys // block)
        shape = (kv_heads, seqs * per_seq, block, head_dim)
        layers = [tuple(torch.randn(shape, generator=gen).bfloat16() for _ in range(2)) for _ in range(count)]
        tables = torch.stack([torch.randperm(seqs * per_seq, generator=gen)[:per_seq] for _ in range(seqs)])
        lengths = torch.full((seqs,), keys)
        for dtype, q_name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            q = torch.randn(queries, heads, head_dim, generator=gen).to(dtype)
            paths = {b: partial(step, k, q, layers, tables, lengths) for b, k in builds.items()}
            for path in paths.values():
                path()  # warm-up: a thread's first tile instruction makes the kernel grow its saved state
            times = paired_times(paths, rounds)
            row = {f"{b}_ms": statistics.median(t) * 1e3 for b, t in times.items()}
            pairs = zip(times["amx"], times["avx512_bf16"], strict=True)
            row["ratio"] = statistics.median(a / b for a, b in pairs)
            name = f"{kind} {seqs}x{keys} {q_name} q" if kind == "decode" else f"{kind} {keys} {q_name} q"
            out[name] = row
            print(
                f"{name}: amx {row['amx_ms']:.2f} ms, avx512_bf16 {row['avx512_bf16_ms']:.2f} ms "
                f"({row['ratio']:.2f})",
                flush=True,
            )
    return out


def one_engine(quantization: str, seqs: int, prompt: int, out_tokens: int, model: str, threads: int) -> None:
    """Prints {"prefill_s", "decode_ms"} of the second of two runs (the first warms up) as one JSON line."""
    config = EngineConfig(
        model=model,
        num_threads=threads,
        dtype="auto",  # serving's default: bf16 under "none"; under int8 bf16 activations on amx, else fp32
        quantization=quantization,
        kv_cache_memory_bytes=1 << 30,
    )
    engine = LLMEngine(config)
    for run in range(2):
        params = SamplingParams(max_tokens=out_tokens, min_tokens=out_tokens, top_k=1)
        for i in range(seqs):  # a fresh first token per prompt: no prefix-cache hits
            engine.add_request(f"{run}-{i}", [1000 + 100 * run + i, *range(101, 100 + prompt)], params)
        steps, started, prefill_s, begin = [], set(), None, time.perf_counter()
        while engine.has_unfinished():
            start = time.perf_counter()
            outputs = engine.step()
            steps.append(time.perf_counter() - start)
            started |= {o.request_id for o in outputs if o.new_token_ids}
            if prefill_s is None and len(started) == seqs:
                prefill_s = time.perf_counter() - begin
    decode_ms = statistics.median(steps[-(out_tokens // 2) :]) * 1e3
    print(json.dumps({"prefill_s": prefill_s, "decode_ms": decode_ms}))


def engines(args: argparse.Namespace, model: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for quantization in ("int8", "none"):
        for shape in filter(None, args.engine_shapes.split(",")):
            seqs, prompt = (int(v) for v in shape.split("x"))
            runs: dict[str, list[dict]] = {build: [] for build in BUILDS}
            for r in range(args.engine_rounds):
                for build in BUILDS if r % 2 == 0 else BUILDS[::-1]:
                    command = [sys.executable, __file__, "--one-engine", quantization, str(seqs), str(prompt)]
                    command += [str(args.out_tokens), model, str(args.threads)]
                    env = {**os.environ, "TRITONLLM_CPU_ISA": build}
                    done = subprocess.run(
                        command, env=env, capture_output=True, text=True, check=True, timeout=900
                    )
                    runs[build].append(json.loads(done.stdout.strip().splitlines()[-1]))
            pairs = list(zip(runs["amx"], runs["avx512_bf16"], strict=True))
            row = {}
            for key in ("prefill_s", "decode_ms"):
                row[f"{key}_amx"] = statistics.median(a[key] for a, _ in pairs)
                row[f"{key}_avx512_bf16"] = statistics.median(b[key] for _, b in pairs)
                row[f"{key}_ratio"] = statistics.median(a[key] / b[key] for a, b in pairs)
            name = f"{'bf16' if quantization == 'none' else quantization} {shape}"
            out[name] = row
            print(
                f"{name}: prefill {row['prefill_s_amx']:.2f} / {row['prefill_s_avx512_bf16']:.2f} s "
                f"({row['prefill_s_ratio']:.2f}), decode step {row['decode_ms_amx']:.1f} / "
                f"{row['decode_ms_avx512_bf16']:.1f} ms ({row['decode_ms_ratio']:.2f})",
                flush=True,
            )
    return out


def plot(result: dict, path: Path) -> None:
    """The linears' time ratios by tokens per call, and the engines' ratios."""
    lines = [
        ("int8_amx_over_vnni", "int8: amx / vpdpbusd"),
        ("bf16_amx_over_vdpbf16ps", "bf16: amx / vdpbf16ps"),
        ("bf16_amx_over_onednn", "bf16: amx / oneDNN GEMM"),
    ]
    engine = result.get("engine", {})
    bars = {
        key.split("_")[0]: {n: engine[n][key] for n in engine}
        for key in ("prefill_s_ratio", "decode_ms_ratio")
    }
    labels = {
        "left_title": f"{result['shape']} linears, paired medians",
        "left_ylabel": "time ratio (< 1: amx faster)",
        "right_ylabel": "amx / avx512_bf16 build, time",
        "right_title": "engine, alternating processes",
        "title": "AMX tiles against the avx512_bf16 build",
    }
    ratio_figure(path, result, lines, bars, labels)


def main() -> None:
    if sys.argv[1:2] == ["--one-engine"]:
        q, seqs, prompt, out_tokens, model, threads = sys.argv[2:8]
        return one_engine(q, int(seqs), int(prompt), int(out_tokens), model, int(threads))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(BODIES), default="smol", help="linears: whose layer shapes")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,512", help="linears: tokens per call")
    parser.add_argument("--rounds", type=int, default=7, help="linears: paired rounds")
    parser.add_argument(
        "--decode-attention", default="32x256,1x1000", help='attention: sequences x keys ("": none)'
    )
    parser.add_argument(
        "--prefill-attention", default="128,1024", help='attention: prompt lengths ("": none)'
    )
    parser.add_argument("--model", help="engine: HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--engine-shapes", default="1x512,32x128", help='engine: sequences x prompt ("": none)'
    )
    parser.add_argument("--engine-rounds", type=int, default=2)
    parser.add_argument("--out-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "amx.json"))
    parser.add_argument("--plot", metavar="JSON", help="only redraw the plot of an earlier run")
    args = parser.parse_args()
    if args.plot:
        return plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
    if "amx" not in supported_isas():
        raise SystemExit(
            "no amx build here: the CPU lacks AMX (amx_tile/bf16/int8) or the OS refused its tiles"
        )
    torch.set_num_threads(args.threads)
    result = {"cpu_flags": cpu_flags(), "load_average": os.getloadavg(), "shape": args.shape}
    print(f"CPU flags: {' '.join(cpu_flags())}; load {os.getloadavg()[0]:.2f}")
    tokens = [int(t) for t in filter(None, args.tokens.split(","))]
    result["linears"] = linears(args.shape, tokens, args.rounds)
    shapes = [shape.split("x") for shape in filter(None, args.decode_attention.split(","))]
    decode = [(int(seqs), int(keys)) for seqs, keys in shapes]
    prefill = [int(v) for v in filter(None, args.prefill_attention.split(","))]
    result["attention"] = attention(decode, prefill, args.rounds)
    result["engine"] = engines(args, str(model_path_or_default(args.model)))
    result["load_average_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=1))
    if result["linears"]:
        plot(result, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
