"""The front door's parts without a server: keys and auth rules, token buckets, the concurrency gate,
stop strings, request validation (with a real trained tokenizer) and response objects."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from tiny_model import build_tokenizer
from tritonllm_client.results import Piece

from tritonllm.openai.config import KEYS_ENV, FrontDoorConfig, KeyLimits, load_keys
from tritonllm.openai.errors import APIError
from tritonllm.openai.limits import ConcurrencyGate, KeyLimiter, TokenBucket
from tritonllm.openai.output import Delta, OutputAssembler, StopFilter
from tritonllm.openai.protocol import PromptEncoder, RequestTranslator
from tritonllm.openai.responses import ResponseBuilder

# Keys and auth.


def test_keys_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(
        json.dumps(
            {
                "tiers": {"gold": -1, "standard": 1},
                "keys": [{"key": "sk-a", "name": "alice", "tier": "gold", "requests_per_minute": 60}],
            }
        )
    )
    store = load_keys(path, {KEYS_ENV: "sk-b, sk-c:gold"})
    assert [(k.key, k.tier) for k in store.keys] == [("sk-a", "gold"), ("sk-b", "standard"), ("sk-c", "gold")]
    assert store.keys[0].limits.requests_per_minute == 60
    assert store.priority("gold") == -1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"keys": [{"key": "sk-a", "tier": "platinum"}]}, "tier 'platinum'"),
        ({"keys": [{"key": "sk-a"}, {"key": "sk-a"}]}, "listed twice"),
        ({"keys": [{"key": "sk-a", "rpm": 5}]}, "unknown field"),
        ({"keys": [{"key": "sk-a", "max_concurrency": 0}]}, "max_concurrency"),
    ],
)
def test_bad_keys_files_are_refused_with_the_reason(tmp_path: Path, content: dict, message: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load_keys(path, {})


def test_keys_are_off_on_loopback_and_required_beyond_it() -> None:
    assert not FrontDoorConfig(tokenizer_dir="m", host="127.0.0.1").auth_required
    with pytest.raises(ValueError, match="needs API keys"):
        FrontDoorConfig(tokenizer_dir="m", host="0.0.0.0")
    keys = load_keys(None, {KEYS_ENV: "sk-a"})
    assert FrontDoorConfig(tokenizer_dir="m", host="0.0.0.0", keys=keys).auth_required
    assert FrontDoorConfig(tokenizer_dir="m", host="127.0.0.1", keys=keys).auth_required  # keys given: used
    assert not FrontDoorConfig(tokenizer_dir="m", host="0.0.0.0", require_keys=False).auth_required


# Limits.


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_refills_at_its_rate_up_to_capacity() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=10, capacity=5, clock=clock)
    assert all(bucket.take(1) == 0 for _ in range(5))
    assert bucket.take(1) == pytest.approx(0.1)
    clock.now = 0.35
    assert [bucket.take(1) for _ in range(4)][:3] == [0, 0, 0]
    clock.now = 100
    assert bucket.take(5) == 0 and bucket.take(1) > 0  # never more than the capacity


def test_key_limiter_rejects_with_retry_after_and_refunds_unused_tokens() -> None:
    clock = FakeClock()
    limiter = KeyLimiter(KeyLimits(requests_per_minute=60, tokens_per_minute=600, burst_s=1), clock)
    limiter.admit_request()
    with pytest.raises(APIError) as info:
        limiter.admit_request()
    assert info.value.status == 429 and info.value.headers() == {"Retry-After": "1"}
    assert info.value.reason == "requests_per_minute"
    limiter.reserve_tokens(10)  # the whole 1 s burst
    with pytest.raises(APIError, match="tokens/min"):
        limiter.reserve_tokens(1)
    limiter.refund_tokens(4)
    limiter.reserve_tokens(4)
    with pytest.raises(APIError, match="holds at most 10") as info:
        limiter.reserve_tokens(11)
    assert info.value.param == "max_tokens"


def test_concurrency_gate_queues_bounded_and_times_out() -> None:
    async def run() -> list[str]:
        gate = ConcurrencyGate(limit=1, max_queue=1, timeout_s=0.2)
        events: list[str] = []
        release = asyncio.Event()

        async def holder() -> None:
            async with gate.slot():
                events.append("holder in")
                await release.wait()

        async def waiter(name: str) -> None:
            try:
                async with gate.slot():
                    events.append(f"{name} in")
            except APIError as exc:
                events.append(f"{name} {exc.reason}")

        held = asyncio.create_task(holder())
        await asyncio.sleep(0)
        queued = asyncio.create_task(waiter("second"))
        await asyncio.sleep(0)
        await waiter("third")  # the queue (1) is full
        await queued  # times out after 0.2 s: the holder never lets go
        release.set()
        await held
        await waiter("fourth")
        return events

    assert asyncio.run(run()) == ["holder in", "third queue_full", "second queue_timeout", "fourth in"]


# Stop strings and output.


def test_stop_filter_holds_back_a_possible_stop_and_cuts_at_it() -> None:
    stop = StopFilter(("END",))
    assert stop.push("abc E") == ("abc ", False)  # "E" may start "END"
    assert stop.push("x") == ("Ex", False)
    assert stop.push("yEN") == ("y", False)
    assert stop.push("D and more") == ("", True)
    assert StopFilter(()).push("END") == ("END", False)


def _piece(text: str, tokens: int, reason: str | None = None) -> Piece:
    return Piece(text, tokens, [-0.5] * tokens, None, reason, 0.0)


def test_output_assembler_counts_every_token_and_reports_stop() -> None:
    out = OutputAssembler(("!",), max_tokens=10, want_logprobs=True)
    assert out.add(_piece("Hi", 1)).text == "Hi"
    assert out.add(_piece(" there! x", 2)).text == " there"
    assert out.add(_piece("ignored", 1)).text == ""
    assert (out.text, out.completion_tokens, out.finish_reason) == ("Hi there", 3, "stop")
    assert out.token_texts == ["Hi", " there! x", ""] and out.logprobs == [-0.5] * 3
    unlimited = OutputAssembler((), max_tokens=2, want_logprobs=False)
    unlimited.add(Piece("ab", None, [], None, None, 0.0))  # a server without token counts: 1 per response
    unlimited.add(Piece("c", None, [], None, None, 0.0))
    assert unlimited.completion_tokens == 2 and unlimited.finish_reason == "length"


# Requests.


@pytest.fixture(scope="module")
def translator() -> RequestTranslator:
    return RequestTranslator(PromptEncoder(build_tokenizer(add_bos=True)), max_model_len=64, served_model="m")


def _param_of(call) -> tuple[int, str | None]:
    with pytest.raises(APIError) as info:
        call()
    return info.value.status, info.value.param


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "a", "n": 2}, 400, "n"),
        ({"prompt": "a", "best_of": 2}, 400, "best_of"),
        ({"prompt": "a", "logit_bias": {"5": 1}}, 400, "logit_bias"),
        ({"prompt": "a", "suffix": "z"}, 400, "suffix"),
        ({"prompt": "a", "logprobs": 3}, 400, "logprobs"),
        ({"prompt": [1, 2, 3]}, 400, "prompt"),
        ({"prompt": ["a", "b"]}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "a", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "a", "top_p": 0}, 400, "top_p"),
        ({"prompt": "a", "seed": -1}, 400, "seed"),
        ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "a", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
        ({"prompt": "a", "stop": ["", "x"]}, 400, "stop"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": "a", "mystery": 1}, 400, "mystery"),
        ({"prompt": "fox " * 80}, 400, "prompt"),
        ({"prompt": "a", "max_tokens": 100}, 400, "max_tokens"),
        ({"prompt": "a", "model": "other"}, 404, "model"),
    ],
)
def test_completion_errors_name_the_parameter(translator, body: dict, status: int, param: str) -> None:
    assert _param_of(lambda: translator.completion({"model": "m", **body})) == (status, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2, "logprobs": True},
            "top_logprobs",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format",
        ),
    ],
)
def test_chat_errors_name_the_parameter(translator, body: dict, param: str) -> None:
    assert _param_of(lambda: translator.chat({"model": "m", **body})) == (400, param)


def test_requests_translate_to_bls_inputs(translator) -> None:
    completion = translator.completion(
        {
            "model": "m",
            "prompt": "The fox",
            "max_tokens": 5,
            "temperature": 0,
            "stop": "x",
            "ignore_eos": True,
        }
    )
    assert completion.inputs == {
        "text_input": "The fox",
        "max_tokens": 5,
        "temperature": 0.0,
        "top_p": 1.0,
        "min_tokens": 5,
        "stop_words": ["x"],
        "exclude_input_in_output": True,
        "stream": True,
    }
    assert completion.prompt_tokens == len(translator.encoder.tokenizer("The fox")["input_ids"])
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    chat = translator.chat(
        {
            "model": "m",
            "messages": messages,
            "max_completion_tokens": 3,
            "seed": 7,
            "top_k": 2,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        }
    )
    tokenizer = translator.encoder.tokenizer
    rendered = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected_ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
    assert tokenizer(chat.prompt)["input_ids"] == list(expected_ids)  # one BOS, as the BLS's chat path
    assert chat.max_tokens == 3 and chat.inputs["seed"] == 7 and chat.inputs["top_k"] == 2
    assert chat.inputs["guided_decoding_guide_type"] == "json_schema"
    assert json.loads(chat.inputs["guided_decoding_guide"]) == {"type": "object"}
    default = translator.chat({"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
    assert default.max_tokens == 64 - default.prompt_tokens  # chat: up to the context length


def test_stream_chunks_follow_openai_shapes() -> None:
    builder = ResponseBuilder("chat", "m", logprobs=True)
    first = builder.chunk(Delta(""), first=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    piece = builder.chunk(Delta("é", [-0.25], ["é"]))
    assert piece["choices"][0]["logprobs"]["content"][0] == {
        "token": "é",
        "logprob": -0.25,
        "bytes": [195, 169],
        "top_logprobs": [],
    }
    assert builder.usage_chunk({"prompt_tokens": 1})["choices"] == []
    completion = ResponseBuilder("completion", "m", logprobs=True)
    completion.chunk(Delta("ab", [-1.0], ["ab"]))
    assert completion.chunk(Delta("c", [-2.0], ["c"]))["choices"][0]["logprobs"]["text_offset"] == [2]


def test_request_deadline_raises_at_the_next_piece_and_closes_the_stream() -> None:
    from tritonllm.openai.app import _until

    closed = []

    async def slow_pieces():
        try:
            yield _piece("a", 1)
            await asyncio.Event().wait()  # a generation that never sends its next piece
            yield _piece("b", 1)
        finally:
            closed.append(True)

    async def run() -> list[str]:
        loop = asyncio.get_running_loop()
        seen = []
        with pytest.raises(TimeoutError):
            async for piece in _until(slow_pieces(), loop.time() + 0.2):
                seen.append(piece.text)
        return seen

    assert asyncio.run(run()) == ["a"]
    assert closed == [True]  # the inner stream (the gRPC call) was closed
