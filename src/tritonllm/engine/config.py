"""Engine configuration, validated once at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tritonllm.engine_format import built_kv_cache_dtype, built_quantization
from tritonllm.precision import BLOCK_QUANTIZATIONS, DTYPES, ENGINE_QUANTIZATIONS, KV_CACHE_DTYPES


def auto_dtype(device: str, quantization: str) -> str:
    """The fastest accurate compute dtype for `device`.

    CPU: bfloat16 where the project's kernels build (they read bf16 weights and KV with fp32 arithmetic, so
    any AVX2 CPU gains; measured in benchmarks/README.md), else float32. Under int8, int7 and int4, whose
    kernel quantizes activations itself, bf16 activations saved no time on the VNNI builds, so those keep
    float32; the amx build takes bf16 under int8 (and int7, which it runs as int8): its prefill tiles read
    bf16 activations, which fp32 ones were converted to on every call (SmolLM2's linears at 512 tokens 85-89
    against 107-112 ms, 32 requests of 128 + 128 tokens 3.9-4.1 against 4.3-4.8 s in-process, batch 1 alike),
    at the same accuracy (perplexity / fp32's 1.0012 against 1.0026; on Zen 4 1.0054 against 1.0057). Not
    under int4 (1.2318 against 1.2243).
    CUDA: bfloat16 where supported.
    """
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    from tritonllm.model.cpu_kernels import load_kernels, selected_isa

    if load_kernels() is None:
        return "float32"
    if quantization in ("int8", "int7"):  # int7 runs int8's kernels on the amx build
        return "bfloat16" if selected_isa() == "amx" else "float32"
    return "float32" if quantization in BLOCK_QUANTIZATIONS else "bfloat16"


def auto_kv_cache_dtype(dtype: str, quantization: str, device: str) -> str:
    """The compute dtype, but a smaller cache under int8, int7 or int4 weights on the CPU kernels. bfloat16
    under fp32 activations: it halves what decode attention reads (a third of a 32-request step's bytes at 256
    tokens of context) for less error than the int8 weights already make. int8 rows on the amx build, whose
    decode steps wait on the cache (a 2-core Xeon VM: 64 requests at ~330 tokens, attention 34 of a 63 ms
    step with bf16 rows, 24 of 54 with int8): served int8 / bf16 cache there 1.05-1.06 at 32 at once
    interleaved, 1.03-1.07 on 64 mixed, 1.11-1.16 on a 1,792-token prompt's decode, at the same perplexity
    (1.0025 of fp32's either way); elsewhere its gain drowned in the serving path (benchmarks/README.md)."""
    if quantization in BLOCK_QUANTIZATIONS and device == "cpu":
        from tritonllm.model.cpu_kernels import load_kernels, selected_isa

        if load_kernels() is not None:
            if selected_isa() == "amx" and dtype in ("float32", "bfloat16"):  # int8 rows' compute dtypes
                return "int8"
            if dtype == "float32":
                return "bfloat16"
    return dtype


def auto_quantization(model: str, device: str) -> str:
    """An engine directory's own quantization; else int8 on CPUs where the project's kernels build: its
    kernel beat bf16 at every batch size measured (1-512 tokens) and stays closer to fp32 (perplexity
    ratio 1.0057 vs bf16's 1.0068; benchmarks/README.md); else none."""
    built = built_quantization(model)
    if built is not None:
        return built
    if device.startswith("cuda"):
        return "none"
    from tritonllm.model.cpu_kernels import load_kernels

    return "int8" if load_kernels() is not None else "none"


def default_num_threads() -> int:
    """Cores this process may run on: more threads than cores only adds contention."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class EngineConfig:
    """How to run one model.

    The KV pool is sized by `num_kv_blocks` when given, else by `kv_cache_memory_bytes`.
    """

    model: str
    dtype: str = "float32"  # the reference HF matches token for token; "auto": the fastest (auto_dtype)
    device: str = "cpu"
    # "auto": as built, else auto_kv_cache_dtype; "int8": rows with a scale each (model/kv_rows.py)
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # None: as built (an engine directory), else "none"; "auto": see below
    tokens_per_block: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 2 << 30
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is None:
            self.quantization = built_quantization(self.model) or "none"
        if self.quantization not in ENGINE_QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {ENGINE_QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization == "auto":
            self.quantization = auto_quantization(self.model, self.device)
        if self.dtype == "auto":
            self.dtype = auto_dtype(self.device, self.quantization)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "auto":
            self.kv_cache_dtype = built_kv_cache_dtype(self.model) or auto_kv_cache_dtype(
                self.dtype, self.quantization, self.device
            )
        bf16_under_fp32 = (self.kv_cache_dtype, self.dtype) == ("bfloat16", "float32")
        int8_rows = self.kv_cache_dtype == "int8" and self.dtype in ("float32", "bfloat16")
        if self.kv_cache_dtype != self.dtype and not (bf16_under_fp32 or int8_rows):
            raise ValueError(
                f"kv_cache_dtype must be the compute dtype ({self.dtype}), bfloat16 under float32, or int8 "
                f"under float32 or bfloat16, got {self.kv_cache_dtype!r}"
            )
        for name in ("tokens_per_block", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.num_threads is None:
            self.num_threads = default_num_threads()
        elif self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
