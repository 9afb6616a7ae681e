"""What serving through Triton costs against the engine in-process, at batch 1 and 32 (issue 11 part 4).

Side by side in one script: the same token-id requests (greedy, `min_tokens = max_tokens`, fresh
prompts every run so the prefix cache helps neither side) go to a `ServingEngine` in this process and,
over one gRPC stream each, to `tensorrt_llm` of a `tritonllm launch` server on the same model and
engine settings. The two alternate run by run (order rotated every round) and only one is busy at a
time. Reported per batch size: median output tokens/s of each and the Triton/in-process ratio (the
target: >= 0.95), and the CPU each process spent per generated token (this client, `tritonserver`, the
`tensorrt_llm` stub with the engine, the other stubs; the engine's process also split by OS thread name
into the engine's threads and the response sender, each with its runqueue wait from schedstat): on a
machine whose cores the engine's threads already fill, every millisecond of it slows the engine.
Writes `results/triton_cost.json`.

Streamed by default (a response per token, as interactive clients ask); `--no-streaming` asks for one
response per request holding every token (offline and batch clients), written to
`results/triton_cost_unstreamed.json`; `--stream-interval N` serves with the first token alone, then N
tokens a response (`results/triton_cost_intervalN.json`). `--client-nice 19` runs the client at the lowest
priority, so that it takes only CPU the server and the engine leave: a stand-in, on a machine with no
spare core, for a client on another machine (Triton's own cost rather than Triton's plus the client's).

The client (`--client lean`, the default) is raw gRPC that asks for `output_ids` and `sequence_length`
only, as NVIDIA's client scripts do; `--client tritonclient` reads every output through `tritonclient`,
which costs this process about 0.7 ms of CPU per token on the 2-core machine of the README.

    .venv/bin/python benchmarks/bench_triton_cost.py --rounds 3
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving_paths import add_engine_arguments, inputs_for, loopback_options  # noqa: E402

from tritonllm.default_model import model_path_or_default  # noqa: E402
from tritonllm.engine import EngineConfig, SamplingParams  # noqa: E402
from tritonllm.engine.serving import ServingEngine  # noqa: E402
from tritonllm.model.cpu_kernels import cpu_flags  # noqa: E402
from tritonllm.os_threads import KERNEL_WORKER_NAME, OS_NAME_BYTES  # noqa: E402
from tritonllm.triton.launcher import TritonServer  # noqa: E402

TIMEOUT_S = 600.0
LEAN_OUTPUTS = ("output_ids", "sequence_length")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def read_stat(path: str) -> tuple[str, float]:
    """(name, user + system CPU seconds) from a /proc `stat` file: a process's or one thread's."""
    with open(path) as f:
        text = f.read()
    fields = text.rsplit(")", 1)[1].split()
    return text[text.index("(") + 1 : text.rindex(")")], (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a process, all its threads (ended ones too)."""
    return read_stat(f"/proc/{pid}/stat")[1]


# OS thread names (`tritonllm.os_threads`, cut to the kernel's length): the engine loop with the OpenMP
# workers it started and the CPU kernels' workers, and the bridge's response sender; a stub's other threads
# (IPC) are the rest of its CPU.
THREAD_GROUPS = {
    "engine": ("tritonllm-engine"[:OS_NAME_BYTES], KERNEL_WORKER_NAME),
    "sender": ("tritonllm-send"[:OS_NAME_BYTES],),
}


