"""The engine directory format: a `config.json` that also records what was built.

The torch backend keeps the HF `config.json` (so the model code reads it as before) and adds a
`tritonllm_build` block; TensorRT-LLM's `config.json` (written by `trtllm-build`) gets the same block.
Readers use only this module, which imports nothing heavy and nothing else of tritonllm, so the model
loader, the engine and the Triton models read engine directories without importing the builder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BUILD_KEY = "tritonllm_build"
FORMAT_VERSION = 1
BACKENDS = ("torch", "tensorrt_llm")
SCALE_SUFFIX = "_scale"  # `<linear>.weight_scale` holds the per-output-channel scales of `<linear>.weight`


class EngineDirError(ValueError):
    """An engine directory that cannot be used as it is; the message says why."""


def read_build_info(path: str | Path) -> dict[str, Any] | None:
    """The `tritonllm_build` block of `path/config.json`, or None for a plain HF checkpoint directory."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        info = json.loads(config.read_text()).get(BUILD_KEY)
    except ValueError as exc:
        raise EngineDirError(f"{config} is not valid JSON: {exc}") from None
    if info is None:
        return None
    if info.get("format_version") != FORMAT_VERSION:
        raise EngineDirError(
            f"{path} was built with engine format {info.get('format_version')}, this tritonllm reads "
            f"format {FORMAT_VERSION}: rebuild it with build_engines/build.py"
        )
    if info.get("backend") not in BACKENDS:
        raise EngineDirError(f"{path}: unknown engine backend {info.get('backend')!r}")
    return info


def engine_backend(path: str | Path) -> str:
    """'tensorrt_llm' for a TensorRT-LLM engine directory, else 'torch' (engine dirs and HF checkpoints)."""
    info = read_build_info(path)
    return info["backend"] if info else "torch"


def built_quantization(path: str | Path) -> str | None:
    """How the project's engine loads the weights in `path`: None unless it is a torch engine directory."""
    info = read_build_info(path)
    return info["quantization"] if info and info["backend"] == "torch" else None


def built_kv_cache_dtype(path: str | Path) -> str | None:
    """The KV cache a torch engine directory was built for (`--kv-cache-dtype int8`), else None."""
    info = read_build_info(path)
    chosen = info.get("kv_cache_dtype", "auto") if info and info["backend"] == "torch" else "auto"
    return None if chosen == "auto" else chosen


def engine_defaults(path: str | Path) -> dict[str, Any]:
    """EngineConfig values implied by an engine directory's limits ({} for a HF checkpoint directory)."""
    info = read_build_info(path)
    if info is None:
        return {}
    limits = info["limits"]
    quantization = {"quantization": info["quantization"]} if info["backend"] == "torch" else {}
    return {
        **quantization,
        "tokens_per_block": limits["tokens_per_block"],
        "max_model_len": limits["max_seq_len"],
        "max_num_seqs": limits["max_batch_size"],
        "max_num_batched_tokens": limits["max_num_tokens"],
    }
