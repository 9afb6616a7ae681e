"""The OpenAI front door's own CPU cost per request, without an engine: A/B between source trees.

A fake Triton (a gRPC server in a child process speaking Triton's protocol for `tensorrt_llm_bls`:
metadata, readiness, `ModelStreamInfer` answering each request with `--tokens` one-token responses,
`--step-ms` apart) stands in for the engine, so the only real work measured is the front door's:
HTTP, JSON, validation, the chat template and tokenization, the gRPC request and responses, SSE, metrics.
One `tritonllm openai` process per `--src` tree (its `PYTHONPATH`), all on the same fake Triton; the
official `openai` client sends streamed requests one at a time with a fresh prompt each (no cache
hits), trees alternate round by round. Reported per tree: the front door process's CPU time (user +
system, all its threads) per request, median over rounds, and the client's TTFT p50 (the fake Triton
answers at once, so TTFT is the serving path itself; on a shared machine it moves with load, the CPU
time much less). `--direct` adds the same requests over gRPC straight to the fake Triton (the front
door's own `TritonBackend`, in this process) as the TTFT floor.

    .venv/bin/python benchmarks/bench_front_door_cpu.py --src /tmp/base/src --src src --rounds 7
    .venv/bin/python benchmarks/bench_front_door_cpu.py --src src --profile /tmp/fd.txt   # py-spy, raw stacks
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from bench_openai import cpu_seconds, free_port, wait_healthy  # noqa: E402

MODEL_INPUTS = {
    "text_input": "BYTES", "max_tokens": "INT32", "stop_words": "BYTES", "exclude_input_in_output": "BOOL",
    "top_k": "INT32", "top_p": "FP32", "temperature": "FP32", "repetition_penalty": "FP32",
    "min_tokens": "INT32", "presence_penalty": "FP32", "frequency_penalty": "FP32", "seed": "UINT64",
    "return_log_probs": "BOOL", "stream": "BOOL", "guided_decoding_guide_type": "BYTES",
    "guided_decoding_guide": "BYTES", "return_num_output_tokens": "BOOL", "priority": "INT32",
}  # fmt: skip
MODEL_OUTPUTS = {
    "text_output": "BYTES", "cum_log_probs": "FP32", "output_log_probs": "FP32", "finish_reason": "BYTES",
    "num_output_tokens": "UINT32",
}  # fmt: skip


# The fake Triton.


def serve_fake_triton(port: int, tokens: int, step_ms: float) -> None:
    import grpc
    import numpy as np
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    def raw_bytes(text: str) -> bytes:
        data = text.encode()
        return len(data).to_bytes(4, "little") + data

    def response(request_id: str, text: str, reason: str) -> service_pb2.ModelStreamInferResponse:
        tensor = service_pb2.ModelInferResponse.InferOutputTensor
        outputs = [
            tensor(name="text_output", datatype="BYTES", shape=[1]),
            tensor(name="num_output_tokens", datatype="UINT32", shape=[1]),
            tensor(name="finish_reason", datatype="BYTES", shape=[1]),
        ]
        raw = [raw_bytes(text), np.array([1], dtype=np.uint32).tobytes(), raw_bytes(reason)]
        infer = service_pb2.ModelInferResponse(
            model_name="tensorrt_llm_bls", id=request_id, outputs=outputs, raw_output_contents=raw
        )
        return service_pb2.ModelStreamInferResponse(infer_response=infer)

    class Fake(service_pb2_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request, context):
            return service_pb2.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return service_pb2.ServerReadyResponse(ready=True)

        async def ModelReady(self, request, context):
            return service_pb2.ModelReadyResponse(ready=True)

        async def ModelMetadata(self, request, context):
            tensor = service_pb2.ModelMetadataResponse.TensorMetadata
            return service_pb2.ModelMetadataResponse(
                name=request.name,
                versions=["1"],
                platform="python",
                inputs=[tensor(name=n, datatype=t, shape=[-1]) for n, t in MODEL_INPUTS.items()],
                outputs=[tensor(name=n, datatype=t, shape=[-1]) for n, t in MODEL_OUTPUTS.items()],
            )

        async def ModelStreamInfer(self, request_iterator, context):
            async for request in request_iterator:
                for i in range(tokens):
                    if step_ms and i:
                        await asyncio.sleep(step_ms / 1000)
                    yield response(request.id, f" w{i}", "length" if i == tokens - 1 else "")

    async def main() -> None:
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Fake(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("fake triton ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


# The runs.


def door_ttft(url: str) -> tuple[float, float]:
    """The front door's own TTFT histogram (request received -> first token from Triton): sum, count."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("tritonllm_openai_time_to_first_token_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("tritonllm_openai_time_to_first_token_seconds_count"):
            count += float(line.split()[-1])
    return total, count


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per thread name of a process (threads of one name summed; the main
    thread as "main")."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        if task.name == str(pid):
            name = "main"  # the event loop's thread (grpc's completion-queue poller is also "python")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def make_prompts(tokenizer, n: int, tokens: int, rng: random.Random) -> list[str]:
    low, high = 1000, len(tokenizer) - 1000
    return [tokenizer.decode([rng.randrange(low, high) for _ in range(tokens)]) for _ in range(n)]


