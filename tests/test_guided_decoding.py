"""Constrained decoding (guided.py, the sampler's masks, the engine's matchers): JSON schema, regex, EBNF.

The tiny random model writes whatever the grammar lets through, so its outputs test the masks
themselves; the real default model (``slow``) tests that a JSON schema gives usable, valid answers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import torch
from engine_helpers import make_engine, random_prompts

from tritonllm.engine import FinishReason, InvalidRequestError, LLMEngine, SamplingParams
from tritonllm.engine.guided import GuideCompiler, TokenMasks
from tritonllm.tokenization import encode_prompt, load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{2,3}"
EBNF = 'root ::= answer " " digit digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
EBNF_MATCH = r"(yes|no) [0-9][0-9]"


@dataclass
class Result:
    tokens: list[int]
    finish_reason: FinishReason | None
    error: str | None


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    """Add every request, step until all are done; the tokens and last output of each."""
    results = {rid: Result([], None, None) for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    for _ in range(10_000):
        if not engine.has_unfinished():
            return results
        for out in engine.step():
            result = results[out.request_id]
            result.tokens += out.new_token_ids
            result.finish_reason, result.error = out.finish_reason, out.error
    raise AssertionError("engine made no progress")


def guided(guide_type: str, guide: str | None, max_tokens: int = 48, **kwargs) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        guided_decoding_guide_type=guide_type,
        guided_decoding_guide=guide,
        **kwargs,
    )


def text_of(model_dir: Path, tokens: list[int]) -> str:
    return load_tokenizer(model_dir).decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("guide_type", "guide", "field", "message"),
    [
        ("json_schema", "{not json", "guided_decoding_guide", "not valid JSON"),
        ("json_schema", '{"type": "objectx"}', "guided_decoding_guide", "objectx"),
        ("json_schema", "[1, 2]", "guided_decoding_guide", "must be an object"),
        ("json_schema", None, "guided_decoding_guide", "is required"),
        ("regex", "[0-9", "guided_decoding_guide", "unclosed character class"),
        ("ebnf_grammar", "root ::= digit", "guided_decoding_guide", "digit"),
        ("json", '{"type": "object"}', "guided_decoding_guide", "must be empty"),
        ("xml", "<a/>", "guided_decoding_guide_type", "must be one of json, json_schema, regex"),
        (None, "[0-9]+", "guided_decoding_guide_type", "is required"),
    ],
)
def test_bad_guides_name_the_tensor(
    guide_type: str | None, guide: str | None, field: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        guided(guide_type, guide)  # type: ignore[arg-type]
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_compiled_guides_are_cached_by_content_and_matchers_are_independent(tiny_llama_dir: Path) -> None:
    compiler = GuideCompiler(str(tiny_llama_dir), vocab_size=512, eos_ids=[2])
    first = compiler.compile("regex", "[0-9]+")
    assert compiler.compile("regex", "[0-9]+") is first
    assert compiler.compile("regex", "[0-9]*") is not first
    a, b = compiler.matcher("regex", "ab"), compiler.matcher("regex", "ab")
    token_a = load_tokenizer(tiny_llama_dir).encode("a", add_special_tokens=False)
    assert a.accept(token_a[0]) and not a.is_accepting
    assert not b.accept(token_a[0] + 1) and b.error  # b rejects what a never saw
    assert compiler.matcher("regex", "ab").accept(token_a[0])  # the cached start state is untouched


@pytest.mark.parametrize(
    ("text", "complete"),
    [('{"a": [1, true]}', True), ("[1, 2]", True), ("[]", True), ('"a"', False), ("12", False)],
)
def test_guide_type_json_allows_an_object_or_an_array_at_the_top_level(
    tiny_llama_dir: Path, text: str, complete: bool
) -> None:
    """As xgrammar's builtin JSON grammar, which TensorRT-LLM uses for `json`: a bare scalar is refused."""
    matcher = GuideCompiler(str(tiny_llama_dir), vocab_size=512, eos_ids=[2]).matcher("json", None)
    tokens = load_tokenizer(tiny_llama_dir).encode(text, add_special_tokens=False)
    accepted = all(matcher.accept(token) for token in tokens)
    assert (accepted and matcher.is_accepting) is complete, matcher.error


