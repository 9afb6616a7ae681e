"""The batched sampler against straightforward per-row references (no model needed)."""

from __future__ import annotations

import torch

from tritonllm.engine import SamplingParams
from tritonllm.engine.sampler import Sampler, top_k_top_p_rows
from tritonllm.engine.sequence import Sequence

VOCAB = 64


def reference_top_k_top_p(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """HF's order, one row at a time: top-k (ties kept), then the top-p nucleus."""
    if 0 < top_k < row.shape[-1]:
        row = row.masked_fill(row < torch.topk(row, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(row)
        remove = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[-1] = False
        row = row.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return row


def test_top_k_top_p_rows_equal_the_per_row_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, VOCAB, generator=gen) * 3
    logits[3, :10] = 2.0  # ties at the k-th value
    top_k = torch.tensor([0, 1, 5, 10, 0, 0, 3, 64, 70, 8, 0, 20])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.9, 0.01, 0.5, 0.7, 1.0, 0.95, 0.3, 0.99])
    with_k = [i for i in range(len(logits)) if 0 < top_k[i] < VOCAB]  # the topk path, no sort
    for rows in (list(range(len(logits))), with_k):
        got = top_k_top_p_rows(logits[rows], top_k[rows], top_p[rows])
        for j, i in enumerate(rows):
            expected = reference_top_k_top_p(logits[i], int(top_k[i]), float(top_p[i]))
            assert torch.equal(torch.isinf(got[j]), torch.isinf(expected)), i
            kept = ~torch.isinf(expected)
            assert torch.equal(got[j][kept], logits[i][kept]), i


def sequence(prompt: list[int], **params) -> Sequence:
    return Sequence(f"r{id(params)}", prompt, SamplingParams(max_tokens=32, **params), end_ids=frozenset({0}))


def test_penalties_are_counted_incrementally_and_match_a_full_recount() -> None:
    seq = sequence(
        [5, 6, 7, 5], temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3
    )
    plain = sequence([5, 6, 7, 5], temperature=0.0)
    sampler = Sampler()
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        logits = torch.randn(2, VOCAB, generator=gen)
        tokens, _ = sampler(logits, [seq, plain])
        seq.token_ids.append(tokens[0])
        plain.token_ids.append(tokens[1])
        assert tokens[1] == int(logits[1].argmax())  # the unpenalised row is untouched
    counts = seq.token_counts
    assert counts is not None and plain.token_counts is None
    sampler(torch.zeros(2, VOCAB), [seq, plain])  # counts the last token
    assert torch.equal(
        counts.output, torch.bincount(torch.tensor(seq.output_token_ids), minlength=VOCAB).float()
    )
    assert set(torch.nonzero(counts.seen).flatten().tolist()) == set(seq.token_ids)

    logits = torch.randn(1, VOCAB, generator=gen)
    expected = logits[0].clone()
    seen = torch.tensor(sorted(set(seq.token_ids)))
    expected[seen] = torch.where(expected[seen] < 0, expected[seen] * 1.5, expected[seen] / 1.5)
    expected -= 0.5 * counts.output + 0.3 * (counts.output > 0).float()
    assert sampler(logits, [seq])[0][0] == int(expected.argmax())


def test_only_seeded_requests_get_a_generator_and_their_draws_ignore_the_batch() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, VOCAB, generator=gen)
    seeded_alone = sequence([1], temperature=1.0, top_p=0.9, seed=7)
    draws_alone = [Sampler()(logits[2:3], [seeded_alone])[0][0] for _ in range(8)]
    seeded = sequence([1], temperature=1.0, top_p=0.9, seed=7)
    crowd = [sequence([1], temperature=0.7), sequence([1], temperature=0.0), sequence([1], top_k=5, seed=3)]
    batch = [crowd[0], crowd[1], seeded, crowd[2], sequence([1], temperature=2.0)]
    sampler = Sampler()
    draws = [sampler(logits, batch)[0][2] for _ in range(8)]
    assert draws == draws_alone
    assert seeded.generator is not None and crowd[2].generator is not None
    assert crowd[0].generator is None and batch[4].generator is None


def test_a_row_with_every_token_banned_does_not_fail_the_others() -> None:
    banned = sequence([1], temperature=1.0, seed=1, bad_token_ids=[[t] for t in range(VOCAB)])
    other = sequence([1], temperature=1.0, seed=2)
    tokens, _ = Sampler()(torch.randn(2, VOCAB), [banned, other])
    assert all(0 <= t < VOCAB for t in tokens)
