"""StepInputs: a step's tensors, written into reused host buffers, hold what each chunk needs."""

import torch

from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import ScheduledChunk
from tritonllm.engine.sequence import Sequence
from tritonllm.engine.step_inputs import StepInputs

BS = 4  # tokens per block


def chunk(request_id: str, tokens: list[int], computed: int, num_tokens: int) -> ScheduledChunk:
    seq = Sequence(request_id, tokens, SamplingParams())
    seq.num_computed_tokens = computed
    return ScheduledChunk(seq, num_tokens)


def test_decodes_and_prefill_chunks_get_their_slots_tables_and_sampled_rows():
    chunks = [
        chunk("decode", list(range(10, 16)), computed=5, num_tokens=1),  # 6th token, block 1
        chunk("middle", list(range(20, 30)), computed=4, num_tokens=3),  # a chunk that does not sample
        chunk("last", list(range(40, 46)), computed=0, num_tokens=6),  # a whole prompt: samples
    ]
    tables = {"decode": [7, 3], "middle": [9, 8, 2], "last": [5, 6]}
    ids, positions, meta, logits_at = StepInputs(BS, torch.device("cpu")).build(chunks, tables)

    assert ids.tolist() == [15, 24, 25, 26, 40, 41, 42, 43, 44, 45]
    assert positions.tolist() == [5, 4, 5, 6, 0, 1, 2, 3, 4, 5]
    assert meta.slot_mapping.tolist() == [3 * BS + 1, 8 * BS, 8 * BS + 1, 8 * BS + 2] + [
        5 * BS + p if p < BS else 6 * BS + p - BS for p in range(6)
    ]
    assert logits_at.tolist() == [0, 9]  # the decode and the end of the whole prompt
    assert meta.num_decodes == 1
    assert meta.decode_block_tables.tolist() == [[7, 3]]
    assert meta.decode_context_lens.tolist() == [6]
    spans = [(s.start, s.length, s.context_len, s.block_ids.tolist()) for s in meta.prefills]
    assert spans == [(1, 3, 7, [9, 8]), (4, 6, 6, [5, 6])]


def test_buffers_grow_for_a_bigger_step_and_are_reused_after():
    inputs = StepInputs(BS, torch.device("cpu"))
    small = [chunk("a", [1, 2], computed=1, num_tokens=1)]
    big = [chunk(f"r{i}", list(range(40)), computed=39, num_tokens=1) for i in range(8)]
    tables = {"a": [4], **{f"r{i}": list(range(i * 10, i * 10 + 10)) for i in range(8)}}

    inputs.build(small, tables)
    ids, positions, meta, _ = inputs.build(big, tables)
    assert ids.tolist() == [39] * 8
    assert meta.decode_block_tables.shape == (8, 10) and meta.decode_block_tables.is_contiguous()
    assert meta.slot_mapping.tolist() == [(i * 10 + 9) * BS + 3 for i in range(8)]

    ids, _, meta, _ = inputs.build(small, tables)  # the grown buffers serve a small step again
    assert ids.tolist() == [2] and meta.decode_block_tables.tolist() == [[4]]
