"""A step's model inputs, written into host buffers made once instead of new tensors from Python lists.

The buffers grow (doubling) when a step needs more room and are then reused: every step overwrites them,
which is safe because a step's forward pass ends before the next one is built. On the CPU the tensors
the model gets are views of the buffers (no copy); on a GPU they are copied over once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tritonllm.engine.scheduler import ScheduledChunk
from tritonllm.model.llama import AttentionMetadata, PrefillSpan


class StepInputs:
    """Builds (input_ids, positions, attention metadata, logits indices) for one step's chunks."""

    def __init__(self, tokens_per_block: int, device: torch.device):
        self.tokens_per_block = tokens_per_block
        self.device = device
        self._per_token = np.zeros((3, 0), dtype=np.int64)  # input ids, positions, cache slots
        self._tables = np.zeros(0, dtype=np.int64)  # [seqs, width] block tables, flat
        # context lengths, logits indices, prefill query starts (one more than chunks)
        self._per_seq = np.zeros((3, 1), dtype=np.int64)

    def build(
        self, chunks: Sequence[ScheduledChunk], block_tables: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """`chunks` hold the single-token decodes first, then the prefill chunks.

        Python lists gather the values and one bulk copy per buffer stores them: numpy's per-element
        stores cost more than the list appends they would replace."""
        bs = self.tokens_per_block
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        contexts: list[int] = []
        logits_at: list[int] = []
        tables: list[list[int]] = []
        prefill_rows = []
        for i, chunk in enumerate(chunks):
            seq, n = chunk.seq, chunk.num_tokens
            start = seq.num_computed_tokens
            context = start + n
            table = block_tables[seq.request_id]
            if n == 1:
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                prefill_rows.append((i, len(ids), n, context))
                ids += seq.token_ids[start:context]
                positions += range(start, context)
                slots += [table[p // bs] * bs + p % bs for p in range(start, context)]
            contexts.append(context)
            tables.append(table[: -(-context // bs)])
            if context == len(seq.token_ids):  # the chunk reaches the sequence's end: it samples
                logits_at.append(len(ids) - 1)
        width = max(map(len, tables), default=1)
        padded = [block for row in tables for block in (row + [0] * (width - len(row)))]
        num_tokens, num_seqs = len(ids), len(chunks)
        self._reserve(num_tokens, num_seqs, width)
        per_token = self._per_token[:, :num_tokens]
        per_token[0], per_token[1], per_token[2] = ids, positions, slots
        flat = self._tables[: num_seqs * width]
        flat[:] = padded
        per_seq = self._per_seq[:, :num_seqs]
        per_seq[0] = contexts
        per_seq[1, : len(logits_at)] = logits_at
        num_decodes = num_seqs - len(prefill_rows)
        query_starts = self._per_seq[2, : len(prefill_rows) + 1]
        query_starts[:] = [at - num_decodes for _, at, _, _ in prefill_rows] + [num_tokens - num_decodes]
        ids_t, positions_t, slots_t, tables_t, lens_t, logits_t, starts_t = self._to_device(
            *per_token,
            flat.reshape(num_seqs, width),
            per_seq[0],
            per_seq[1, : len(logits_at)],
            query_starts,
        )
        spans = [PrefillSpan(at, n, ctx, tables_t[i, : -(-ctx // bs)]) for i, at, n, ctx in prefill_rows]
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            num_decodes=num_decodes,
            decode_block_tables=tables_t[:num_decodes],
            decode_context_lens=lens_t[:num_decodes],
            prefills=spans,
            prefill_block_tables=tables_t[num_decodes:],
            prefill_context_lens=lens_t[num_decodes:],
            prefill_query_starts=starts_t,
        )
        return ids_t, positions_t, meta, logits_t

    def _reserve(self, num_tokens: int, num_seqs: int, width: int) -> None:
        if num_tokens > self._per_token.shape[1]:
            self._per_token = np.zeros((3, max(num_tokens, 2 * self._per_token.shape[1])), dtype=np.int64)
        if num_seqs * width > self._tables.size:
            self._tables = np.zeros(max(num_seqs * width, 2 * self._tables.size), dtype=np.int64)
        if num_seqs + 1 > self._per_seq.shape[1]:
            self._per_seq = np.zeros((3, max(num_seqs + 1, 2 * self._per_seq.shape[1])), dtype=np.int64)

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        host = [torch.from_numpy(a) for a in arrays]
        return host if self.device.type == "cpu" else [t.to(self.device) for t in host]