def one_request(client, endpoint: str, prompt: str, max_tokens: int) -> float:
    """One streamed request (as bench_openai sends them); returns its TTFT in seconds."""
    start = time.perf_counter()
    first = None
    if endpoint == "chat":
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
    else:
        stream = client.completions.create(
            model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - start
    assert first is not None
    return first


def direct_ttfts(grpc_url: str, model_dir: str, prompts: list[str], max_tokens: int) -> list[float]:
    from tritonllm.openai.protocol import PromptEncoder, RequestTranslator
    from tritonllm.openai.triton import TritonBackend
    from tritonllm.tokenization import load_tokenizer

    translator = RequestTranslator(PromptEncoder(load_tokenizer(model_dir)), None, "m")

    async def run() -> list[float]:
        backend = TritonBackend(grpc_url, "tensorrt_llm_bls", 10.0, 1.0)
        out = []
        for prompt in prompts:
            inputs = translator.completion({"model": "m", "prompt": prompt, "max_tokens": max_tokens}).inputs
            start = time.perf_counter()
            async for piece in backend.generate(inputs, 1, uuid.uuid4().hex):
                out.append(piece.received_s - start)
                break
        await backend.close()
        return out

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--src", action="append", help="a source tree's src/ folder (repeat for A/B)")
    parser.add_argument("--model", help="tokenizer folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--requests", type=int, default=40, help="per tree per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16, help="responses (one token each) per request")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=0.0, help="fake decode step between responses")
    parser.add_argument("--direct", action="store_true", help="also time gRPC straight to the fake Triton")
    parser.add_argument("--profile", help="py-spy raw stacks of the (first) front door to this file")
    parser.add_argument("--cprofile", help="cProfile stats of the (first) front door to this file")
    parser.add_argument("--serve-fake-triton", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake_triton:
        serve_fake_triton(args.serve_fake_triton, args.tokens, args.step_ms)
        return 0

    import openai

    from tritonllm.default_model import model_path_or_default
    from tritonllm.tokenization import load_tokenizer

    model_dir = str(model_path_or_default(args.model))
    trees = [str(Path(s).resolve()) for s in (args.src or ["src"])]
    grpc_port = free_port()
    fake_cmd = [sys.executable, __file__, "--serve-fake-triton", str(grpc_port), "--tokens", str(args.tokens),
                "--step-ms", str(args.step_ms)]  # fmt: skip
    fake = subprocess.Popen(fake_cmd, stdout=subprocess.PIPE, text=True)
    assert fake.stdout is not None and "ready" in fake.stdout.readline()
    doors: list[tuple[str, subprocess.Popen, str]] = []
    try:
        for i, tree in enumerate(trees):
            port = free_port()
            triton = f"127.0.0.1:{grpc_port}"
            cmd = [sys.executable, "-m", "tritonllm.cli", "openai", "--model", model_dir,
                   "--served-model-name", "m", "--triton-url", triton, "--port", str(port)]  # fmt: skip
            if args.cprofile and i == 0:
                cmd = [sys.executable, "-m", "cProfile", "-o", args.cprofile, *cmd[1:]]
            if args.profile and i == 0:
                spy = str(Path(sys.executable).with_name("py-spy"))
                cmd = [spy, "record", "--nonblocking", "--format", "raw", "--rate", "200", "-o", args.profile,
                       "--", *cmd]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": tree}
            doors.append(
                (tree, subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}")
            )
        pids = {}
        for tree, process, url in doors:
            wait_healthy(url, 120)
            pid = process.pid
            if args.profile and tree == doors[0][0]:  # py-spy's child is the front door
                pid = psutil.Process(pid).children()[0].pid
            pids[tree] = pid
        tokenizer = load_tokenizer(model_dir)
        rng = random.Random(1)
        clients = {
            tree: openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) for tree, _, url in doors
        }
        for tree in trees:  # warm up: first-call costs (imports, template compile, gRPC channel)
            for prompt in make_prompts(tokenizer, 10, args.prompt_tokens, rng):
                one_request(clients[tree], args.endpoint, prompt, args.tokens)
        cpu: dict[str, list[float]] = {t: [] for t in trees}
        ttft: dict[str, list[float]] = {t: [] for t in trees}
        direct: list[float] = []
        threads: dict[str, dict[str, float]] = {t: {} for t in trees}
        urls = {tree: url for tree, _, url in doors}
        inside = {tree: door_ttft(urls[tree]) for tree in trees}
        for r in range(args.rounds):
            order = trees[r % len(trees) :] + trees[: r % len(trees)]
            for tree in order:
                prompts = make_prompts(tokenizer, args.requests, args.prompt_tokens, rng)
                before, by_thread = cpu_seconds(pids[tree]), thread_seconds(pids[tree])
                times = [one_request(clients[tree], args.endpoint, p, args.tokens) for p in prompts]
                cpu[tree].append(1000 * (cpu_seconds(pids[tree]) - before) / args.requests)
                for name, seconds in thread_seconds(pids[tree]).items():
                    spent = 1000 * (seconds - by_thread.get(name, 0.0)) / args.requests
                    threads[tree][name] = threads[tree].get(name, 0.0) + spent / args.rounds
                ttft[tree].append(1000 * statistics.median(times))
            if args.direct:
                prompts = make_prompts(tokenizer, args.requests, args.prompt_tokens, rng)
                direct.append(
                    1000
                    * statistics.median(
                        direct_ttfts(f"127.0.0.1:{grpc_port}", model_dir, prompts, args.tokens)
                    )
                )
        print(f"{args.endpoint}, {args.tokens} tokens, {args.prompt_tokens}-token prompts, "
              f"{args.rounds} rounds x {args.requests} requests, load {os.getloadavg()[0]:.1f}")  # fmt: skip
        for tree in trees:
            rounds = " ".join(f"{c:.2f}" for c in cpu[tree])
            print(f"{tree}: CPU {statistics.median(cpu[tree]):.2f} ms/request (rounds: {rounds}); "
                  f"TTFT p50 {statistics.median(ttft[tree]):.2f} ms")  # fmt: skip
            total, count = door_ttft(urls[tree])
            mean = 1000 * (total - inside[tree][0]) / max(1.0, count - inside[tree][1])
            print(
                f"  inside the front door (request received -> first token from Triton): mean {mean:.2f} ms"
            )
            busy = sorted(threads[tree].items(), key=lambda kv: -kv[1])
            print(
                "  by thread (mean ms/request): " + ", ".join(f"{n} {ms:.2f}" for n, ms in busy if ms >= 0.05)
            )
        if direct:
            print(f"gRPC straight to the fake Triton: TTFT p50 {statistics.median(direct):.2f} ms")
    finally:
        for _, process, _ in doors:
            if (args.profile or args.cprofile) and process is doors[0][1]:
                process.send_signal(signal.SIGINT)  # py-spy writes its file, then stops the front door
            else:
                process.terminate()
            process.wait(60)
        fake.terminate()
        fake.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
