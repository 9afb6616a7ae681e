"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Tokens of all scheduled sequences are flattened into one [T, hidden] batch for every matmul;
attention reads each sequence's keys and values through its block table. Numerics follow HF
transformers (fp32 RMSNorm, rotate-half RoPE) so greedy output matches it token for token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.model.args import ModelArgs
from tritonllm.model.cpu_kernels import load_kernels
from tritonllm.model.kv_rows import from_rows, head_dim_of, to_rows
from tritonllm.model.quant import blas_sized, kernel_tensors


@dataclass
class PrefillSpan:
    """One sequence's chunk in the flattened batch: queries [start, start+len) over `context_len` keys."""

    start: int
    length: int
    context_len: int
    block_ids: torch.Tensor
    _bias: torch.Tensor | None = field(default=None, repr=False)

    def causal_bias(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive mask [1, 1, length, context_len] for a chunk after a cached prefix (query i sees keys
        up to its own position); built once per step and shared by the layers."""
        if self._bias is None:
            rows = torch.arange(self.length, device=device)[:, None] + (self.context_len - self.length)
            visible = rows >= torch.arange(self.context_len, device=device)[None, :]
            bias = torch.zeros(visible.shape, dtype=dtype, device=device)
            self._bias = bias.masked_fill_(~visible, float("-inf"))[None, None]
        return self._bias


@dataclass
class AttentionMetadata:
    """Where this step's keys/values go and what each query attends to.

    The batch holds `num_decodes` single-token decodes first, then the prefill chunks.
    """

    slot_mapping: torch.Tensor  # [T] flat cache slot of each token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [D, max_blocks]
    decode_context_lens: torch.Tensor  # [D] int64, keys each decode attends to (itself included)
    prefills: list[PrefillSpan]
    # The prefill chunks again, for the CPU kernel's one call: per chunk its block table [P, W], the keys its
    # last query sees [P], and where its queries start among the prefill tokens [P + 1] (int64).
    prefill_block_tables: torch.Tensor
    prefill_context_lens: torch.Tensor
    prefill_query_starts: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (statistics in fp32); the fused kernel where the input is fp32 already."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchLayerOps:
    """PyTorch versions of the fused per-layer kernels of `csrc/layer_ops.cpp` (same names and semantics),
    for devices other than the CPU and CPUs where the kernels cannot be built."""

    @staticmethod
    def add_rms_norm(x, delta, weight, eps: float) -> torch.Tensor:
        if delta is not None:
            x.add_(delta)
        return rms_norm(x, weight, eps)

    @staticmethod
    def rope_and_cache(qkv, cos, sin, slots, k_cache, v_cache, heads: int) -> torch.Tensor:
        kv_heads, head_dim, row = k_cache.shape[0], head_dim_of(k_cache), k_cache.shape[-1]
        qk = qkv[:, : (heads + kv_heads) * head_dim].reshape(-1, heads + kv_heads, head_dim)
        qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
        v = qkv[:, (heads + kv_heads) * head_dim :].reshape(-1, kv_heads, head_dim)
        k_cache.view(kv_heads, -1, row).index_copy_(
            1, slots, to_rows(qk[:, heads:].transpose(0, 1), k_cache.dtype)
        )
        v_cache.view(kv_heads, -1, row).index_copy_(1, slots, to_rows(v.transpose(0, 1), v_cache.dtype))
        return qk

    @staticmethod
    def silu_and_mul(gate_up) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def layer_ops(device: torch.device):
    """The fused C++ ops on CPU where they build, else their PyTorch versions."""
    kernels = load_kernels() if device.type == "cpu" else None
    return kernels if kernels is not None else TorchLayerOps


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, linears: dict[str, nn.Module], norms: dict[str, torch.Tensor]):
        super().__init__()
        self.args = args
        self.qkv_proj, self.o_proj = linears["qkv"], linears["o"]
        self.gate_up_proj, self.down_proj = linears["gate_up"], linears["down"]
        self.input_norm = nn.Parameter(norms["input"], requires_grad=False)
        self.post_attention_norm = nn.Parameter(norms["post_attention"], requires_grad=False)
        self.ops = layer_ops(self.input_norm.device)
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim**-0.5
        self.varlen_prefill = True  # prefill chunks through the CPU kernel's one call, else a loop over SDPA

    @property
    def linears(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """qkv, o, gate_up, down: the order a step reads them."""
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def forward(self, x, delta, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Adds the previous layer's output `delta` to the residual stream `x` (in place, as the norm reads
        it) and returns this layer's output, which the next layer (or the final norm) adds in turn."""
        a, ops = self.args, self.ops
        h = ops.add_rms_norm(x, delta, self.input_norm, a.rms_norm_eps)
        qkv = self.qkv_proj(h)
        k_cache, v_cache = kv_cache  # [kv_heads, num_blocks, tokens_per_block, head_dim]
        qk = ops.rope_and_cache(qkv, cos, sin, meta.slot_mapping, k_cache, v_cache, a.num_heads)
        q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        if not meta.prefills:
            out = self._decode_attention(q, k_cache, v_cache, meta)
        else:
            out = torch.empty_like(q)
            if meta.num_decodes:
                out[: meta.num_decodes] = self._decode_attention(
                    q[: meta.num_decodes], k_cache, v_cache, meta
                )
            kernel = load_kernels() if q.device.type == "cpu" and self.varlen_prefill else None
            if kernel is not None:
                out[meta.num_decodes :] = kernel.paged_prefill_attention(
                    q[meta.num_decodes :].contiguous(),
                    k_cache,
                    v_cache,
                    meta.prefill_block_tables,
                    meta.prefill_query_starts,
                    meta.prefill_context_lens,
                    self.scale,
                )
            else:
                v = qkv[:, self.q_size + self.kv_size :].reshape(-1, a.num_kv_heads, a.head_dim)
                for span in meta.prefills:
                    out[span.start : span.start + span.length] = self._prefill_attention(
                        q, k, v, k_cache, v_cache, span
                    )
        h = ops.add_rms_norm(
            x, self.o_proj(out.view(-1, self.q_size)), self.post_attention_norm, a.rms_norm_eps
        )
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(h)))

    def _decode_attention(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """All decodes at once: in place by the CPU kernel, else one gather of their blocks per head,
        masked past each length (the head-major cache makes the gathered keys contiguous)."""
        a = self.args
        kernel = load_kernels() if q.device.type == "cpu" else None
        if kernel is not None:
            return kernel.paged_decode_attention(
                q.contiguous(),
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
            )
        d = q.shape[0]
        keys = from_rows(gather_blocks(k_cache, meta.decode_block_tables), q.dtype)
        values = from_rows(gather_blocks(v_cache, meta.decode_block_tables), q.dtype)
        q = q.view(d, a.num_kv_heads, -1, a.head_dim).transpose(0, 1)  # [kv_heads, D, group, head_dim]
        visible = torch.arange(keys.shape[2], device=q.device) < meta.decode_context_lens[:, None]
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return torch.matmul(probs, values).transpose(0, 1).reshape(d, a.num_heads, a.head_dim)

    def _prefill_attention(self, q, k, v, k_cache, v_cache, span: PrefillSpan) -> torch.Tensor:
        """Causal attention of a chunk over its cached prefix and itself. Inputs are 4-D with an additive
        float mask: that takes PyTorch's fused CPU kernel (3-D or a bool mask took the math path, 2.4x
        slower for a 512-token chunk after 512 cached tokens)."""
        q = q[span.start : span.start + span.length].transpose(0, 1)[None]
        if span.context_len == span.length:  # nothing cached before this chunk
            keys = k[span.start : span.start + span.length].transpose(0, 1)[None]
            values = v[span.start : span.start + span.length].transpose(0, 1)[None]
            bias, causal = None, True
        else:
            keys = from_rows(
                gather_blocks(k_cache, span.block_ids[None])[None, :, 0, : span.context_len], q.dtype
            )
            values = from_rows(
                gather_blocks(v_cache, span.block_ids[None])[None, :, 0, : span.context_len], q.dtype
            )
            bias, causal = span.causal_bias(q.dtype, q.device), False
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=bias, is_causal=causal, scale=self.scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[kv_heads, num_blocks, bs, row] gathered by tables [D, W] -> [kv_heads, D, W * bs, row] (kv_rows)."""
    heads, _, bs, row = cache.shape
    d, width = block_tables.shape
    rows = cache.view(heads, -1, bs * row).index_select(1, block_tables.reshape(-1))
    return rows.view(heads, d, width * bs, row)


class LlamaModel(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        embed: torch.Tensor | None,
        layers: list[DecoderLayer],
        norm: torch.Tensor,
        lm_head: nn.Module,
        inv_freq: torch.Tensor,
        attention_scaling: float,
    ):
        super().__init__()
        self.args = args
        # None: tied to a head that keeps the only copy of the rows (packed bf16; embed_tokens).
        self.embed = None if embed is None else nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Parameter(norm, requires_grad=False)
        self.lm_head = lm_head
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling
        self.ops = layer_ops(self.norm.device)
        self.fused_decode = True  # decode-only steps through csrc/decode_stack.cpp where it can run them
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin by position (cache_rope)

    @functools.cached_property
    def packed_layers(self) -> list[list[torch.Tensor]] | None:
        """Each layer's norms and linears as `decode_layers` takes them, or None when some linear does not
        run on the CPU kernels (the Python loop then runs every step)."""
        packed = []
        for layer in self.layers:
            linears = [kernel_tensors(m) for m in layer.linears]
            if any(t is None for t in linears):
                return None
            packed.append([layer.input_norm, layer.post_attention_norm, *[t for lin in linears for t in lin]])
        return packed

    def cache_rope(self, num_positions: int) -> None:
        """Keep cos/sin for positions 0..num_positions-1 (the engine's max_model_len), so that a step looks
        its rows up: computing them took six small tensor ops, ~0.1 ms of a ~7 ms batch-1 CPU step.
        The same elementwise ops on the same positions: the same values to the bit."""
        dtype = self.norm.dtype
        self.rope_table = self.rope(torch.arange(num_positions, device=self.norm.device), dtype)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim], computed as HF does (fp32 product, then cast), or looked up."""
        if self.rope_table is not None and self.rope_table[0].dtype == dtype:
            cos, sin = self.rope_table
            return cos.index_select(0, positions), sin.index_select(0, positions)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos.contiguous(), sin.contiguous()

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `input_ids` (a new tensor), from the head's weight where it holds them."""
        if self.embed is None:
            return self.lm_head.rows(input_ids)
        return F.embedding(input_ids, self.embed)

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, meta: AttentionMetadata, kv_caches, logits_indices
    ) -> torch.Tensor:
        """Logits [S, vocab] in fp32 for the tokens at `logits_indices`."""
        x = self.embed_tokens(input_ids)  # the residual stream, updated in place by the layers
        cos, sin = self.rope(positions, x.dtype)
        kernels = load_kernels() if x.device.type == "cpu" else None
        if (
            self.fused_decode
            and kernels is not None
            and not meta.prefills
            and not blas_sized(x)
            and self.packed_layers
        ):
            a = self.args
            delta = kernels.decode_layers(
                x,
                self.packed_layers,
                cos,
                sin,
                meta.slot_mapping,
                [k for k, _ in kv_caches],
                [v for _, v in kv_caches],
                meta.decode_block_tables,
                meta.decode_context_lens,
                a.rms_norm_eps,
                a.num_heads,
                self.layers[0].scale,
            )
        else:
            delta = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=False):
                delta = layer(x, delta, cos, sin, kv_cache, meta)
        if logits_indices.numel() != x.shape[0]:  # else every row samples, in order: no gather needed
            x, delta = x[logits_indices], delta[logits_indices]
        h = self.ops.add_rms_norm(x, delta, self.norm, self.args.rms_norm_eps)
        return self.lm_head(h).float()