def thread_group_sched_s(pid: int) -> dict[str, float]:
    """Per THREAD_GROUPS name, over a process's live threads: CPU seconds (`<group>`) and seconds spent
    runnable but waiting for a core (`<group>_wait`), from `/proc/<pid>/task/<tid>/schedstat` (ns)."""
    spent = {k: 0.0 for g in THREAD_GROUPS for k in (g, f"{g}_wait")}
    for task in glob.glob(f"/proc/{pid}/task/[0-9]*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().rstrip("\n")
            with open(f"{task}/schedstat") as f:
                run_ns, wait_ns, _ = (int(v) for v in f.read().split())
        except (OSError, ValueError):  # the thread ended
            continue
        for group, os_names in THREAD_GROUPS.items():
            if name in os_names:
                spent[group] += run_ns / 1e9
                spent[f"{group}_wait"] += wait_ns / 1e9
    return spent


class CpuMeter:
    """CPU seconds spent by this client, tritonserver and each stub between two readings.

    The engine's own processes (this one in-process, the `tensorrt_llm` stub through Triton) are also
    split by thread: `*.engine` (loop + OpenMP) and `*.sender` (the stub's response sender), each with
    `*_wait`, the time its threads were runnable but had no core: on a machine the engine's threads fill,
    every other process's CPU shows up there (and the engine's threads wait for each other at barriers).
    """

    def __init__(self, server: TritonServer):
        assert server.process is not None
        self.pids = {"tritonserver": server.process.pid} | server.stub_pids()

    def read(self) -> dict[str, float]:
        readings = {"client": time.process_time()} | {k: process_cpu_s(p) for k, p in self.pids.items()}
        for role, pid in (("client", os.getpid()), ("tensorrt_llm", self.pids["tensorrt_llm"])):
            readings |= {f"{role}.{g}": s for g, s in thread_group_sched_s(pid).items()}
        return readings

    def per_token_ms(self, before: dict[str, float], tokens: float) -> dict[str, float]:
        after = self.read()
        roles = ("client", "tritonserver", "tensorrt_llm")
        stubs = sum(after[k] - before[k] for k in after if "." not in k and k not in roles)
        spent = {k: after[k] - before[k] for k in after if k in roles or "." in k}
        return {k: round(v / tokens * 1e3, 3) for k, v in (spent | {"other_stubs": stubs}).items()}


def prompts(batch: int, run: int, length: int) -> list[list[int]]:
    """Distinct prompts per run and request (no prefix-cache hits across runs)."""
    rng = np.random.default_rng(run)
    return [rng.integers(100, 20000, size=length).tolist() for _ in range(batch)]


@dataclass
class Run:
    """Output tokens/s over all streams; per stream, the time to first token and the rate after it."""

    tok_s: float
    ttft_s: list[float]
    decode_tok_s: list[float]

    @classmethod
    def of(cls, tokens: int, seconds: float, streams: list[tuple[float, float, float, int]]) -> Run:
        """From each stream's (sent, first token, last token) times in seconds and its token count."""
        ttft = [first - sent for sent, first, _, _ in streams]
        rate = [(n - 1) / (last - first) if last > first else float("nan") for _, first, last, n in streams]
        return cls(tokens / seconds, ttft, rate)


def in_process(engine: ServingEngine, batch_prompts: list[list[int]], max_tokens: int, tag: str) -> Run:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, top_k=1)
    started = time.perf_counter()
    streams = [engine.submit(f"{tag}-{i}", p, params) for i, p in enumerate(batch_prompts)]
    done = [s.result(TIMEOUT_S) for s in streams]
    seconds = time.perf_counter() - started
    streams = [
        (c.final.arrival_time_ns / 1e9, c.final.first_token_time_ns / 1e9, c.final.last_token_time_ns / 1e9,
         len(c.token_ids))
        for c in done
    ]  # fmt: skip
    return Run.of(sum(len(c.token_ids) for c in done), seconds, streams)


