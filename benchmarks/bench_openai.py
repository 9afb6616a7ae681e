"""What the OpenAI front door costs: the same streamed generations straight to `tensorrt_llm_bls` over gRPC
and through `tritonllm openai` (HTTP, SSE) on one Triton server, the latter with the official `openai`
client and with a plain HTTP client (aiohttp, SSE lines read as they come). The plain client separates
what the front door adds from what the `openai` package costs its caller (building and validating its
request and response models takes ~1.3 ms per request at concurrency 1). A second front door calls
`tensorrt_llm` itself (`--triton-model tensorrt_llm`, no BLS hop), read by the plain client
(`http_front_door_engine`).

Both paths send the same inputs (the front door's own translation of one completion body: greedy,
`ignore_eos`, so every request generates exactly `--max-tokens` tokens), `--concurrency` at a time, with
fresh prompts of `--prompt-tokens` tokens per request (no prefix-cache hits). The paths alternate, order
rotated every round, so machine load hits both alike. Reported per path: medians over rounds of the p50
and p95 time to first token, the p50 of per-request mean inter-token latency, and output tokens/s; the
front door's TTFT p50 as a ratio of the direct path's. With `--aiperf PATH` it also runs NVIDIA's aiperf
against the front door (chat, streaming, same sizes and concurrency) and the direct path right after it;
with `--loadtest PATH`, `tritonllm-loadtest` (Locust, gRPC streams straight to `tensorrt_llm_bls`) with
the same sizes and concurrency on the same server. Writes `results/openai.json` and `.md`.

    .venv/bin/python benchmarks/bench_openai.py                                   # SmolLM2, 7 rounds
    .venv/bin/python benchmarks/bench_openai.py --aiperf .cache/aiperf-venv/bin/aiperf \
        --loadtest .venv/bin/tritonllm-loadtest
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from functools import partial
from pathlib import Path

import aiohttp
import openai
import psutil

from tritonllm.default_model import model_path_or_default
from tritonllm.openai.child import FrontDoorProcess
from tritonllm.openai.protocol import PromptEncoder, RequestTranslator
from tritonllm.openai.triton import TritonBackend
from tritonllm.precision import TORCH_QUANTIZATIONS
from tritonllm.tokenization import load_tokenizer
from tritonllm.triton.launcher import LaunchOptions, TritonServer

PATHS = ("grpc_direct", "openai_front_door", "http_front_door", "http_front_door_engine")
FRONT_DOOR_PATHS = PATHS[1:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompts(encoder: PromptEncoder, n: int, tokens: int, seed: str) -> list[str]:
    """`n` distinct prompts of about `tokens` tokens each: random vocabulary tokens, decoded."""
    rng = random.Random(seed)
    tokenizer = encoder.tokenizer
    low, high = 1000, len(tokenizer) - 1000  # clear of the special and byte tokens at either end
    return [tokenizer.decode([rng.randrange(low, high) for _ in range(tokens)]) for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Runner:
    def __init__(
        self,
        backend: TritonBackend,
        front_door_url: str,
        engine_front_door_url: str,
        translator: RequestTranslator,
        model: str,
    ):
        self.backend = backend
        self.translator = translator
        self.model = model
        self.url = front_door_url
        self.engine_url = engine_front_door_url
        self.client = openai.AsyncOpenAI(base_url=front_door_url, api_key="unused", max_retries=0)
        self.session: aiohttp.ClientSession | None = None  # made on the running loop

    def body(self, prompt: str, max_tokens: int) -> dict:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }

    async def direct(self, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
        inputs = self.translator.completion(self.body(prompt, max_tokens)).inputs
        start = time.perf_counter()
        arrivals, tokens = [], 0
        async for piece in self.backend.generate(inputs, 1, uuid.uuid4().hex):
            if piece.num_tokens:
                arrivals.append(piece.received_s - start)
                tokens += piece.num_tokens
        return arrivals[0], arrivals, tokens

    async def front_door(self, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
        body = self.body(prompt, max_tokens)
        extra = {"ignore_eos": body.pop("ignore_eos")}
        start = time.perf_counter()
        stream = await self.client.completions.create(
            **body, stream=True, stream_options={"include_usage": True}, extra_body=extra
        )
        arrivals, tokens = [], 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter() - start)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return arrivals[0], arrivals, tokens

    async def http_front_door(
        self, prompt: str, max_tokens: int, url: str | None = None
    ) -> tuple[float, list[float], int]:
        """The same request as `front_door`, as plain HTTP: the SSE lines parsed as JSON, nothing more."""
        if self.session is None:
            self.session = aiohttp.ClientSession()
        body = {**self.body(prompt, max_tokens), "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        arrivals, tokens = [], 0
        async with self.session.post(f"{url or self.url}/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"http_front_door: {response.status} {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    arrivals.append(time.perf_counter() - start)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return arrivals[0], arrivals, tokens

    async def close(self) -> None:
        await self.client.close()
        if self.session is not None:
            await self.session.close()

    async def round(self, path: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
        gate = asyncio.Semaphore(concurrency)
        calls = {
            "grpc_direct": self.direct,
            "openai_front_door": self.front_door,
            "http_front_door": self.http_front_door,
            "http_front_door_engine": partial(self.http_front_door, url=self.engine_url),
        }
        call = calls[path]

        async def one(prompt: str) -> tuple[float, list[float], int]:
            async with gate:
                return await call(prompt, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
        ttfts = [r[0] for r in results]
        itls = [(r[1][-1] - r[1][0]) / (len(r[1]) - 1) for r in results if len(r[1]) > 1]
        tokens = sum(r[2] for r in results)
        assert tokens == max_tokens * len(prompts), f"{path}: {tokens} tokens"
        return {
            "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
            "ttft_p95_ms": 1000 * percentile(ttfts, 0.95),
            "itl_p50_ms": 1000 * statistics.median(itls),
            "tokens_per_s": tokens / wall,
        }


def summarize(rounds: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the front door at {url} is not healthy after {timeout_s}s")


def run_aiperf(
    aiperf: str, args: argparse.Namespace, url: str, model: str, model_dir: str, out: Path
) -> dict:
    """aiperf against the front door: chat, streaming; returns its TTFT/ITL/throughput summary."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", model_dir, "--synthetic-input-tokens-mean", str(args.prompt_tokens),
        "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.max_tokens),
        "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--concurrency",
        str(args.concurrency), "--request-rate", "100", "--warmup-request-rate", "100", "--arrival-pattern",
        "constant", "--request-count", str(args.aiperf_requests), "--warmup-request-count",
        str(args.concurrency), "--random-seed", "1", "--artifact-dir", str(out), "--ui-type", "none",
    ]  # fmt: skip
    # The request rate only paces the polling for a free slot: with --concurrency alone aiperf 0.13 polls
    # with zero sleep and its timing process takes a whole core, starving the server on a small machine.
    # At 100/s the --concurrency cap still binds (a request lasts seconds) and a freed slot refills in
    # <= 10 ms. A local --tokenizer path loads without the hub (aiperf's offline mode looks in the hub cache).
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(cmd, check=True, timeout=1800)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - start
    export = next(out.rglob("profile_export_aiperf.json"))
    data = json.loads(export.read_text())

    def stat(name: str, key: str) -> float:
        return float(data[name][key])

    return {
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p95_ms": stat("time_to_first_token", "p95"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "tokens_per_s": stat("output_token_throughput", "avg"),
        "aiperf_cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        "aiperf_wall_s": wall,
    }


