"""Entrypoint of the GPU image: build the TensorRT-LLM engine on first start, then serve it.

The engine is built inside the container that serves it (same TensorRT-LLM, same GPUs: a mismatch is
the classic failure), into the `/engines` volume, so later starts reuse it. `docker build` gets no GPU,
hence the build happens here rather than in an image stage.

With `TRITONLLM_TP_SIZE` > 1 the server runs once per GPU under `mpirun`, as NVIDIA's
`launch_triton_server.py` does: rank 0 loads every model and serves HTTP, gRPC and metrics; the other
ranks load only `tensorrt_llm`, where TensorRT-LLM's executor in leader mode makes them workers of
rank 0. They must stay inside model loading, or they would open the same ports: as NVIDIA's Python
model does, `TrtllmEngine` calls `executor.shutdown()` when `executor.can_enqueue_requests()` is False,
which blocks until the leader is done. Each rank gets its own shared-memory prefix for the Python backend.

Settings come from the environment (nothing secret is baked into the image): see `GpuServeConfig`.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tritonllm.precision import QUANTIZATIONS  # what build_engines/build.py accepts
from tritonllm.triton.server import ADMIN_HEADER, RESTRICTED  # the same admin restriction as `launch`

TRITONSERVER = "/opt/tritonserver/bin/tritonserver"
BUILD_SCRIPT = "/opt/tritonllm/build_engines/build.py"


@dataclass
class GpuServeConfig:
    """What to build and serve; `from_env` reads the `TRITONLLM_*` variables named beside each field."""

    hf_model: Path  # TRITONLLM_HF_MODEL: the HF checkpoint, mounted read-only
    engine_dir: Path = Path("/engines/engine")  # TRITONLLM_ENGINE_DIR
    repository: Path = Path("/engines/model_repository")  # TRITONLLM_REPOSITORY
    quantization: str = "fp8"  # TRITONLLM_QUANTIZATION
    tp_size: int = 1  # TRITONLLM_TP_SIZE: GPUs for tensor parallelism (one MPI rank each)
    build_args: list[str] = field(default_factory=list)  # TRITONLLM_BUILD_ARGS: more build.py flags
    rebuild: bool = False  # TRITONLLM_REBUILD=1: build again even if an engine is there
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    exit_timeout_s: int = 30  # TRITONLLM_EXIT_TIMEOUT: seconds in-flight requests get on stop
    admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(16))  # TRITONLLM_ADMIN_KEY

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"TRITONLLM_QUANTIZATION={self.quantization!r}: expected one of {QUANTIZATIONS}")
        if self.tp_size < 1:
            raise ValueError(f"TRITONLLM_TP_SIZE={self.tp_size}: must be >= 1")
        if self.exit_timeout_s < 0:
            raise ValueError(f"TRITONLLM_EXIT_TIMEOUT={self.exit_timeout_s}: must be >= 0")
        if not self.admin_key:
            raise ValueError("TRITONLLM_ADMIN_KEY is empty")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> GpuServeConfig:
        if not env.get("TRITONLLM_HF_MODEL"):
            raise ValueError("TRITONLLM_HF_MODEL is not set: mount the HF checkpoint and point it there")

        def integer(name: str, default: int) -> int:
            value = env.get(name, str(default))
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r}: not an integer") from None

        optional: dict[str, object] = {}
        for name, attr in (("TRITONLLM_ENGINE_DIR", "engine_dir"), ("TRITONLLM_REPOSITORY", "repository")):
            if env.get(name):
                optional[attr] = Path(env[name])
        if env.get("TRITONLLM_ADMIN_KEY"):
            optional["admin_key"] = env["TRITONLLM_ADMIN_KEY"]
        return cls(
            hf_model=Path(env["TRITONLLM_HF_MODEL"]),
            quantization=env.get("TRITONLLM_QUANTIZATION", "fp8"),
            tp_size=integer("TRITONLLM_TP_SIZE", 1),
            build_args=shlex.split(env.get("TRITONLLM_BUILD_ARGS", "")),
            rebuild=env.get("TRITONLLM_REBUILD", "0") == "1",
            exit_timeout_s=integer("TRITONLLM_EXIT_TIMEOUT", 30),
            **optional,  # type: ignore[arg-type]
        )


def needs_build(config: GpuServeConfig) -> bool:
    built = (config.engine_dir / "config.json").is_file() and (
        config.repository / "tensorrt_llm" / "config.pbtxt"
    ).is_file()
    return config.rebuild or not built


def build_command(config: GpuServeConfig, python: str = sys.executable) -> list[str]:
    """`build_engines/build.py` with TensorRT-LLM, writing the engine and its model repository."""
    cmd = [
        python,
        BUILD_SCRIPT,
        "--model",
        str(config.hf_model),
        "--output",
        str(config.engine_dir),
        "--backend",
        "tensorrt_llm",
        "--quantization",
        config.quantization,
        "--tp-size",
        str(config.tp_size),
        "--model-repository",
        str(config.repository),
    ]
    # Only called when no complete engine is there: replace whatever a failed build left.
    return cmd + ["--force", *config.build_args]


def rank_args(config: GpuServeConfig, rank: int) -> list[str]:
    """One tritonserver's flags; ranks > 0 load only `tensorrt_llm` (NVIDIA's leader-mode layout)."""
    args = [
        TRITONSERVER,
        f"--model-repository={config.repository}",
        f"--http-port={config.http_port}",
        f"--grpc-port={config.grpc_port}",
        f"--metrics-port={config.metrics_port}",
        f"--exit-timeout-secs={config.exit_timeout_s}",
        f"--http-restricted-api={RESTRICTED}:{ADMIN_HEADER}={config.admin_key}",
        f"--grpc-restricted-protocol={RESTRICTED}:{ADMIN_HEADER}={config.admin_key}",
        "--disable-auto-complete-config",
        f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
    ]
    if rank > 0:
        args += ["--model-control-mode=explicit", "--load-model=tensorrt_llm"]
    return args


def server_command(config: GpuServeConfig) -> list[str]:
    """tritonserver alone for one GPU, else one `mpirun` with an `-n 1` app context per rank."""
    if config.tp_size == 1:
        return rank_args(config, 0)
    cmd = ["mpirun", "--allow-run-as-root"]
    for rank in range(config.tp_size):
        cmd += ["-n", "1", *rank_args(config, rank), ":"]
    return cmd[:-1]


def main() -> int:
    try:
        config = GpuServeConfig.from_env(os.environ)
    except ValueError as exc:
        print(f"tritonllm-gpu: {exc}", file=sys.stderr)
        return 2
    if needs_build(config):
        print(f"tritonllm-gpu: building the engine: {shlex.join(build_command(config))}", file=sys.stderr)
        subprocess.run(build_command(config), check=True)
    key = "TRITONLLM_ADMIN_KEY" if os.environ.get("TRITONLLM_ADMIN_KEY") else config.admin_key
    print(
        f"tritonllm-gpu: serving {config.engine_dir} on {config.tp_size} GPU(s); admin APIs need the header "
        f"{ADMIN_HEADER}: {key}",
        file=sys.stderr,
        flush=True,
    )
    cmd = server_command(config)
    os.execvp(cmd[0], cmd)
    return 0  # not reached: exec replaces this process


if __name__ == "__main__":
    sys.exit(main())