def concurrently(one: Callable[[int, list[int]], None], batch_prompts: list[list[int]]) -> float:
    """Run `one(i, prompt)` for every prompt at once, one thread each; the seconds it took."""
    started = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(batch_prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    return time.perf_counter() - started


class StreamClock:
    """Per stream: tokens received, and when the request went out and its first and last tokens came."""

    def __init__(self, n: int):
        self.counts = [0] * n
        self.started = [0.0] * n
        self.first = [0.0] * n
        self.last = [0.0] * n

    def received(self, i: int, tokens: int) -> None:
        now = time.perf_counter()
        if not self.counts[i]:
            self.first[i] = now
        self.counts[i] += tokens
        self.last[i] = now

    def run(self, seconds: float) -> Run:
        streams = list(zip(self.started, self.first, self.last, self.counts, strict=True))
        return Run.of(sum(self.counts), seconds, streams)


def through_triton(url: str, batch_prompts: list[list[int]], max_tokens: int, streaming: bool) -> Run:
    """Output tokens/s with `tritonclient`'s stream per request, reading every output it sends."""
    clock = StreamClock(len(batch_prompts))

    def one(i: int, prompt: list[int]) -> None:
        done: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(url)
        client.start_stream(callback=lambda result, error: done.put((result, error)))
        clock.started[i] = time.perf_counter()
        client.async_stream_infer(
            "tensorrt_llm",
            inputs_for("tensorrt_llm", prompt, max_tokens, streaming),
            enable_empty_final_response=True,
        )
        while True:
            result, error = done.get(timeout=TIMEOUT_S)
            if error is not None:
                raise RuntimeError(error)
            if result.get_output("output_ids") is not None:
                clock.received(i, int(result.as_numpy("sequence_length")[0][0]))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
        client.close()

    return clock.run(concurrently(one, batch_prompts))


def niced(nice: int, run: Callable[..., Run]) -> Callable[..., Run]:
    """`run` in a new thread whose nice value is raised by `nice` first (Linux: per thread; the client's
    threads and gRPC's, started from it, inherit it), so the client takes only CPU the server leaves."""

    def call(*args: object) -> Run:
        outcome: list[Run | BaseException] = []

        def target() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + nice)
                outcome.append(run(*args))
            except BaseException as exc:  # re-raised in the caller
                outcome.append(exc)

        thread = threading.Thread(target=target, name="niced-client")
        thread.start()
        thread.join(TIMEOUT_S)
        if not outcome:
            raise TimeoutError(f"the client did not finish in {TIMEOUT_S} s")
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    return call


def lean_request(prompt: list[int], max_tokens: int, streaming: bool) -> service_pb2.ModelInferRequest:
    """The request of `through_triton`, built straight as protobuf, asking for two outputs only."""
    request = service_pb2.ModelInferRequest(model_name="tensorrt_llm")
    for t in inputs_for("tensorrt_llm", prompt, max_tokens, streaming):
        value = t._get_content()  # noqa: SLF001 -- the raw bytes tritonclient would send
        request.inputs.append(
            service_pb2.ModelInferRequest.InferInputTensor(
                name=t.name(), datatype=t.datatype(), shape=t.shape()
            )
        )
        request.raw_input_contents.append(value)
    request.outputs.extend(
        service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=n) for n in LEAN_OUTPUTS
    )
    return request


