"""The three servers on loopback: start, wait until ready (bounded), stream one request, stop.

Each server runs in its own process group, so `stop()` can end what it spawned (Triton and its stubs,
vLLM's engine process) and nothing else. Every request is greedy with an exact output length (EOS
ignored) and streamed; the stream functions record the arrival time and size of every chunk.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import requests

from peers.workloads import RequestResult, RequestSpec

REPO = Path(__file__).resolve().parents[2]
DTYPE_SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def log_path(log_dir: Path, label: str) -> Path:
    return log_dir / (re.sub(r"[^\w.-]+", "_", label) + ".log")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ManagedServer:
    """One server process. `label` names it in the report; `weights` is what its linears read."""

    label: str
    weights: str
    command: list[str]
    ready_url: str
    log_file: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_file.open("wb")
        self.process = subprocess.Popen(
            self.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
            cwd=REPO,
        )
        log.close()

    def wait_ready(self, timeout_s: float) -> float:
        """Poll the readiness URL once a second; fail fast when the process exits. Returns seconds taken."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"{self.label} exited during start-up; last log lines:\n{self.log_tail()}")
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(self.ready_url, timeout=5) as response,
            ):
                if response.status == 200:
                    return time.monotonic() - start
            time.sleep(1.0)
        raise TimeoutError(f"{self.label} not ready after {timeout_s:.0f} s; log: {self.log_file}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to the server, then SIGKILL to its whole process group if it does not exit in time."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # leftovers of our own group (stubs, workers)
        self.process.wait(10)
        self.process = None

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_file.read_text(errors="replace") if self.log_file.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    @contextlib.contextmanager
    def running(self, ready_timeout_s: float) -> Iterator[float]:
        self.start()
        try:
            yield self.wait_ready(ready_timeout_s)
        finally:
            self.stop()


@dataclass
class Peer:
    server: ManagedServer
    stream: Callable[[RequestSpec, RequestResult, Callable[[], float]], None]


def tritonllm(
    label: str,
    weights: str,
    model_dir: Path,
    engine_args: str,
    threads: int,
    log_dir: Path,
    timeout_s: float,
    ready_timeout_s: float,
) -> Peer:
    """`tritonllm launch` of `model_dir` (the peers' model) with the given engine options; requests go
    over gRPC into `tensorrt_llm`."""
    import tritonclient.grpc as grpcclient

    http, grpc_port, metrics = free_port(), free_port(), free_port()
    launcher = [str(REPO / ".venv/bin/tritonllm"), "launch", "--model", str(model_dir)]
    options = f"--ready-timeout {ready_timeout_s} --http-port {http} --grpc-port {grpc_port} "
    options += f"--metrics-port {metrics} --threads {threads} {engine_args}"
    ready_url = f"http://127.0.0.1:{http}/v2/models/tensorrt_llm/ready"
    server = ManagedServer(
        label, weights, launcher + shlex.split(options), ready_url, log_path(log_dir, label)
    )

    def tensor(name: str, value: np.ndarray) -> grpcclient.InferInput:
        t = grpcclient.InferInput(name, list(value.shape), "BOOL" if value.dtype == bool else "INT32")
        t.set_data_from_numpy(value)
        return t

    def stream(spec: RequestSpec, result: RequestResult, clock: Callable[[], float]) -> None:
        n = np.array([[spec.max_tokens]], dtype=np.int32)
        inputs = [
            tensor("input_ids", np.array([spec.prompt_ids], dtype=np.int32)),
            tensor("input_lengths", np.array([[len(spec.prompt_ids)]], dtype=np.int32)),
            tensor("request_output_len", n),
            tensor("min_tokens", n),  # EOS is masked until min_tokens: exact lengths
            tensor("runtime_top_k", np.array([[1]], dtype=np.int32)),
            tensor("streaming", np.array([[True]])),
        ]
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((clock(), result, error)))
        try:
            result.sent_s = clock()
            client.async_stream_infer(
                "tensorrt_llm", inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True
            )
            while True:
                at, res, err = responses.get(timeout=timeout_s)
                if err is not None:
                    raise RuntimeError(str(err))
                length = res.as_numpy("sequence_length")
                if length is not None and int(length.sum()) > 0:
                    result.chunks.append((at, int(length.sum())))
                if res.get_response().parameters["triton_final_response"].bool_param:
                    return
        finally:
            client.stop_stream()
            client.close()

    return Peer(server, stream)


def _sse_events(response: requests.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            yield line[6:].decode()


def _post_stream(
    url: str,
    body: dict,
    result: RequestResult,
    clock: Callable[[], float],
    timeout_s: float,
    tokens_in: Callable[[dict], int],
) -> None:
    result.sent_s = clock()
    with requests.post(url, json=body, stream=True, timeout=timeout_s) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        for data in _sse_events(response):
            at = clock()
            if data == "[DONE]":
                return
            k = tokens_in(json.loads(data))
            if k:
                result.chunks.append((at, k))


def llama_server(
    label: str, weights: str, binary: Path, gguf: Path, options: list[str], log_dir: Path, timeout_s: float
) -> Peer:
    """llama.cpp's `llama-server` with `options` (threads, slots, context); prompt cache off per request."""
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *options]
    log_file = log_path(log_dir, label)
    server = ManagedServer(label, weights, command, f"http://127.0.0.1:{port}/health", log_file)

    def tokens_in(event: dict) -> int:
        if "tokens" in event:
            return len(event["tokens"])
        return 1 if event.get("content") else 0

    def stream(spec: RequestSpec, result: RequestResult, clock: Callable[[], float]) -> None:
        body = {
            "prompt": list(spec.prompt_ids),
            "n_predict": spec.max_tokens,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": True,
            "temperature": 0.0,
            "top_k": 1,
            "return_tokens": True,
        }
        _post_stream(f"http://127.0.0.1:{port}/completion", body, result, clock, timeout_s, tokens_in)

    return Peer(server, stream)


def vllm_server(
    venv: Path, model_dir: str, dtype: str, threads: int, log_dir: Path, timeout_s: float
) -> Peer:
    """vLLM CPU's OpenAI server (its own venv; environment as verified in the project's notes)."""
    label = f"vllm-{DTYPE_SHORT.get(dtype, dtype)}"
    port = free_port()
    command = [
        str(venv / "bin/python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        "model",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
    ]
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "LD_PRELOAD": str(venv / "lib/libiomp5.so"),
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
    }
    log_file = log_path(log_dir, label)
    server = ManagedServer(
        label, DTYPE_SHORT.get(dtype, dtype), command, f"http://127.0.0.1:{port}/health", log_file, env
    )

    def tokens_in(event: dict) -> int:
        choices = event.get("choices") or [{}]
        ids = choices[0].get("token_ids")
        return len(ids) if ids is not None else int(bool(choices[0].get("text")))

    def stream(spec: RequestSpec, result: RequestResult, clock: Callable[[], float]) -> None:
        body = {
            "model": "model",
            "prompt": list(spec.prompt_ids),
            "max_tokens": spec.max_tokens,
            "min_tokens": spec.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "return_token_ids": True,
        }
        _post_stream(f"http://127.0.0.1:{port}/v1/completions", body, result, clock, timeout_s, tokens_in)

    return Peer(server, stream)