def run_loadtest(
    loadtest: str, args: argparse.Namespace, http_url: str, grpc_url: str, model_dir: str, out: Path
) -> dict:
    """`tritonllm-loadtest` (Locust) straight to `tensorrt_llm_bls` over gRPC streams on the same server:
    `--concurrency` closed-loop users for `--loadtest-seconds`, prompts of `--prompt-tokens` model tokens,
    exactly `--max-tokens` output tokens. Its ITL percentiles are over every token gap."""
    cmd = [
        loadtest, "run", "--host", http_url, "--out", str(out), "--metrics-port", "0", "--run-timeout",
        str(args.loadtest_seconds + 300), "--llm-transport", "grpc-stream", "--llm-grpc-host", grpc_url,
        "--llm-model", "tensorrt_llm_bls", "--llm-tokenizer", model_dir, "--llm-shape", "constant",
        "--llm-users", str(args.concurrency), "--llm-spawn-rate", str(args.concurrency), "--llm-duration",
        str(args.loadtest_seconds), "--llm-input-tokens", f"fixed:{args.prompt_tokens}", "--llm-max-tokens",
        f"fixed:{args.max_tokens}",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=args.loadtest_seconds + 600)
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    keys = ("ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms")
    return {k: float(metrics[k]) for k in keys} | {"tokens_per_s": float(metrics["output_tokens_per_s"])}


