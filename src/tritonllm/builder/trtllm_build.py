"""TensorRT-LLM 1.2 build: ModelOpt quantization (`quantize.py`), then `trtllm-build`, as subprocesses.

Kept thin on purpose: the commands are plain data (`quantize_command`, `trtllm_build_command`), unit
tested here without TensorRT-LLM; running them needs NVIDIA's TensorRT-LLM 1.2 container and a GPU.
Each tool's output is streamed line by line, which is the progress of these long steps.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tritonllm.builder.options import DEFAULT_CALIB_SIZE, BuildError, BuildOptions, Limits

# Our --quantization -> quantize.py --qformat (ModelOpt); `full_prec` converts without quantizing.
QFORMATS = {
    "none": "full_prec",
    "fp8": "fp8",
    "int8_sq": "int8_sq",
    "int8_wo": "int8_wo",
    "int4_awq": "int4_awq",
    "int4_wo": "int4_wo",
}
QUANTIZE_SCRIPT_ENV = "TRTLLM_QUANTIZE_SCRIPT"
# Where NVIDIA's TensorRT-LLM / Triton TRT-LLM containers keep the examples.
QUANTIZE_SCRIPTS = (
    "/app/tensorrt_llm/examples/quantization/quantize.py",
    "/app/examples/quantization/quantize.py",
)


def quantize_script() -> Path:
    """quantize.py from TensorRT-LLM's examples (`$TRTLLM_QUANTIZE_SCRIPT` first)."""
    candidates = [os.environ[QUANTIZE_SCRIPT_ENV]] if os.environ.get(QUANTIZE_SCRIPT_ENV) else []
    for candidate in [*candidates, *QUANTIZE_SCRIPTS]:
        if Path(candidate).is_file():
            return Path(candidate)
    looked = ", ".join([*candidates, *QUANTIZE_SCRIPTS])
    raise BuildError(
        f"TensorRT-LLM's examples/quantization/quantize.py not found (looked at {looked}): set "
        f"{QUANTIZE_SCRIPT_ENV} to its path (it comes with the TensorRT-LLM 1.2 sources and containers)"
    )


def quantize_command(
    options: BuildOptions, src: Path, checkpoint: Path, dtype: str, script: Path
) -> list[str]:
    """HF checkpoint -> TensorRT-LLM checkpoint, quantized by ModelOpt (fp8/int8_sq/int4_awq calibrated)."""
    cmd = [
        sys.executable,
        str(script),
        "--model_dir",
        str(src),
        "--output_dir",
        str(checkpoint),
        "--dtype",
        dtype,
        "--qformat",
        QFORMATS[options.quantization],
        "--tp_size",
        str(options.tp_size),
        "--calib_size",
        str(options.calib_size or DEFAULT_CALIB_SIZE),
    ]
    if options.kv_cache_dtype != "auto":
        cmd += ["--kv_cache_dtype", options.kv_cache_dtype]
    if options.calib_dataset:
        cmd += ["--calib_dataset", options.calib_dataset]
    return cmd


def trtllm_build_command(options: BuildOptions, checkpoint: Path, dest: Path, limits: Limits) -> list[str]:
    """TensorRT-LLM checkpoint -> engine plan(s): paged KV cache, packed inputs, plugins, the shape limits."""
    cmd = [
        shutil.which("trtllm-build") or "trtllm-build",
        "--checkpoint_dir",
        str(checkpoint),
        "--output_dir",
        str(dest),
        "--max_batch_size",
        str(limits.max_batch_size),
        "--max_input_len",
        str(limits.max_input_len),
        "--max_seq_len",
        str(limits.max_seq_len),
        "--max_num_tokens",
        str(limits.max_num_tokens),
        "--kv_cache_type",
        "paged",
        "--tokens_per_block",
        str(limits.tokens_per_block),
        "--remove_input_padding",
        "enable",
        "--use_paged_context_fmha",
        "enable",  # KV-cache reuse and chunked context need it
        "--gemm_plugin",
        "auto",
        "--gpt_attention_plugin",
        "auto",
    ]
    if options.quantization == "fp8":
        cmd += ["--use_fp8_context_fmha", "enable"]
    return cmd


def run(cmd: list[str], step: str) -> None:
    """Run one step, streaming its output (the progress); a BuildError naming the step if it fails."""
    print(f"build: {step}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        print(f"  [{step}] {line.rstrip()}", file=sys.stderr, flush=True)
    if process.wait() != 0:
        raise BuildError(f"{step} failed with exit status {process.returncode} (its output is above)")


def build(options: BuildOptions, src: Path, dest: Path, dtype: str, limits: Limits) -> None:
    """Quantize and compile into `dest` (config.json + rank*.engine); the checkpoint is a temporary step."""
    checkpoint = dest / ".trtllm_checkpoint"
    run(quantize_command(options, src, checkpoint, dtype, quantize_script()), "quantize")
    run(trtllm_build_command(options, checkpoint, dest, limits), "trtllm-build")
    shutil.rmtree(checkpoint)
    if not any(dest.glob("rank*.engine")):
        raise BuildError(f"trtllm-build wrote no rank*.engine into {dest}")