def test_regex_and_ebnf_outputs_match_and_stop_when_complete(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    prompts = random_prompts(6, 512, seed=3, max_len=20)
    requests = {f"re{i}": (p, guided("regex", REGEX)) for i, p in enumerate(prompts)}
    requests |= {f"bnf{i}": (p, guided("ebnf_grammar", EBNF)) for i, p in enumerate(prompts)}
    for rid, result in run(engine, requests).items():
        text = text_of(tiny_llama_dir, result.tokens)
        assert re.fullmatch(REGEX if rid.startswith("re") else EBNF_MATCH, text), (rid, text)
        assert result.finish_reason is FinishReason.STOP, (rid, text)


def test_json_schema_outputs_validate(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    prompts = random_prompts(8, 512, seed=4, max_len=20)
    schema = json.dumps(SCHEMA)
    results = run(engine, {str(i): (p, guided("json_schema", schema, 64)) for i, p in enumerate(prompts)})
    for result in results.values():
        value = json.loads(text_of(tiny_llama_dir, result.tokens))
        jsonschema.validate(value, SCHEMA)
        assert result.finish_reason is FinishReason.STOP


def test_max_tokens_first_ends_with_length(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    result = run(engine, {"r": ([5, 6, 7], guided("regex", "[a-z]{40}", max_tokens=3))})["r"]
    assert result.finish_reason is FinishReason.LENGTH and len(result.tokens) == 3
    assert re.fullmatch("[a-z]+", text_of(tiny_llama_dir, result.tokens))


def test_masks_allow_the_request_end_ids_once_the_grammar_is_satisfied(
    tiny_llama_dir: Path,
) -> None:
    compiler = GuideCompiler(str(tiny_llama_dir), vocab_size=512, eos_ids=[2])
    vocab = load_tokenizer(tiny_llama_dir).get_vocab()
    digits = {vocab[d] for d in "0123456789"}
    fresh, satisfied = compiler.matcher("regex", "[0-9]+"), compiler.matcher("regex", "[0-9]+")
    assert satisfied.accept(vocab["7"]) and satisfied.is_accepting and not fresh.is_accepting
    logits = torch.zeros(3, 512)
    TokenMasks().apply(logits, [0, 2], [fresh, satisfied], [{100}, {100}])
    assert torch.equal(logits[1], torch.zeros(512))  # the unconstrained row is untouched
    allowed = [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]
    assert digits <= allowed[0] and 100 not in allowed[0] and 2 not in allowed[0]
    assert digits | {2, 100} <= allowed[2]  # the model's EOS (llguidance's) and the request's end id
    assert all(re.fullmatch("[0-9]+", load_tokenizer(tiny_llama_dir).decode([t])) for t in allowed[0])


def test_unconstrained_requests_beside_guided_ones_are_unchanged(tiny_llama_dir: Path) -> None:
    prompts = random_prompts(6, 512, seed=5, max_len=30)
    plain = {
        f"greedy{i}": (p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(prompts[:3])
    }
    plain |= {
        f"seeded{i}": (p, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True))
        for i, p in enumerate(prompts[3:])
    }
    alone = run(make_engine(tiny_llama_dir), plain)
    beside = dict(plain)
    beside |= {f"g{i}": (p, guided("json_schema", json.dumps(SCHEMA))) for i, p in enumerate(prompts)}
    beside |= {f"r{i}": (p, guided("regex", REGEX)) for i, p in enumerate(prompts)}
    mixed = run(make_engine(tiny_llama_dir), beside)
    for rid in plain:
        assert mixed[rid].tokens == alone[rid].tokens, rid


def test_guided_requests_survive_preemption_chunked_prefill_and_prefix_hits(tiny_llama_dir: Path) -> None:
    """The same outputs with a small KV pool (preemption by recompute), small chunks and a shared prefix."""
    shared = random_prompts(1, 512, seed=6, min_len=24, max_len=24)[0]
    prompts = [shared + tail for tail in random_prompts(6, 512, seed=7, max_len=12)]
    requests = {
        f"r{i}": (p, guided("regex", "[a-z ]{60}" if i % 2 else REGEX + " [a-z]{50}", max_tokens=70))
        for i, p in enumerate(prompts)
    }
    requests |= {"s": (prompts[0], guided("json_schema", json.dumps(SCHEMA), max_tokens=70))}
    reference = run(make_engine(tiny_llama_dir, enable_prefix_caching=False), requests)
    tight = make_engine(tiny_llama_dir, num_kv_blocks=32, max_num_batched_tokens=16)
    results = run(tight, requests)
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    for rid, result in results.items():
        assert result.tokens == reference[rid].tokens, rid
        assert result.finish_reason is reference[rid].finish_reason is FinishReason.STOP


def test_cancelled_guided_request_frees_its_blocks_and_others_finish(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    prompts = random_prompts(3, 512, seed=8, max_len=20)
    expected = run(make_engine(tiny_llama_dir), {"keep": (prompts[1], guided("regex", REGEX))})["keep"]
    engine.add_request("cancel", prompts[0], guided("regex", "[a-z]{40}"))
    engine.add_request("keep", prompts[1], guided("regex", REGEX))
    kept: list[int] = []
    for _ in range(3):
        kept += [t for out in engine.step() if out.request_id == "keep" for t in out.new_token_ids]
    final = engine.abort("cancel")
    assert final is not None and final.finish_reason is FinishReason.ABORT
    while engine.has_unfinished():
        kept += [t for out in engine.step() for t in out.new_token_ids]
    assert kept == expected.tokens
    assert engine.stats().kv_blocks_used == 0


def test_a_grammar_with_no_allowed_token_fails_only_its_request(tiny_llama_dir: Path) -> None:
    """Bad words that ban the only token the grammar allows: that request fails with an error."""
    x = load_tokenizer(tiny_llama_dir).encode("x", add_special_tokens=False)
    assert len(x) == 1
    engine = make_engine(tiny_llama_dir)
    plain = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    results = run(
        engine, {"stuck": ([5, 6], guided("regex", "x", bad_token_ids=[x])), "plain": ([5, 6], plain)}
    )
    assert results["stuck"].finish_reason is FinishReason.ERROR
    assert "guided decoding" in (results["stuck"].error or "")
    assert results["plain"].finish_reason is FinishReason.LENGTH and len(results["plain"].tokens) == 5


# The real default model: a JSON schema gives valid, useful answers.

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PERSON_PROMPTS = [
    "Describe a fictional person as JSON with name, age and city.",
    "Alice is 30 and lives in Paris. Give her details as JSON.",
    "Return a JSON object for Bob, a 45 year old from Berlin.",
    "Invent a character for a novel and describe them in JSON.",
    "Who is the main character of your favourite story? Answer in JSON.",
    "Give me a JSON record of a person living in Tokyo.",
]


@pytest.mark.slow
def test_smollm2_greedy_outputs_validate_against_a_json_schema(smollm2_dir: Path) -> None:
    engine = make_engine(smollm2_dir, num_kv_blocks=512, tokens_per_block=16, num_threads=None)
    tokenizer = load_tokenizer(smollm2_dir)
    schema = json.dumps(PERSON)
    requests = {
        str(i): (encode_prompt(tokenizer, p, chat=True), guided("json_schema", schema, max_tokens=80))
        for i, p in enumerate(PERSON_PROMPTS)
    }
    requests["any"] = (encode_prompt(tokenizer, PERSON_PROMPTS[0], chat=True), guided("json", None, 80))
    values = {}
    for rid, result in run(engine, requests).items():
        text = tokenizer.decode(result.tokens, skip_special_tokens=True)
        assert result.finish_reason is FinishReason.STOP, (rid, text)
        values[rid] = json.loads(text)
        if rid == "any":
            assert isinstance(values[rid], (dict, list))  # guide type `json`: object or array
        else:
            jsonschema.validate(values[rid], PERSON)
    assert values["1"]["name"] == "Alice" and values["1"]["age"] == 30  # the answer follows the prompt


@pytest.mark.slow
def test_smollm2_regex_and_ebnf_outputs_match(smollm2_dir: Path) -> None:
    engine = make_engine(smollm2_dir, num_kv_blocks=512, tokens_per_block=16, num_threads=None)
    tokenizer = load_tokenizer(smollm2_dir)
    year = encode_prompt(tokenizer, "In which year did the first man land on the moon?", chat=True)
    yes_no = encode_prompt(tokenizer, "Is Paris the capital of France? Answer yes or no.", chat=True)
    results = run(
        engine,
        {
            "year": (year, guided("regex", r"(19|20)[0-9]{2}", max_tokens=8)),
            "yes_no": (yes_no, guided("ebnf_grammar", 'root ::= ("yes" | "no") "."', max_tokens=8)),
        },
    )
    texts = {rid: tokenizer.decode(r.tokens, skip_special_tokens=True) for rid, r in results.items()}
    assert re.fullmatch(r"(19|20)[0-9]{2}", texts["year"]), texts
    assert texts["yes_no"] in ("yes.", "no."), texts
    assert all(r.finish_reason is FinishReason.STOP for r in results.values())
