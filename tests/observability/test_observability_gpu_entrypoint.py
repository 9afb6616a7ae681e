"""docker/gpu_entrypoint.py without a GPU, TensorRT-LLM or MPI (none can run here): the commands it
would run are checked against NVIDIA's launch layout and against build_engines/build.py's real flags."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from observability_helpers import DOCKER_DIR

spec = importlib.util.spec_from_file_location("tritonllm_gpu_entrypoint", DOCKER_DIR / "gpu_entrypoint.py")
entrypoint = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = entrypoint  # dataclasses look their module up there
spec.loader.exec_module(entrypoint)

ENV = {"TRITONLLM_HF_MODEL": "/models/hf", "TRITONLLM_ADMIN_KEY": "k"}


def test_no_gpu_single_gpu_server_command() -> None:
    config = entrypoint.GpuServeConfig.from_env(ENV)
    cmd = entrypoint.server_command(config)
    assert cmd[0] == "/opt/tritonserver/bin/tritonserver"
    assert "--model-repository=/engines/model_repository" in cmd
    assert "--backend-config=python,shm-region-prefix-name=prefix0_" in cmd
    assert "--http-restricted-api=model-repository,shared-memory,logging,trace:tritonllm-admin-key=k" in cmd
    assert not any(arg.startswith("--load-model") for arg in cmd)


def test_no_mpi_tensor_parallel_runs_one_rank_per_gpu_under_mpirun() -> None:
    config = entrypoint.GpuServeConfig.from_env({**ENV, "TRITONLLM_TP_SIZE": "4"})
    cmd = entrypoint.server_command(config)
    assert cmd[:2] == ["mpirun", "--allow-run-as-root"]
    contexts = " ".join(cmd[2:]).split(" : ")
    assert len(contexts) == 4
    for rank, context in enumerate(contexts):
        args = context.split()
        assert args[:3] == ["-n", "1", "/opt/tritonserver/bin/tritonserver"]
        assert f"--backend-config=python,shm-region-prefix-name=prefix{rank}_" in args
        # Rank 0 serves every model; the others only host TensorRT-LLM workers.
        assert ("--load-model=tensorrt_llm" in args) == (rank > 0)


def test_no_tensorrt_llm_build_command_uses_flags_build_py_accepts() -> None:
    config = entrypoint.GpuServeConfig.from_env(
        {**ENV, "TRITONLLM_TP_SIZE": "2", "TRITONLLM_BUILD_ARGS": "--max-seq-len 4096 --kv-cache-dtype fp8"}
    )
    cmd = entrypoint.build_command(config, python="python3")
    assert cmd[1] == "/opt/tritonllm/build_engines/build.py"
    flags = {arg for arg in cmd if arg.startswith("--")}
    assert {"--backend", "--quantization", "--tp-size", "--model-repository", "--max-seq-len"} <= flags
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--quantization") + 1] == "fp8"
    build_py = DOCKER_DIR.parent / "build_engines" / "build.py"
    usage = subprocess.run(
        [sys.executable, str(build_py), "--help"], capture_output=True, text=True, timeout=120
    )
    assert usage.returncode == 0, usage.stderr
    unknown = {flag for flag in flags if flag not in usage.stdout}
    assert not unknown, f"build.py does not accept {unknown}"


def test_builds_only_when_no_complete_engine_is_there(tmp_path: Path) -> None:
    env = {**ENV, "TRITONLLM_ENGINE_DIR": str(tmp_path / "e"), "TRITONLLM_REPOSITORY": str(tmp_path / "r")}
    config = entrypoint.GpuServeConfig.from_env(env)
    assert entrypoint.needs_build(config)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text("{}")
    assert entrypoint.needs_build(config), "an engine without its model repository is incomplete"
    (tmp_path / "r" / "tensorrt_llm").mkdir(parents=True)
    (tmp_path / "r" / "tensorrt_llm" / "config.pbtxt").write_text("")
    assert not entrypoint.needs_build(config)
    assert entrypoint.needs_build(entrypoint.GpuServeConfig.from_env({**env, "TRITONLLM_REBUILD": "1"}))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "TRITONLLM_HF_MODEL is not set"),
        ({**ENV, "TRITONLLM_TP_SIZE": "two"}, "TRITONLLM_TP_SIZE='two': not an integer"),
        ({**ENV, "TRITONLLM_TP_SIZE": "0"}, "TRITONLLM_TP_SIZE=0: must be >= 1"),
        ({**ENV, "TRITONLLM_QUANTIZATION": "fp4"}, "TRITONLLM_QUANTIZATION='fp4': expected one of"),
    ],
)
def test_bad_settings_get_a_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        entrypoint.GpuServeConfig.from_env(env)