def through_triton_lean(url: str, batch_prompts: list[list[int]], max_tokens: int, streaming: bool) -> Run:
    """Output tokens/s with one raw gRPC stream per request, reading `sequence_length` from raw bytes."""
    clock = StreamClock(len(batch_prompts))
    with grpc.insecure_channel(url) as channel:
        stream = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer

        def one(i: int, prompt: list[int]) -> None:
            request = lean_request(prompt, max_tokens, streaming)
            clock.started[i] = time.perf_counter()
            for response in stream(iter([request]), timeout=TIMEOUT_S):
                if response.error_message:
                    raise RuntimeError(response.error_message)
                names = [o.name for o in response.infer_response.outputs]
                if "sequence_length" in names:
                    raw = response.infer_response.raw_output_contents[names.index("sequence_length")]
                    clock.received(i, int.from_bytes(raw[:4], "little", signed=True))

        return clock.run(concurrently(one, batch_prompts))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF checkpoint or engine directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_engine_arguments(parser)
    parser.add_argument("--client", default="lean", choices=("lean", "tritonclient"))
    parser.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a response per token (default) or, with --no-streaming, one per request",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the server's --stream-interval: streamed tokens a response after the first (default 1)",
    )
    parser.add_argument(
        "--client-nice",
        type=int,
        default=0,
        help="raise the client's nice value by this much (19: it gets only CPU the server and the engine "
        "leave, standing in for a client on another machine; default 0)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    model = model_path_or_default(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    options = loopback_options(args, model, stream_interval=args.stream_interval)
    config = EngineConfig(
        model=model, num_threads=args.threads, dtype=args.dtype, quantization=args.quantization
    )
    results: dict[int, dict[str, list[float]]] = {b: {"in_process": [], "triton": []} for b in batches}
    # Per run, medians over its streams: time to first token (ms) and tokens/s after the first token.
    ttft_ms: dict[int, dict[str, list[float]]] = {b: {"in_process": [], "triton": []} for b in batches}
    decode: dict[int, dict[str, list[float]]] = {b: {"in_process": [], "triton": []} for b in batches}
    cpu_ms: dict[int, dict[str, list[dict[str, float]]]] = {
        b: {"in_process": [], "triton": []} for b in batches
    }
    triton_run = through_triton_lean if args.client == "lean" else through_triton
    if args.client_nice:
        triton_run = niced(args.client_nice, triton_run)
    with TritonServer(options) as server:
        server.wait_ready(600)
        meter = CpuMeter(server)
        engine = ServingEngine(config)
        try:
            warm = prompts(1, 10**6, args.prompt_tokens)  # first steps (kernels, allocations) on both
            in_process(engine, warm, 4, "warm")
            triton_run(server.grpc_url, warm, 4, args.streaming)
            run = 0
            for r in range(args.rounds):
                for batch in batches:
                    order = ["in_process", "triton"] if (r + batch) % 2 == 0 else ["triton", "in_process"]
                    for mode in order:
                        run += 1
                        batch_prompts = prompts(batch, run, args.prompt_tokens)
                        before, started = meter.read(), time.perf_counter()
                        if mode == "in_process":
                            done = in_process(engine, batch_prompts, args.max_tokens, f"r{run}")
                        else:
                            done = triton_run(server.grpc_url, batch_prompts, args.max_tokens, args.streaming)
                        spent = meter.per_token_ms(before, done.tok_s * (time.perf_counter() - started))
                        results[batch][mode].append(done.tok_s)
                        ttft_ms[batch][mode].append(statistics.median(done.ttft_s) * 1e3)
                        decode[batch][mode].append(statistics.median(done.decode_tok_s))
                        cpu_ms[batch][mode].append(spent)
                        print(
                            f"round {r} batch {batch} {mode}: {done.tok_s:.1f} tok/s, TTFT "
                            f"{ttft_ms[batch][mode][-1]:.1f} ms, after it {decode[batch][mode][-1]:.1f} "
                            f"tok/s a stream, CPU ms/token {spent}",
                            flush=True,
                        )
        finally:
            engine.shutdown()
    summary = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": cpu_flags(),
        "dtype": args.dtype,
        "quantization": args.quantization,
        "client": args.client,
        "streaming": args.streaming,
        "stream_interval": args.stream_interval,
        "client_nice": args.client_nice,
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "runs": results,
        "ttft_ms": ttft_ms,
        "decode_tok_s_per_stream": decode,
        "cpu_ms_per_token": cpu_ms,
        "median_tok_s": {b: {m: statistics.median(v) for m, v in r.items()} for b, r in results.items()},
    }
    for batch, medians in summary["median_tok_s"].items():
        ratio = medians["triton"] / medians["in_process"]
        # A round's two runs are seconds apart: their ratio cancels the host's drift across rounds.
        by_mode = results[batch]
        paired = sorted(t / i for t, i in zip(by_mode["triton"], by_mode["in_process"], strict=True))
        summary.setdefault("triton_over_in_process", {})[batch] = ratio
        summary.setdefault("paired_ratios", {})[batch] = paired
        print(f"batch {batch}: in-process {medians['in_process']:.1f} tok/s, Triton {medians['triton']:.1f}, "
              f"ratio {ratio:.3f}; paired per round: median {statistics.median(paired):.3f} "
              f"({', '.join(f'{x:.2f}' for x in paired)})")  # fmt: skip
        for label, values, unit in (
            ("TTFT", ttft_ms, "ms"),
            ("after the first token", decode, "tok/s a stream"),
        ):
            mid = {m: statistics.median(v) for m, v in values[batch].items()}
            print(f"  {label}: in-process {mid['in_process']:.1f} {unit}, Triton {mid['triton']:.1f}, "
                  f"ratio {mid['triton'] / mid['in_process']:.3f}")  # fmt: skip
        for mode in ("in_process", "triton"):
            runs = cpu_ms[batch][mode]
            medians = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            print(f"  {mode}, CPU ms per token: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "triton_cost.json" if args.streaming else "triton_cost_unstreamed.json"
    if args.streaming and args.stream_interval > 1:
        name = f"triton_cost_interval{args.stream_interval}.json"
    if args.client_nice:
        name = name.replace(".json", f"_client_nice{args.client_nice}.json")
    (out / name).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