def cpu_description() -> str:
    model, flags = platform.processor() or "unknown", []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "fma", "amx"))]
            break
    return f"{model}, {os.cpu_count()} cores, flags {' '.join(sorted(set(flags)))}"


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def benchmark(
    args: argparse.Namespace,
    encoder: PromptEncoder,
    server: TritonServer,
    http_url: str,
    front_doors: dict[str, FrontDoorProcess],
) -> dict:
    """The interleaved rounds, then (with --aiperf) aiperf and a direct run right after it.

    The front door's own CPU time per request (its process's user + system time over a round) is its
    cost independent of machine load; the server's (tritonserver and its model stubs, engine included)
    per output token shows what each path costs the machine that serves it.
    """
    model = Path(encoder.tokenizer.name_or_path).name
    grpc_url = server.grpc_url
    backend = TritonBackend(grpc_url, "tensorrt_llm_bls", 10.0, 1.0)  # on this event loop
    bls_door, engine_door = (front_doors[p].url for p in ("tensorrt_llm_bls", "tensorrt_llm"))
    runner = Runner(backend, bls_door, engine_door, RequestTranslator(encoder, None, model), model)
    pids = {name: door.process.pid for name, door in front_doors.items() if door.process is not None}
    door_pids = {path: pids["tensorrt_llm_bls"] for path in FRONT_DOOR_PATHS}
    door_pids["http_front_door_engine"] = pids["tensorrt_llm"]
    assert server.process is not None
    server_pids = [server.process.pid, *server.stub_pids().values()]
    per_path: dict[str, list[dict]] = {p: [] for p in PATHS}
    for path in PATHS:  # warm-up: the kernel, the channels, the front door's first request
        await runner.round(
            path, make_prompts(encoder, args.concurrency, 16, f"warm-{path}"), 4, args.concurrency
        )
    for r in range(args.rounds):
        order = PATHS[r % len(PATHS) :] + PATHS[: r % len(PATHS)]
        for path in order:
            prompts = make_prompts(encoder, args.requests, args.prompt_tokens, f"{r}-{path}")
            door_before = cpu_seconds(door_pids[path]) if path in door_pids else 0.0
            server_before = sum(cpu_seconds(pid) for pid in server_pids)
            result = await runner.round(path, prompts, args.max_tokens, args.concurrency)
            server_s = sum(cpu_seconds(pid) for pid in server_pids) - server_before
            result["server_cpu_ms_per_token"] = 1000 * server_s / (len(prompts) * args.max_tokens)
            if path in door_pids:
                door_s = cpu_seconds(door_pids[path]) - door_before
                result["cpu_ms_per_request"] = 1000 * door_s / len(prompts)
            per_path[path].append(result)
            print(f"round {r} {path}: {json.dumps({k: round(v, 2) for k, v in result.items()})}", flush=True)
    results = {path: summarize(rounds) for path, rounds in per_path.items()}
    for path in FRONT_DOOR_PATHS:  # paired by round: the two ran within seconds of each other
        results[path]["ttft_p50_ratio_by_round"] = statistics.median(
            door["ttft_p50_ms"] / direct["ttft_p50_ms"]
            for door, direct in zip(per_path[path], per_path["grpc_direct"], strict=True)
        )
    if args.aiperf:
        artifacts = Path(args.out).parent / "openai_aiperf"
        results["aiperf -> openai_front_door"] = await asyncio.to_thread(
            run_aiperf,
            args.aiperf,
            args,
            bls_door.removesuffix("/v1"),
            model,
            encoder.tokenizer.name_or_path,
            artifacts,
        )
        prompts = make_prompts(encoder, args.aiperf_requests, args.prompt_tokens, "after-aiperf")
        results["grpc_direct (after aiperf)"] = await runner.round(
            "grpc_direct", prompts, args.max_tokens, args.concurrency
        )
    if args.loadtest:
        results["tritonllm-loadtest -> tensorrt_llm_bls"] = await asyncio.to_thread(
            run_loadtest,
            args.loadtest,
            args,
            http_url,
            grpc_url,
            encoder.tokenizer.name_or_path,
            Path(args.out).parent / "openai_loadtest",
        )
    await backend.close()
    await runner.close()
    return results


