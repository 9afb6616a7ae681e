"""build_engines/build.py: every bad argument gets a clear message; a rebuild is refused or replaced."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tritonllm.builder import builder
from tritonllm.builder.builder import build
from tritonllm.builder.cli import main
from tritonllm.builder.options import BuildError, BuildOptions
from tritonllm.engine import trtllm_executor
from tritonllm.engine_format import read_build_info
from tritonllm.triton.launcher import MARKER, MODELS, LaunchOptions

ROOT = Path(__file__).resolve().parents[2]
BUILD_PY = ROOT / "build_engines" / "build.py"


def error_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_help_explains_every_option() -> None:
    result = subprocess.run(
        [sys.executable, str(BUILD_PY), "--help"], capture_output=True, text=True, timeout=120, check=True
    )
    for flag in (
        "--model",
        "--output",
        "--backend",
        "--quantization",
        "--kv-cache-dtype",
        "--dtype",
        "--max-batch-size",
        "--max-input-len",
        "--max-seq-len",
        "--max-num-tokens",
        "--tokens-per-block",
        "--tp-size",
        "--calib-dataset",
        "--calib-size",
        "--model-repository",
        "--force",
    ):
        assert flag in result.stdout, flag


def test_the_script_builds_an_engine(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "engine"
    result = subprocess.run(
        [
            sys.executable,
            str(BUILD_PY),
            "--model",
            str(tiny_llama_dir),
            "--output",
            str(out),
            "--backend",
            "torch",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "convert model.safetensors" in result.stderr  # progress of the long step
    assert read_build_info(out)["quantization"] == "none"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--max-input-len", "512", "--max-seq-len", "512"],
            r"--max-input-len \(512\) must be smaller than --max-seq-len",
        ),
        (
            ["--max-seq-len", "4096"],
            r"--max-seq-len 4096 exceeds the model's max_position_embeddings \(512\)",
        ),
        (["--max-batch-size", "0"], r"--max-batch-size must be positive; got 0"),
        (
            ["--backend", "torch", "--quantization", "int8_sq"],
            r"--quantization int8_sq needs the TensorRT-LLM backend",
        ),
        (
            ["--backend", "torch", "--quantization", "int4_awq"],
            r"--quantization int4_awq needs the TensorRT-LLM",
        ),
        (
            ["--quantization", "int4_awq"],
            r"needs the TensorRT-LLM backend .* --backend auto chose the project's",
        ),
        (
            ["--backend", "torch", "--kv-cache-dtype", "fp8"],
            r"--kv-cache-dtype fp8 needs the TensorRT-LLM backend",
        ),
        (["--backend", "torch", "--tp-size", "2"], r"--tp-size 2 needs the TensorRT-LLM backend"),
        (["--backend", "torch", "--calib-size", "64"], r"--calib-dataset/--calib-size apply to TensorRT-LLM"),
        (["--backend", "tensorrt_llm"], r"TensorRT-LLM is not installed"),
    ],
)
def test_bad_arguments_are_named(
    capsys: pytest.CaptureFixture[str], tiny_llama_dir: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    err = error_of(capsys, ["--model", str(tiny_llama_dir), "--output", str(tmp_path / "out"), *args])
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_missing_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = error_of(capsys, ["--model", str(tmp_path / "nope"), "--output", str(tmp_path / "out")])
    assert "--model" in err and "no such checkpoint directory" in err


def broken_copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_unsupported_architecture(
    capsys: pytest.CaptureFixture[str], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    src = broken_copy(tiny_llama_dir, tmp_path / "gpt2")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    err = error_of(capsys, ["--model", str(src), "--output", str(tmp_path / "out")])
    assert "unsupported architecture ['GPT2LMHeadModel']" in err and "LlamaForCausalLM" in err


def test_missing_tokenizer(capsys: pytest.CaptureFixture[str], tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = broken_copy(tiny_llama_dir, tmp_path / "no_tok")
    (src / "tokenizer.json").unlink()
    assert "has no tokenizer" in error_of(capsys, ["--model", str(src), "--output", str(tmp_path / "out")])


def test_shape_mismatch(capsys: pytest.CaptureFixture[str], tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = broken_copy(tiny_llama_dir, tmp_path / "bad_shape")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    err = error_of(capsys, ["--model", str(src), "--output", str(tmp_path / "out")])
    assert "model.layers.0.mlp.gate_proj.weight has shape [128, 64], config.json implies [96, 64]" in err


def test_output_inside_the_checkpoint_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(BuildError, match="overlaps the checkpoint"):
        BuildOptions(model=str(tiny_llama_dir), output=str(tiny_llama_dir / "engine"))


def test_tensorrt_llm_without_gpu_or_with_another_version_without_tensorrt_llm(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """TensorRT-LLM is not present here: its presence and version are faked to reach the later checks."""
    monkeypatch.setattr(trtllm_executor, "tensorrt_llm_installed", lambda: True)
    monkeypatch.setattr(trtllm_executor, "gpu_available", lambda: False)
    kwargs = dict(model=str(tiny_llama_dir), output=str(tmp_path / "out"), backend="tensorrt_llm")
    monkeypatch.setattr(trtllm_executor, "tensorrt_llm_version", lambda: "1.2.1")
    with pytest.raises(BuildError, match=r"needs an NVIDIA GPU"):
        BuildOptions(**kwargs)
    monkeypatch.setattr(trtllm_executor, "tensorrt_llm_version", lambda: "1.3.0")
    with pytest.raises(BuildError, match=r"needs TensorRT-LLM 1\.2\.x .* found 1\.3\.0"):
        BuildOptions(**kwargs)
    # auto falls back to the project's engine without a GPU
    assert BuildOptions(model=str(tiny_llama_dir), output=str(tmp_path / "out")).backend == "torch"


def test_rebuild_is_refused_then_replaced_with_force(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "engine"
    build(BuildOptions(model=str(tiny_llama_dir), output=str(out), backend="torch"))
    again = BuildOptions(model=str(tiny_llama_dir), output=str(out), backend="torch", quantization="fp8")
    with pytest.raises(
        BuildError, match=r"already holds a torch engine \(none\): pass --force to replace it"
    ):
        build(again)
    again.force = True
    build(again)
    assert read_build_info(out)["quantization"] == "fp8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]  # no staging or old folders left


def test_other_files_are_not_overwritten(tiny_llama_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(BuildError, match=r"already holds other files: pass --force"):
        build(BuildOptions(model=str(tiny_llama_dir), output=str(tmp_path), backend="torch"))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_failed_forced_rebuild_keeps_the_old_engine(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "engine"
    build(BuildOptions(model=str(tiny_llama_dir), output=str(out), backend="torch"))

    def fail(*args: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(builder.torch_engine, "convert", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        build(
            BuildOptions(
                model=str(tiny_llama_dir), output=str(out), backend="torch", quantization="fp8", force=True
            )
        )
    assert read_build_info(out)["quantization"] == "none"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


def test_model_repository_serves_the_engine_dir(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out, repo = tmp_path / "engine", tmp_path / "repo"
    build(
        BuildOptions(
            model=str(tiny_llama_dir),
            output=str(out),
            backend="torch",
            max_batch_size=8,
            model_repository=str(repo),
        )
    )
    assert (repo / MARKER).is_file()
    assert all((repo / model / "config.pbtxt").is_file() for model in MODELS)
    engine = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert f'key: "engine_dir" value: {{ string_value: "{out}" }}' in engine
    assert "max_batch_size: 8" in engine
    assert f'string_value: "{out}"' in (repo / "preprocessing" / "config.pbtxt").read_text()  # its tokenizer


def test_model_repository_refuses_a_foreign_folder(tiny_llama_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "x").write_text("")
    with pytest.raises(BuildError, match=r"--model-repository .* not written by tritonllm"):
        build(
            BuildOptions(
                model=str(tiny_llama_dir),
                output=str(tmp_path / "e"),
                backend="torch",
                model_repository=str(tmp_path / "repo"),
            )
        )
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("http_port", 0, "http_port must be in 1..65535"),
        ("max_batch_size", 0, "max_batch_size must be positive"),
        ("tokens_per_block", -4, "tokens_per_block must be positive"),
        ("quantization", "int8_sq", "quantization must be one of"),
        ("dtype", "float64", "dtype must be one of"),
        ("kv_cache_dtype", "fp8", "kv_cache_dtype must be one of"),
        ("max_engine_restarts", -1, "max_engine_restarts must be >= 0"),
    ],
)
def test_launch_options_are_validated(field: str, value: object, message: str) -> None:
    """--model-repository fills the templates from LaunchOptions, validated at construction."""
    with pytest.raises(ValueError, match=message):
        LaunchOptions(model="m", **{field: value})


def test_engine_dir_of_another_format_is_named(
    capsys: pytest.CaptureFixture[str], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "engine"
    out.mkdir()
    (out / "config.json").write_text(
        json.dumps({"tritonllm_build": {"format_version": 99, "backend": "torch"}})
    )
    err = error_of(capsys, ["--model", str(tiny_llama_dir), "--output", str(out)])
    assert "was built with engine format 99, this tritonllm reads format 1: rebuild it" in err
