"""Next-token choice for a step's rows, batched: penalties, bad words, min_tokens, grammar masks,
temperature, top-k, top-p, draws.

Each kind of edit is one tensor op over the rows that need it, so a step's sampling costs about the
same for 1 or 64 rows. Seeded requests draw from their own generator, so a seed gives the same tokens
whatever else is in the batch; unseeded ones draw together from the sampler's generator. Penalty
statistics are kept per request and updated with the tokens added since the last step.
Log-probabilities are those of the model's own distribution (before penalties/temperature).
"""

from __future__ import annotations

import secrets

import torch

from tritonllm.engine.guided import TokenMasks
from tritonllm.engine.sequence import Sequence
from tritonllm.model.cpu_kernels import load_kernels


class TokenCounts:
    """One request's token statistics for penalties, updated with new tokens only.

    `seen` marks every prompt and output token (HF repetition penalty); `output` counts generated
    tokens (OpenAI presence and frequency penalties). Tokens are never removed from a sequence
    (preemption recomputes the same ones), so counting from `num_counted` on stays exact.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.output = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.num_counted = 0

    def update(self, seq: Sequence) -> None:
        if self.num_counted == len(seq.token_ids):
            return
        device = self.seen.device
        self.seen[torch.tensor(seq.token_ids[self.num_counted :], device=device)] = True
        generated = seq.token_ids[max(self.num_counted, seq.num_prompt_tokens) :]
        if generated:
            ids = torch.tensor(generated, device=device)
            self.output.index_add_(0, ids, torch.ones(len(generated), device=device))
        self.num_counted = len(seq.token_ids)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(-1)


def apply_penalties(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """In place on `rows`: HF's repetition penalty over prompt and output tokens, OpenAI's presence
    and frequency penalties over the output tokens."""
    device = logits.device
    for seq in seqs:
        if seq.token_counts is None:
            seq.token_counts = TokenCounts(logits.shape[-1], device)
        seq.token_counts.update(seq)
    index = torch.tensor(rows, dtype=torch.long, device=device)
    scores = logits.index_select(0, index)
    penalty = _column([s.params.repetition_penalty for s in seqs], device)
    seen = torch.stack([s.token_counts.seen for s in seqs])  # type: ignore[union-attr]
    scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
    counts = torch.stack([s.token_counts.output for s in seqs])  # type: ignore[union-attr]
    frequency = _column([s.params.frequency_penalty for s in seqs], device)
    presence = _column([s.params.presence_penalty for s in seqs], device)
    scores -= frequency * counts + presence * (counts > 0).to(scores.dtype)
    logits.index_copy_(0, index, scores)


def banned_tokens(seq: Sequence) -> list[int]:
    """Last tokens of the bad-words sequences whose other tokens end the sequence so far, and the
    end tokens while fewer than min_tokens were generated."""
    tokens = seq.token_ids
    banned = list(seq.blocked_ids) if seq.num_output_tokens < seq.params.min_tokens else []
    for bad in seq.params.bad_token_ids:
        prefix = bad[:-1]
        if len(prefix) <= len(tokens) and tokens[len(tokens) - len(prefix) :] == prefix:
            banned.append(bad[-1])
    return banned


def top_k_top_p_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask each row outside its top-k and top-p nucleus (HF order: k, then p); k = 0 and p = 1 are off.

    When every row has a top-k, the nucleus lies within its k largest values: `topk` of those is far
    cheaper than sorting the vocabulary (ties with the k-th value beyond the largest k are dropped).
    Otherwise one ascending sort serves both: values below the k-th largest (ties kept) are already
    at the front, so the sorted row stays sorted for the nucleus sum.
    """
    vocab = logits.shape[-1]
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    if bool((k < vocab).all()):
        values, order = torch.topk(logits, int(k.max()))  # descending
        values = values.masked_fill(values < values.gather(1, (k - 1).unsqueeze(-1)), float("-inf"))
        probs = values.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability of the larger values
        p = top_p.unsqueeze(-1)
        values = values.masked_fill((before >= p) & (p < 1), float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(1, order, values)
    ordered, order = torch.sort(logits, dim=-1)
    kth = ordered.gather(1, (vocab - k).unsqueeze(-1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    cumulative = ordered.softmax(-1).cumsum(-1)
    remove = cumulative <= (1 - top_p).unsqueeze(-1)
    remove[:, -1] = False
    ordered = ordered.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`top_k_top_p_rows` for one row."""
    k = torch.tensor([top_k], device=logits.device)
    p = torch.tensor([top_p], dtype=logits.dtype, device=logits.device)
    return top_k_top_p_rows(logits.unsqueeze(0), k, p)[0]


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax. On the CPU the kernels' vectorized one: torch's reads a value at a time (~80 us a
    49152-wide row here, >1% of a batch-1 step)."""
    kernels = load_kernels() if scores.device.type == "cpu" else None
    return kernels.greedy_tokens(scores) if kernels is not None else torch.argmax(scores, dim=-1)


class Sampler:
    def __init__(self) -> None:
        self.token_masks = TokenMasks()
        self._generator: torch.Generator | None = None  # unseeded draws, made on the logits' device

    @torch.inference_mode()  # the model's logits are inference tensors, edited in place
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
        """Token id and (if asked) its log-probability for each row of `logits` [S, vocab] fp32, which it may
        edit in place (penalties, bans, grammar masks)."""
        scores = self._edited(logits, seqs)
        tokens = greedy_tokens(scores)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            tokens[sampled] = self._draw(scores, sampled, seqs)
        want = [i for i, s in enumerate(seqs) if s.params.logprobs]
        logprobs: list[float | None] = [None] * len(seqs)
        if want:
            index = torch.tensor(want, dtype=torch.long, device=logits.device)
            chosen = tokens.index_select(0, index).unsqueeze(-1)
            raw = torch.log_softmax(logits.index_select(0, index), dim=-1).gather(1, chosen)
            for i, value in zip(want, raw.flatten().tolist(), strict=True):
                logprobs[i] = value
        return tokens.tolist(), logprobs

    def _edited(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The logits after penalties, bans and grammar masks: edited in place, or in a copy when some row
        reports log-probabilities (those of the unedited logits)."""
        penalised = [i for i, s in enumerate(seqs) if s.params.uses_penalties]
        bans = [(i, t) for i, s in enumerate(seqs) for t in banned_tokens(s)]
        guided = [i for i, s in enumerate(seqs) if s.guide is not None]
        if not (penalised or bans or guided):
            return logits
        scores = logits.clone() if any(s.params.logprobs for s in seqs) else logits
        if penalised:
            apply_penalties(scores, penalised, [seqs[i] for i in penalised])
        if bans:
            rows, columns = zip(*bans, strict=True)
            scores[list(rows), list(columns)] = float("-inf")
        if guided:
            self.token_masks.apply(
                scores, guided, [seqs[i].guide for i in guided], [seqs[i].end_ids for i in guided]
            )
        return scores

    def _draw(self, scores: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> torch.Tensor:
        """Temperature, top-k, top-p and one draw for each of `rows`, by inverting each row's CDF at a
        uniform number (one per row: a seeded request takes its own from its own generator)."""
        device = scores.device
        vocab = scores.shape[-1]
        params = [seqs[i].params for i in rows]
        index = torch.tensor(rows, dtype=torch.long, device=device)
        picked = scores.index_select(0, index) / _column([p.temperature for p in params], device)
        with_top_k = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
        full_nucleus = [j for j, p in enumerate(params) if p.top_p < 1.0 and not 0 < p.top_k < vocab]
        for group in (with_top_k, full_nucleus):  # two cost classes: topk, or a sort of the vocabulary
            if group:
                k = torch.tensor([params[j].top_k for j in group], device=device)
                p = torch.tensor([params[j].top_p for j in group], dtype=picked.dtype, device=device)
                picked[group] = top_k_top_p_rows(picked[group], k, p)
        cdf = picked.softmax(-1).cumsum(-1)
        uniform = torch.empty(len(rows), dtype=cdf.dtype, device=device)
        unseeded = []
        for j, i in enumerate(rows):
            seq = seqs[i]
            if seq.params.seed is None:
                unseeded.append(j)
                continue
            if seq.generator is None:
                seq.generator = torch.Generator(device=device)
                seq.generator.manual_seed(seq.params.seed)
            uniform[j] = torch.rand(1, generator=seq.generator, device=device)[0]
        if unseeded:
            if self._generator is None:
                self._generator = torch.Generator(device=device)
                self._generator.manual_seed(secrets.randbits(63))
            uniform[unseeded] = torch.rand(len(unseeded), generator=self._generator, device=device)
        # A row with every token banned has a NaN CDF: it gets some token instead of failing the whole
        # step (a grammar then rejects it and fails only that request).
        target = (uniform * cdf[:, -1]).unsqueeze(-1)
        return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=vocab - 1)
