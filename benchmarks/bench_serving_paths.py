"""What the Triton layers cost: the same generations through `tensorrt_llm` directly (token ids in and
out), the `ensemble` (preprocessing -> tensorrt_llm -> postprocessing) and `tensorrt_llm_bls`.

One server, one script: the three paths run interleaved (path order rotated every round), so a change
in machine load hits all of them alike. Each generation is one gRPC stream, greedy, `min_tokens =
max_tokens` so every path generates exactly the same number of tokens. Reported per path: median over
rounds of time to first token, mean inter-token latency and end-to-end time, and the ratio to the
direct path. With `--concurrency N` each path's turn is N generations at once (each its own stream),
and the output tokens/s of the turn (all tokens over its wall time) is reported too: there the text
paths' second Python-backend hop per response competes with the engine for the cores. Writes
`results/<name>.json` and `.md` (name `serving_paths` by default).

    .venv/bin/python benchmarks/bench_serving_paths.py            # SmolLM2 (the default model)
    .venv/bin/python benchmarks/bench_serving_paths.py --model DIR --rounds 9 --max-tokens 64
    .venv/bin/python benchmarks/bench_serving_paths.py --concurrency 32 --name serving_paths_c32
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from tritonllm.default_model import model_path_or_default
from tritonllm.model.cpu_kernels import cpu_flags
from tritonllm.precision import TORCH_QUANTIZATIONS
from tritonllm.triton.launcher import LaunchOptions, TritonServer
from tritonllm.triton.text import TextCodec

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PATHS = ("tensorrt_llm", "ensemble", "tensorrt_llm_bls")
TIMEOUT_S = 300.0


def tensor(name: str, value: np.ndarray) -> grpcclient.InferInput:
    dtype = {
        np.dtype(object): "BYTES",
        np.dtype(bool): "BOOL",
        np.dtype(np.int32): "INT32",
        np.dtype(np.float32): "FP32",
        np.dtype(np.uint64): "UINT64",
    }[value.dtype]
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def inputs_for(
    path: str, prompt_ids: list[int], max_tokens: int, streaming: bool = True
) -> list[grpcclient.InferInput]:
    """Greedy, exactly `max_tokens`; unstreamed `tensorrt_llm` requests leave the prompt out of the output."""
    n = np.array([[max_tokens]], dtype=np.int32)
    if path == "tensorrt_llm":
        return [
            tensor("input_ids", np.array([prompt_ids], dtype=np.int32)),
            tensor("input_lengths", np.array([[len(prompt_ids)]], dtype=np.int32)),
            tensor("request_output_len", n),
            tensor("min_tokens", n),
            tensor("runtime_top_k", np.array([[1]], dtype=np.int32)),
            tensor("streaming", np.array([[streaming]])),
            tensor("exclude_input_in_output", np.array([[not streaming]])),
        ]
    return [
        tensor("text_input", np.array([[PROMPT.encode()]], dtype=object)),
        tensor("max_tokens", n),
        tensor("min_tokens", n),
        tensor("top_k", np.array([[1]], dtype=np.int32)),
        tensor("stream", np.array([[True]])),
    ]


def generate(url: str, path: str, inputs: list[grpcclient.InferInput]) -> tuple[float, list[float]]:
    """(seconds to the first response, response arrival times) of one streamed generation."""
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    start = time.perf_counter()
    client.async_stream_infer(path, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True)
    arrivals = []
    try:
        while True:
            result, error = results.get(timeout=TIMEOUT_S)
            if error is not None:
                raise RuntimeError(f"{path}: {error}")
            response = result.get_response()
            if response.outputs:
                arrivals.append(time.perf_counter() - start)
            if response.parameters["triton_final_response"].bool_param:
                return arrivals[0], arrivals
    finally:
        client.stop_stream()
        client.close()


def generate_at_once(url: str, path: str, inputs: list[grpcclient.InferInput], n: int) -> tuple[float, list]:
    """(wall seconds, each generation's `generate` result) of `n` identical generations started together."""
    with ThreadPoolExecutor(n) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda _: generate(url, path, inputs), range(n)))
        return time.perf_counter() - start, results


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """--threads, --dtype and --quantization, defaulting to what `tritonllm launch` serves (2 threads)."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="as `tritonllm launch` (default: auto)")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", *TORCH_QUANTIZATIONS),
        help="as `tritonllm launch` (default: auto, int8 where the kernels build)",
    )


def loopback_options(args: argparse.Namespace, model: str, **extra: object) -> LaunchOptions:
    """A server on free loopback ports with the engine arguments of `add_engine_arguments`."""
    http, grpc, metrics = free_ports(3)
    return LaunchOptions(
        model=model,
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        num_threads=args.threads,
        dtype=args.dtype,
        quantization=args.quantization,
        **extra,  # type: ignore[arg-type]
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF checkpoint or engine directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1, help="generations at once per path (default 1)")
    add_engine_arguments(parser)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--name", default="serving_paths", help="output file name, without suffix")
    args = parser.parse_args()
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")

    model = model_path_or_default(args.model)
    prompt_ids = TextCodec(model).encode(PROMPT)
    options = loopback_options(args, model)
    runs: dict[str, list[tuple[float, list[float]]]] = {p: [] for p in PATHS}
    rates: dict[str, list[float]] = {p: [] for p in PATHS}  # output tok/s of each turn
    out = Path(args.out)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    with TritonServer(options, log_file=out / "raw" / "serving_paths_server.log") as server:
        print(f"starting tritonserver on {model} ...", file=sys.stderr, flush=True)
        server.wait_ready(600)
        for path in PATHS:  # warm-up (kernel build, first-call costs)
            generate(server.grpc_url, path, inputs_for(path, prompt_ids, 4))
        for r in range(args.rounds):
            order = PATHS[r % 3 :] + PATHS[: r % 3]
            for path in order:
                inputs = inputs_for(path, prompt_ids, args.max_tokens)
                wall, results = generate_at_once(server.grpc_url, path, inputs, args.concurrency)
                runs[path] += results
                rates[path].append(sum(len(a) for _, a in results) / wall)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    summary = {}
    for path in PATHS:
        ttft = statistics.median(t for t, _ in runs[path])
        itl = statistics.median(statistics.fmean(np.diff(a)) for _, a in runs[path])
        e2e = statistics.median(a[-1] for _, a in runs[path])
        summary[path] = {
            "ttft_ms": ttft * 1e3,
            "itl_ms": itl * 1e3,
            "e2e_ms": e2e * 1e3,
            "tok_s": statistics.median(rates[path]),
        }
    base = summary["tensorrt_llm"]
    for path in PATHS:
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            summary[path][key.replace("_ms", "_ratio")] = summary[path][key] / base[key]
        summary[path]["itl_overhead_ms"] = summary[path]["itl_ms"] - base["itl_ms"]
        # Paired by round: the turns of one round are seconds apart, so the host's drift cancels.
        summary[path]["tok_s_ratio"] = statistics.median(
            r / b for r, b in zip(rates[path], rates["tensorrt_llm"], strict=True)
        )

    meta = {
        "model": model,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "threads": args.threads,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "cpu_flags": cpu_flags(),
        "load_average": os.getloadavg(),
    }
    (out / f"{args.name}.json").write_text(json.dumps({"config": meta, "paths": summary}, indent=2) + "\n")
    lines = [
        f"Model `{Path(model).name}` (dtype {args.dtype}, quantization {args.quantization}, "
        f"{args.threads} engine threads), {args.max_tokens} tokens per generation, "
        f"{args.concurrency} at once, {args.rounds} rounds, medians; ratios against `tensorrt_llm` "
        "called directly (tok/s: paired by round).",
        f"CPU flags: {' '.join(cpu_flags()) or 'none'}; load average {os.getloadavg()[0]:.1f}.",
        "",
        "| path | TTFT ms | ITL ms | end-to-end ms | tok/s | ITL ratio | ITL overhead ms | e2e ratio "
        "| tok/s ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path, s in summary.items():
        lines.append(
            f"| `{path}` | {s['ttft_ms']:.1f} | {s['itl_ms']:.2f} | {s['e2e_ms']:.0f} | {s['tok_s']:.1f} | "
            f"{s['itl_ratio']:.3f} | {s['itl_overhead_ms']:+.2f} | {s['e2e_ratio']:.3f} | "
            f"{s['tok_s_ratio']:.3f} |"
        )
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