def write_report(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    rows = [
        "| run | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | output tok/s | server CPU ms/token |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results["paths"].items():
        server_cpu = f"{r['server_cpu_ms_per_token']:.2f}" if "server_cpu_ms_per_token" in r else "-"
        rows.append(
            f"| {name} | {r['ttft_p50_ms']:.1f} | {r['ttft_p95_ms']:.1f} | {r['itl_p50_ms']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {server_cpu} |"
        )
    text = "\n".join(
        [
            f"{results['setup']}",
            "",
            *rows,
            "",
            *(
                f"{path}: TTFT p50 / direct {results['ttft_p50_ratio'][path]:.3f} (median of the per-round "
                f"ratios {results['paths'][path]['ttft_p50_ratio_by_round']:.3f}); front door CPU per "
                f"request {results['paths'][path]['cpu_ms_per_request']:.1f} ms"
                for path in FRONT_DOOR_PATHS
            ),
            *(
                f"{name}: aiperf's own processes used {r['aiperf_cpu_s']:.1f} CPU-s in "
                f"{r['aiperf_wall_s']:.0f} s"
                for name, r in results["paths"].items()
                if "aiperf_cpu_s" in r
            ),
        ]
    )
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=8, help="requests per path per round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quantization", default="auto", choices=("auto", *TORCH_QUANTIZATIONS))
    parser.add_argument("--dtype", default="auto", help="the engine's, as `tritonllm launch` takes it")
    parser.add_argument("--aiperf", help="path of the aiperf command (its own virtualenv)")
    parser.add_argument("--aiperf-requests", type=int, default=32)
    parser.add_argument("--loadtest", help="path of the tritonllm-loadtest command, to run it on the server")
    parser.add_argument("--loadtest-seconds", type=float, default=60.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "openai"))
    args = parser.parse_args()

    model_dir = str(model_path_or_default(args.model))
    encoder = PromptEncoder(load_tokenizer(model_dir))
    options = LaunchOptions(
        model=model_dir,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        quantization=args.quantization,  # the serving default (`tritonllm launch`), not the engine's fp32
        dtype=args.dtype,
    )
    server = TritonServer(options).start()
    front_doors = {  # through the BLS (the default) and straight into the engine model
        name: FrontDoorProcess(model_dir, server.grpc_url, "127.0.0.1", free_port(), None, name)
        for name in ("tensorrt_llm_bls", "tensorrt_llm")
    }
    try:
        server.wait_ready(600)
        for door in front_doors.values():
            door.start()
            wait_healthy(door.url.removesuffix("/v1"), 300)
        paths = asyncio.run(
            benchmark(args, encoder, server, f"http://127.0.0.1:{options.http_port}", front_doors)
        )
        results: dict = {"paths": paths}
        direct_ms = paths["grpc_direct"]["ttft_p50_ms"]
        results["ttft_p50_ratio"] = {p: paths[p]["ttft_p50_ms"] / direct_ms for p in FRONT_DOOR_PATHS}
        load = os.getloadavg()[0]
        results["setup"] = (
            f"{Path(model_dir).name} (quantization {args.quantization}, dtype {args.dtype}), {args.rounds} "
            f"rounds x {args.requests} requests per path, concurrency "
            f"{args.concurrency}, {args.prompt_tokens}-token prompts, {args.max_tokens} output tokens; CPU "
            f"{cpu_description()}; load average at the end {load:.1f}"
        )
        write_report(results, Path(args.out))
    finally:
        for door in front_doors.values():
            door.stop()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
