"""Next-token choice per sequence: penalties, bad words, min_tokens, grammar masks, temperature, top-k,
top-p, seeded draws.

Each sequence samples with its own generator, so a seed gives the same tokens whatever else is in
the batch. Log-probabilities are those of the model's own distribution (before penalties/temperature).
"""

from __future__ import annotations

import torch

from tritonllm.engine.guided import TokenMasks
from tritonllm.engine.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> None:
    """In place on one row: HF's repetition penalty over all tokens, OpenAI's presence and frequency
    penalties over the output tokens."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
        score = logits[ids]
        logits[ids] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        out = torch.tensor(seq.output_token_ids, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def banned_tokens(seq: Sequence) -> list[int]:
    """Last tokens of the bad-words sequences whose other tokens end the sequence so far."""
    tokens = seq.token_ids
    banned = []
    for bad in seq.params.bad_token_ids:
        prefix = bad[:-1]
        if len(prefix) <= len(tokens) and tokens[len(tokens) - len(prefix) :] == prefix:
            banned.append(bad[-1])
    return banned


def top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask one row's logits outside the top-k and the top-p nucleus (HF order: k, then p)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - top_p
        remove[-1] = False
        logits = logits.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return logits


class Sampler:
    def __init__(self) -> None:
        self.token_masks = TokenMasks()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
        """Token id and (if asked) its log-probability for each row of `logits` [S, vocab] fp32."""
        want_logprobs = [s.params.logprobs for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        needs_edit = [
            i
            for i, s in enumerate(seqs)
            if s.params.uses_penalties
            or s.params.bad_token_ids
            or (s.num_output_tokens < s.params.min_tokens and s.blocked_ids)
        ]
        guided = [i for i, s in enumerate(seqs) if s.guide is not None]
        if needs_edit or guided:
            logits = logits.clone()
        for i in needs_edit:
            seq = seqs[i]
            apply_penalties(logits[i], seq)
            if seq.params.bad_token_ids:
                logits[i, banned_tokens(seq)] = float("-inf")
            if seq.num_output_tokens < seq.params.min_tokens:
                logits[i, list(seq.blocked_ids)] = float("-inf")
        if guided:
            self.token_masks.apply(
                logits, guided, [seqs[i].guide for i in guided], [seqs[i].end_ids for i in guided]
            )
        tokens = torch.argmax(logits, dim=-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                continue
            row = top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            if seq.generator is None:
                seq.generator = torch.Generator(device=logits.device)
                seq.generator.manual_seed(seq.seed)
            tokens[i] = int(torch.multinomial(row.softmax(-1), 1, generator=seq.generator).item())
        logprobs: list[float | None] = [
            float(raw_logprobs[i, t]) if want else None
            for i, (t, want) in enumerate(zip(tokens, want_logprobs, strict=False))
        ]
        return tokens, logprobs
