"""Sampling options: seeds, stop sequences, min/max tokens, end ids, penalties, log-probabilities."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy, hf_greedy, make_engine, random_prompts, run_staggered

from tritonllm.engine import FinishReason, SamplingParams
from tritonllm.engine.sampler import top_k_top_p

PROMPT = list(range(20, 40))


def finish_of(engine, request_id: str, prompt: list[int], params: SamplingParams):
    engine.add_request(request_id, prompt, params)
    tokens, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                final = out
    return tokens, final


def test_seed_reproducible_across_batch_compositions(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = make_engine(tiny_llama_dir).generate([PROMPT], params)[0]
    others = random_prompts(8, vocab=512, seed=3)
    crowd_params = [SamplingParams(max_tokens=15, temperature=0.8, seed=i, ignore_eos=True) for i in range(8)]
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=9)
    got = run_staggered(engine, others + [PROMPT], crowd_params + [params], [0] * 4 + [2] * 4 + [1])
    assert got[-1] == alone
    different_seed = SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    assert make_engine(tiny_llama_dir).generate([PROMPT], different_seed)[0] != alone


def test_sampling_is_not_greedy_at_high_temperature(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    hot = [SamplingParams(max_tokens=12, temperature=5.0, seed=s, ignore_eos=True) for s in range(4)]
    outs = engine.generate([PROMPT] * 4, hot)
    assert len({tuple(o) for o in outs}) > 1


def test_max_tokens_and_length_finish(tiny_llama_dir: Path) -> None:
    tokens, final = finish_of(make_engine(tiny_llama_dir), "a", PROMPT, greedy(7))
    assert len(tokens) == 7 and final.finished and final.finish_reason is FinishReason.LENGTH


def test_stop_sequence_ends_generation(tiny_llama_dir: Path) -> None:
    reference = hf_greedy(tiny_llama_dir, PROMPT, 12)
    stop = reference[4:6]
    tokens, final = finish_of(
        make_engine(tiny_llama_dir), "s", PROMPT, greedy(12, stop_token_ids=[[9999 % 512, 1], stop])
    )
    first = next(i for i in range(len(reference) - 1) if reference[i : i + 2] == stop)
    assert tokens == reference[: first + 2]
    assert final.finish_reason is FinishReason.STOP


def test_bad_words_match_hf_bad_words_ids(tiny_llama_dir: Path) -> None:
    """Single-token and multi-token bad words change the greedy output exactly as HF's `bad_words_ids`."""
    reference = hf_greedy(tiny_llama_dir, PROMPT, 12)
    bad = [[reference[2]], reference[5:7]]
    expected = hf_greedy(tiny_llama_dir, PROMPT, 12, bad_words_ids=bad)
    assert expected != reference
    tokens, _ = finish_of(make_engine(tiny_llama_dir), "b", PROMPT, greedy(12, bad_token_ids=bad))
    assert tokens == expected
    assert reference[2] not in tokens


def test_end_id_and_min_tokens(tiny_llama_dir: Path) -> None:
    reference = hf_greedy(tiny_llama_dir, PROMPT, 12)
    end_id = reference[3]
    first = reference.index(end_id)
    params = SamplingParams(max_tokens=12, temperature=0.0, end_id=end_id)
    tokens, final = finish_of(make_engine(tiny_llama_dir), "e", PROMPT, params)
    assert tokens == reference[: first + 1] and final.finish_reason is FinishReason.STOP
    params = SamplingParams(max_tokens=12, temperature=0.0, end_id=end_id, min_tokens=first + 3)
    tokens, _ = finish_of(make_engine(tiny_llama_dir), "m", PROMPT, params)
    assert len(tokens) >= first + 3
    assert end_id not in tokens[: first + 2], "end id must be masked until min_tokens"


def test_ignore_eos_generates_through_eos(tiny_llama_dir: Path) -> None:
    """Force an end token: the greedy output's third token is made the end id, so a plain request stops
    there; with `ignore_eos` the same request generates through it to max_tokens, token for token."""
    engine = make_engine(tiny_llama_dir)
    reference, _ = finish_of(engine, "reference", PROMPT, SamplingParams(max_tokens=10, temperature=0.0))
    assert len(reference) == 10, "the tiny model ended early; pick another prompt"
    forced_end = reference[2]
    stopped, final = finish_of(
        engine, "stops", PROMPT, SamplingParams(max_tokens=10, temperature=0.0, end_id=forced_end)
    )
    assert (
        final.finish_reason is FinishReason.STOP and stopped == reference[: reference.index(forced_end) + 1]
    )
    through, final = finish_of(
        engine,
        "through",
        PROMPT,
        SamplingParams(max_tokens=10, temperature=0.0, end_id=forced_end, ignore_eos=True),
    )
    assert final.finish_reason is FinishReason.LENGTH and through == reference


def test_logprobs_are_model_log_probabilities(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    params = greedy(5, logprobs=True)
    engine = make_engine(tiny_llama_dir)
    engine.add_request("lp", PROMPT, params)
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert all(lp <= 0 for lp in logprobs)
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)


def test_penalties_change_greedy_output(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    plain = engine.generate([PROMPT], greedy(16))[0]
    for option in ({"repetition_penalty": 5.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        penalised = engine.generate([PROMPT], greedy(16, **option))[0]
        assert penalised != plain, option
    repeated = engine.generate([PROMPT], greedy(16, repetition_penalty=100.0))[0]
    assert not set(repeated) & set(PROMPT), "a huge repetition penalty avoids every seen token"


def test_top_k_top_p_masks() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert torch.isinf(top_k_top_p(logits, 2, 1.0)[:2]).all()
    probs = logits.softmax(-1)  # [0.032, 0.087, 0.237, 0.644]
    kept = ~torch.isinf(top_k_top_p(logits, 0, 0.7))
    assert kept.tolist() == [False, False, True, True]
    assert math.isclose(probs[2:].sum().item(), 0.881, abs_tol=1e-3)
    assert (~torch.isinf(top_k_top_p(logits, 0, 0.01))).sum() == 1


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": -3}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": float("nan")}),
        ("top_k", {"top_k": -1}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("presence_penalty", {"presence_penalty": 3.0}),
        ("min_tokens", {"min_tokens": 20, "max_tokens": 10}),
        ("seed", {"seed": -1}),
        ("stop_token_ids", {"stop_token_ids": [[]]}),
        ("bad_token_ids", {"bad_token_ids": [[1], []]}),
    ],
)
def test_bad_sampling_params_name_the_field(field: str, kwargs: dict) -> None:
    from tritonllm.engine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
