"""Rows of the paged KV cache, as `csrc/kv_rows.h` lays them out: a float cache holds head_dim values a
row; an int8 cache holds head_dim int8 values, then their fp32 scale as 4 bytes (value = int8 x scale, the
row's largest magnitude at +-127). The PyTorch paths write and read int8 rows here, as the kernels do."""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # an fp32 scale at the end of each int8 row


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """A cache row's elements for `head_dim` values of `dtype`."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache [..., row] holds."""
    return cache.shape[-1] - (SCALE_BYTES if cache.dtype == torch.int8 else 0)


def to_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values [..., head_dim] as cache rows of `dtype`: cast, or rounded (half to even) to int8 steps."""
    if dtype != torch.int8:
        return x.to(dtype)
    x = x.float()
    peak = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(peak > 0, 127 / peak, torch.zeros_like(peak))
    steps = torch.round(x * inverse).to(torch.int8)
    return torch.cat((steps, (peak / 127).view(torch.int8)), dim=-1)


def from_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row] as values [..., head_dim] of `dtype`."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)
