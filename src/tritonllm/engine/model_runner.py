"""Owns the model and the KV-cache tensors; turns a scheduled step into one forward pass and samples."""

from __future__ import annotations

import logging

import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.sampler import Sampler
from tritonllm.engine.scheduler import ScheduledChunk, SchedulerOutput
from tritonllm.model.cpu_kernels import cpu_flags, load_kernels, selected_isa
from tritonllm.model.llama import AttentionMetadata, PrefillSpan
from tritonllm.model.loader import TORCH_DTYPES, load_model

log = logging.getLogger(__name__)


def describe_kernels(device: torch.device) -> str:
    """Which kernels a model on `device` runs, with the CPU's SIMD flags (logged and in engine stats)."""
    if device.type != "cpu":
        return device.type
    if load_kernels() is None:
        return f"pytorch ({' '.join(cpu_flags())})"
    return f"cpu-{selected_isa()} ({' '.join(cpu_flags())})"


class ModelRunner:
    def __init__(self, config: EngineConfig):
        torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.kv_cache_dtype = TORCH_DTYPES[config.kv_cache_dtype]
        self.model = load_model(config.model, config.dtype, config.device, config.quantization)
        self.kernels = describe_kernels(self.device)
        log.info(
            "engine: dtype=%s quantization=%s kv cache=%s kernels=%s threads=%d",
            config.dtype,
            config.quantization,
            config.kv_cache_dtype,
            self.kernels,
            config.num_threads,
        )
        self.args = self.model.args
        self.tokens_per_block = config.tokens_per_block
        a = self.args
        bytes_per_block = (
            2
            * a.num_layers
            * config.tokens_per_block
            * a.num_kv_heads
            * a.head_dim
            * self.kv_cache_dtype.itemsize
        )
        self.bytes_per_block = bytes_per_block
        self.num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // bytes_per_block)
        self.kv_cache = torch.zeros(
            a.num_layers,
            2,
            a.num_kv_heads,  # head-major, so a gather of blocks is contiguous per head
            self.num_blocks,
            config.tokens_per_block,
            a.head_dim,
            dtype=self.kv_cache_dtype,
            device=self.device,
        )
        # Each layer's (keys, values) views, made once: 90 tensor views a step were ~0.1 ms of a 10 ms
        # batch-1 step. Block copies write `kv_cache` in place, so the views stay valid.
        self.kv_layers = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.sampler = Sampler()

    def execute(self, step: SchedulerOutput, block_tables: dict[str, list[int]]):
        """Run one step; returns (chunk, token, logprob) for each chunk that completes its sequence."""
        if step.block_copies:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*step.block_copies, strict=False))
            self.kv_cache[:, :, :, dst] = self.kv_cache[:, :, :, src]
        decodes = [c for c in step.chunks if c.num_tokens == 1]
        prefills = [c for c in step.chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        input_ids, positions, slots, logits_indices = [], [], [], []
        spans = []
        bs = self.tokens_per_block
        for chunk in ordered:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            table = block_tables[seq.request_id]
            first = len(input_ids)
            input_ids.extend(seq.token_ids[start : start + chunk.num_tokens])
            pos = range(start, start + chunk.num_tokens)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if chunk.num_tokens > 1:
                context = start + chunk.num_tokens
                block_ids = torch.tensor(table[: -(-context // bs)], device=self.device)
                spans.append(PrefillSpan(first, chunk.num_tokens, context, block_ids))
            if chunk.samples:
                logits_indices.append(len(input_ids) - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=len(decodes),
            prefills=spans,
            **self._decode_tables(decodes, block_tables),
        )
        logits = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            self.kv_layers,
            torch.tensor(logits_indices, dtype=torch.long, device=self.device),
        )
        sampling = [c for c in ordered if c.samples]
        tokens, logprobs = self.sampler(logits, [c.seq for c in sampling])
        return list(zip(sampling, tokens, logprobs, strict=False))

    def _decode_tables(self, decodes: list[ScheduledChunk], block_tables: dict[str, list[int]]) -> dict:
        """Block tables padded to the longest decode, and how many keys each decode attends to."""
        lengths = [c.seq.num_computed_tokens + 1 for c in decodes]
        width = -(-max(lengths, default=1) // self.tokens_per_block)
        tables = [block_tables[c.seq.request_id][:width] for c in decodes]
        return {
            "decode_block_tables": torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device
            ).view(len(decodes), width),
            "decode_context_lens": torch.tensor(lengths, dtype=torch.long, device=self.device),
        }
