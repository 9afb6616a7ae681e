"""`tritonllm openai` as a child process of `tritonllm launch --openai-port N`, beside Triton.

Its own process: the front door's event loop and tokenizer stay off the launcher, and it stops first on
shutdown so no new request reaches a draining engine. API keys come from the environment it inherits
(`TRITONLLM_OPENAI_API_KEYS`).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys


class FrontDoorProcess:
    def __init__(
        self,
        model_dir: str,
        triton_grpc_url: str,
        host: str,
        port: int,
        max_model_len: int | None,
        triton_model: str | None = None,
    ):
        self.command = [
            sys.executable,
            "-m",
            "tritonllm.cli",
            "openai",
            "--model",
            model_dir,
            "--triton-url",
            triton_grpc_url,
            "--host",
            host,
            "--port",
            str(port),
        ]
        if max_model_len is not None:
            self.command += ["--max-model-len", str(max_model_len)]
        if triton_model is not None:
            self.command += ["--triton-model", triton_model]
        self.url = f"http://{host}:{port}/v1"
        self.process: subprocess.Popen | None = None

    def start(self) -> FrontDoorProcess:
        self.process = subprocess.Popen(self.command)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout_s)
        if process.poll() is None:
            process.kill()
            process.wait()
