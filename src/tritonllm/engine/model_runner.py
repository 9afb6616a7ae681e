"""Owns the model and the KV-cache tensors; turns a scheduled step into one forward pass and samples."""

from __future__ import annotations

import logging

import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.sampler import Sampler
from tritonllm.engine.scheduler import SchedulerOutput
from tritonllm.engine.step_inputs import StepInputs
from tritonllm.model.cpu_kernels import cpu_flags, load_kernels, selected_isa
from tritonllm.model.huge_pages import huge_page_share, huge_page_zeros
from tritonllm.model.kv_rows import row_width
from tritonllm.model.loader import TORCH_DTYPES, load_model
from tritonllm.model.quant import BLAS_MIN_TOKENS, cpu_kernels, int7_runs_as_int8, runs_on_kernels
from tritonllm.precision import BLOCK_QUANTIZATIONS

log = logging.getLogger(__name__)


def describe_kernels(device: torch.device) -> str:
    """Which kernels a model on `device` runs, with the CPU's SIMD flags (logged and in engine stats)."""
    if device.type != "cpu":
        return device.type
    kernels = load_kernels()
    if kernels is None:
        return f"pytorch ({' '.join(cpu_flags())})"
    gemm_from = kernels.onednn_bf16_min_tokens()
    bf16 = f", bf16 from {gemm_from} tokens: onednn" if gemm_from else ""
    if kernels.packs_bf16():
        bf16 = ", bf16 weights packed"
    return f"cpu-{selected_isa()}{bf16} ({' '.join(cpu_flags())})"


def streamed_weight_pages(model: torch.nn.Module) -> str:
    """How much of the weights the CPU kernels stream sits on 2 MB pages ("" where none or unknown): the OS
    may refuse them (fragmented memory), and batch-1 decode is then slower."""
    streamed = next((m.weight for layer in model.layers for m in layer.linears if runs_on_kernels(m)), None)
    share = None if streamed is None else huge_page_share(streamed)
    return "" if share is None else f" weights on 2 MB pages={share:.0%}"


class ModelRunner:
    def __init__(self, config: EngineConfig):
        torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.kv_cache_dtype = (
            torch.int8 if config.kv_cache_dtype == "int8" else TORCH_DTYPES[config.kv_cache_dtype]
        )
        self.model = load_model(config.model, config.dtype, config.device, config.quantization)
        self.kernels = describe_kernels(self.device)
        # Where the kernels do all of a step's heavy work (block-quantized linears; the fp32 and bf16 models
        # also run PyTorch's GEMMs), its loops run on their own pool of threads (csrc/thread_pool.h): a loop
        # ends when its items are done, not when a thread that lost its core to the response sender, the
        # server or the client gets it back.
        kernels = cpu_kernels(self.device)
        pooled = kernels is not None and config.quantization in BLOCK_QUANTIZATIONS
        self.pool_threads = config.num_threads if pooled else 0
        self.use_thread_pool = kernels.use_thread_pool if pooled else None
        log.info(
            "engine: dtype=%s quantization=%s kv cache=%s kernels=%s threads=%d (%s)%s",
            config.dtype,
            config.quantization,
            config.kv_cache_dtype,
            self.kernels,
            config.num_threads,
            "the kernels' pool" if pooled else "OpenMP",
            streamed_weight_pages(self.model),
        )
        if config.quantization == "int7" and int7_runs_as_int8(self.device):
            log.warning(
                "quantization=int7 gains no speed with kernels=%s (it runs as int8 here, with 7 bits' "
                "accuracy): int8 is as fast and closer to the unquantized model",
                self.kernels,
            )
        self.args = self.model.args
        self.tokens_per_block = config.tokens_per_block
        a = self.args
        bytes_per_block = (
            2
            * a.num_layers
            * config.tokens_per_block
            * a.num_kv_heads
            * row_width(a.head_dim, self.kv_cache_dtype)
            * self.kv_cache_dtype.itemsize
        )
        self.bytes_per_block = bytes_per_block
        self.num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // bytes_per_block)
        self.kv_cache = self.new_kv_cache(self.num_blocks)
        # Each layer's (keys, values) views, made once: 90 tensor views a step were ~0.1 ms of a 10 ms
        # batch-1 step. Block copies write `kv_cache` in place, so the views stay valid.
        self.kv_layers = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.sampler = Sampler()
        self.inputs = StepInputs(config.tokens_per_block, self.device)

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """A zeroed cache [layers, 2, kv_heads, num_blocks, tokens_per_block, row] (head-major, so a gather
        of blocks is contiguous per head; a row is head_dim values, and a scale under int8: kv_rows.py);
        evaluation takes a scratch one."""
        a = self.args
        row = row_width(a.head_dim, self.kv_cache_dtype)
        shape = (a.num_layers, 2, a.num_kv_heads, num_blocks, self.tokens_per_block, row)
        # Decode attention reads blocks from all over the cache: on the CPU, 2 MB pages miss the TLB less;
        # faulted in here, once, rather than inside the steps that first write them.
        if self.device.type == "cpu":
            return huge_page_zeros(shape, self.kv_cache_dtype, populate=True)
        return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

    def execute(self, step: SchedulerOutput, block_tables: dict[str, list[int]]):
        """Run one step; returns (chunk, token, logprob) for each chunk that completes its sequence."""
        # From BLAS_MIN_TOKENS sampled rows the lm_head runs PyTorch's GEMM, which a pooled step would leave
        # on one thread; a step that large loses nothing to OpenMP's barriers.
        if self.use_thread_pool is None or sum(c.samples for c in step.chunks) >= BLAS_MIN_TOKENS:
            return self._execute(step, block_tables)
        self.use_thread_pool(self.pool_threads)  # for this step, on the thread that runs it
        try:
            return self._execute(step, block_tables)
        finally:
            self.use_thread_pool(0)

    def _execute(self, step: SchedulerOutput, block_tables: dict[str, list[int]]):
        if step.block_copies:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*step.block_copies, strict=False))
            self.kv_cache[:, :, :, dst] = self.kv_cache[:, :, :, src]
        # Decodes first: the model runs their attention as one batch ahead of the prefill chunks.
        ordered = sorted(step.chunks, key=lambda c: c.num_tokens > 1)
        input_ids, positions, meta, logits_indices = self.inputs.build(ordered, block_tables)
        logits = self.model(input_ids, positions, meta, self.kv_layers, logits_indices)
        sampling = [c for c in ordered if c.samples]
        tokens, logprobs = self.sampler(logits, [c.seq for c in sampling])
        return list(zip(sampling, tokens, logprobs, strict=False))
