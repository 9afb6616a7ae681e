"""Soak: a few hundred to a few thousand random requests against a real server, then the invariants.

The mix: streaming and not, over gRPC streams and HTTP `/generate`, through `tensorrt_llm_bls`,
`ensemble` and `tensorrt_llm`; client cancels mid-stream, HTTP clients that disconnect, requests with a
tight client timeout, bad inputs, stop words and three priority tiers. Checked at the end:

- every request got exactly one final response (an error counts as the final one) or, for cancels and
  disconnects, nothing after the cancel;
- KV blocks in use return to 0 and no request is left running or waiting;
- the resident memory of the `tensorrt_llm` stub after the run is within 10% (+20 MB) of the level after
  the first tenth of the requests.

    .venv/bin/python benchmarks/soak_serving.py --requests 500 --concurrency 16
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import re
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests
import tritonclient.grpc as grpcclient

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving_paths import free_ports, tensor  # noqa: E402

from tritonllm.default_model import model_path_or_default  # noqa: E402
from tritonllm.precision import DTYPES, ENGINE_QUANTIZATIONS  # noqa: E402
from tritonllm.triton.launcher import LaunchOptions, TritonServer  # noqa: E402

TIMEOUT_S = 300.0
WORDS = ["The quick brown fox", "Once upon a time", "Paged attention", "A lighthouse keeper", "Il était"]


def metric(url: str, name: str) -> float:
    text = requests.get(url, timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def stub_rss_mb() -> float:
    """Resident memory of the tensorrt_llm stub (its command line names the model's folder)."""
    for status in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = status.read_bytes()
        except OSError:
            continue
        if b"triton_python_backend_stub" in cmd and b"/tensorrt_llm/1/model.py" in cmd:
            text = (status.parent / "status").read_text()
            return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024
    raise RuntimeError("no tensorrt_llm stub found")


UINT64_INPUTS = frozenset({"seed", "random_seed"})  # as NVIDIA's configs declare them


def grpc_request(url: str, model: str, body: dict, cancel_after: int | None) -> str:
    """One gRPC stream; returns the outcome: ok, error, cancelled; raises on a protocol violation."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = []
    for name, value in body.items():
        if isinstance(value, str):
            arr = np.array([[value.encode()]], dtype=object)
        elif isinstance(value, list) and value and isinstance(value[0], str):
            arr = np.array([[v.encode() for v in value]], dtype=object)
        elif isinstance(value, list):
            arr = np.array([value], dtype=np.int32)
        elif isinstance(value, bool):
            arr = np.array([[value]], dtype=bool)
        elif isinstance(value, float):
            arr = np.array([[value]], dtype=np.float32)
        elif name in UINT64_INPUTS:
            arr = np.array([[value]], dtype=np.uint64)
        else:
            arr = np.array([[value]], dtype=np.int32)
        inputs.append(tensor(name, arr))
    client.async_stream_infer(model, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True)
    finals, data, outcome = 0, 0, "ok"
    try:
        while True:
            result, error = results.get(timeout=TIMEOUT_S)
            if error is not None:
                finals += 1
                outcome = "error"
                break
            if result.get_response().outputs:
                data += 1
            if result.get_response().parameters["triton_final_response"].bool_param:
                finals += 1
                break
            if cancel_after is not None and data >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return "cancelled"
    finally:
        client.close()
    if finals != 1:
        raise AssertionError(f"{finals} final responses")
    return outcome


def http_request(base: str, model: str, body: dict, disconnect: bool, timeout_s: float | None) -> str:
    if disconnect:
        with requests.post(
            f"{base}/v2/models/{model}/generate_stream",
            json={**body, "stream": True},
            stream=True,
            timeout=60,
        ) as response:
            next(response.iter_lines(), None)
        return "disconnected"
    try:
        reply = requests.post(f"{base}/v2/models/{model}/generate", json=body, timeout=timeout_s or TIMEOUT_S)
    except requests.Timeout:
        return "client_timeout"
    return "ok" if reply.status_code == 200 else "error"


def one(server: TritonServer, rng: random.Random) -> str:
    kind = rng.choices(
        ["grpc", "grpc_cancel", "http", "http_disconnect", "http_timeout", "bad", "engine"],
        [30, 10, 25, 8, 5, 7, 15],
    )[0]
    model = rng.choice(["tensorrt_llm_bls", "ensemble"])
    max_tokens = rng.randint(1, 24)
    body: dict = {
        "text_input": f"{rng.choice(WORDS)} {rng.randint(0, 10**6)}",
        "max_tokens": max_tokens,
        "priority": rng.choice([0, 1, 2]),
        "exclude_input_in_output": True,
    }
    if rng.random() < 0.2:
        body["stop_words"] = [" the", "."]
    if rng.random() < 0.3:
        body |= {"temperature": 0.8, "top_k": 40, "seed": rng.randint(0, 1000)}
    base = f"http://{server.http_url}"
    if kind == "grpc":
        return grpc_request(server.grpc_url, model, {**body, "stream": rng.random() < 0.6}, None)
    if kind == "grpc_cancel":
        body |= {"max_tokens": 200, "min_tokens": 200, "stream": True}
        return grpc_request(server.grpc_url, "tensorrt_llm_bls", body, rng.randint(1, 3))
    if kind == "http":
        return http_request(base, model, body, False, None)
    if kind == "http_disconnect":
        body |= {"max_tokens": 200, "min_tokens": 200}
        return http_request(base, "tensorrt_llm_bls", body, True, None)
    if kind == "http_timeout":
        body |= {"max_tokens": 200, "min_tokens": 200}
        return http_request(base, "tensorrt_llm_bls", body, False, 0.2)
    if kind == "bad":
        name, value = rng.choice([("top_p", 5.0), ("temperature", -1.0), ("max_tokens", 0)])
        return "bad_" + grpc_request(server.grpc_url, model, {**body, name: value}, None)
    ids = [rng.randint(10, 20000) for _ in range(rng.randint(1, 64))]
    engine_body = {
        "input_ids": ids,
        "input_lengths": len(ids),
        "request_output_len": max_tokens,
        "streaming": rng.random() < 0.5,
        "priority": rng.choice([0, 1, 2]),
    }
    return grpc_request(server.grpc_url, "tensorrt_llm", engine_body, None)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF checkpoint or engine directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    same = "as `tritonllm launch` (default: auto)"
    parser.add_argument("--quantization", default="auto", choices=ENGINE_QUANTIZATIONS, help=same)
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help=same)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    http, grpc, metrics = free_ports(3)
    options = LaunchOptions(
        model=model_path_or_default(args.model),
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        num_threads=args.threads,
        max_num_seqs=16,
        quantization=args.quantization,
        dtype=args.dtype,
    )
    outcomes: Counter[str] = Counter()
    violations: list[str] = []
    lock = threading.Lock()
    with TritonServer(options) as server:
        server.wait_ready(600)
        warmup = max(1, args.requests // 10)
        rss: dict[str, float] = {}
        started = time.perf_counter()

        def run(i: int) -> None:
            try:
                outcome = one(server, random.Random(f"{args.seed}:{i}"))
            except Exception as exc:  # a protocol violation or a hang
                with lock:
                    violations.append(f"request {i}: {exc!r}")
                return
            with lock:
                outcomes[outcome] += 1
                done = sum(outcomes.values())
                if done == warmup:
                    rss["after_warmup_mb"] = stub_rss_mb()
                if done % warmup == 0:  # progress every tenth
                    print(f"{done}/{args.requests} requests, {time.perf_counter() - started:.0f} s, "
                          f"{len(violations)} violations", file=sys.stderr, flush=True)  # fmt: skip

        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(run, range(args.requests)))
        elapsed = time.perf_counter() - started
        drained = all(
            _wait(lambda name=name: metric(server.metrics_url, name) == 0, 60)
            for name in (
                "tritonllm_kv_cache_blocks_used",
                "tritonllm_num_requests_running",
                "tritonllm_num_requests_waiting",
            )
        )
        rss["end_mb"] = stub_rss_mb()
        counters = {
            name: metric(server.metrics_url, name)
            for name in (
                "tritonllm_requests_finished_total",
                "tritonllm_requests_rejected_total",
                "tritonllm_generation_tokens_total",
                "tritonllm_preemptions_total",
            )
        }
    rss_ok = rss["end_mb"] <= rss.get("after_warmup_mb", rss["end_mb"]) * 1.10 + 20
    summary = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "elapsed_s": round(elapsed, 1),
        "outcomes": dict(outcomes),
        "violations": violations,
        "kv_blocks_and_queues_back_to_0": drained,
        "stub_rss_mb": rss,
        "rss_flat": rss_ok,
        "counters": counters,
    }
    print(json.dumps(summary, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak_serving.json").write_text(json.dumps(summary, indent=2))
    return 0 if drained and rss_ok and not violations else 1


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return predicate()


if __name__ == "__main__":
    sys.exit(main())
