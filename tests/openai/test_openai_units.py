"""The front door's parts without a server: keys and auth rules, token buckets, the concurrency gate,
stop strings, request validation (with a real trained tokenizer), forced tool calls, tool-loop turns
(validation and rendering) and response objects."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from tiny_model import build_tokenizer
from tritonllm_client.results import Piece

from tritonllm.openai.app import _Events
from tritonllm.openai.config import KEYS_ENV, FrontDoorConfig, KeyLimits, load_keys
from tritonllm.openai.errors import APIError
from tritonllm.openai.limits import ConcurrencyGate, KeyLimiter, TokenBucket
from tritonllm.openai.output import Delta, OutputAssembler, StopFilter
from tritonllm.openai.protocol import PromptEncoder, RequestTranslator
from tritonllm.openai.responses import ResponseBuilder
from tritonllm.openai.server import new_event_loop
from tritonllm.openai.tools import NO_PARAMETERS, tool_plan
from tritonllm.openai.triton import TritonBackend, build_request, input_array
from tritonllm.triton.models.engine_link import infer_request
from tritonllm.triton.text_requests import TEXT_OUTPUTS

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


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_front_door_timeouts_must_be_finite_and_positive(value: float) -> None:
    for name in ("request_timeout_s", "connect_timeout_s"):
        with pytest.raises(ValueError, match=name):
            FrontDoorConfig(tokenizer_dir="m", **{name: value})


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
        ({"prompt": "a", "temperature": 10**400}, 400, "temperature"),  # too large for a float
        ({"prompt": "a", "temperature": float("nan")}, 400, "temperature"),
        ({"prompt": "a", "seed": 10**400}, 400, "seed"),
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
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2, "logprobs": True},
            "top_logprobs",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": "not an object"},
            },
            "response_format.json_schema.schema",
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


def test_json_object_response_format_forces_an_object(translator) -> None:
    """OpenAI's `json_object` means an object: a `{"type": "object"}` schema, not guide type `json`
    (which, as TensorRT-LLM's, also allows a top-level array)."""
    chat = translator.chat({"model": "m", "messages": HI, "response_format": {"type": "json_object"}})
    assert chat.inputs["guided_decoding_guide_type"] == "json_schema"
    assert json.loads(chat.inputs["guided_decoding_guide"]) == {"type": "object"}


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


# Tool calls.

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "ping"}},  # no parameters: arguments are exactly {}
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def wide() -> RequestTranslator:
    """Room for a system note describing the tools."""
    return RequestTranslator(
        PromptEncoder(build_tokenizer(add_bos=True)), max_model_len=512, served_model="m"
    )


def test_named_tool_choice_becomes_the_tools_schema_guide_and_a_system_note(wide) -> None:
    gen = wide.chat({"model": "m", "messages": HI, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 8})
    assert gen.inputs["guided_decoding_guide_type"] == "json_schema"
    assert json.loads(gen.inputs["guided_decoding_guide"]) == WEATHER
    assert gen.tools is not None and gen.tools.name == "get_weather"
    assert gen.tools.param == "tools[0].function.parameters"
    # The tiny template has no `tools` variable: the function and its schema go in a system note.
    assert not wide.encoder.template_has_tools
    assert gen.prompt.startswith("system\nCall the function get_weather (Weather). Reply with its arguments")
    assert json.dumps(WEATHER) in gen.prompt and "ping" not in gen.prompt
    plain = wide.chat({"model": "m", "messages": HI, "tools": TOOLS, "tool_choice": "none", "max_tokens": 8})
    assert (
        plain.tools is None
        and "guided_decoding_guide" not in plain.inputs
        and "get_weather" not in plain.prompt
    )


def test_required_tool_choice_is_an_any_of_over_name_and_parameters(wide) -> None:
    gen = wide.chat(
        {"model": "m", "messages": HI, "tools": TOOLS, "tool_choice": "required", "max_tokens": 8}
    )
    schema = json.loads(gen.inputs["guided_decoding_guide"])
    branches = schema["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [{"const": "get_weather"}, {"const": "ping"}]
    assert [b["properties"]["parameters"] for b in branches] == [WEATHER, NO_PARAMETERS]
    assert all(
        b["required"] == ["name", "parameters"] and b["additionalProperties"] is False for b in branches
    )
    assert gen.tools.param == "tools" and "get_weather" in gen.prompt and "ping" in gen.prompt


def test_a_template_with_tools_renders_them_instead_of_the_note() -> None:
    tokenizer = build_tokenizer(add_bos=True)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}tool {{ t['function']['name'] }}\n{% endfor %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    encoder = PromptEncoder(tokenizer)
    assert encoder.template_has_tools
    gen = RequestTranslator(encoder, 64, "m").chat(
        {"model": "m", "messages": HI, "tools": TOOLS, "tool_choice": NAMED}
    )
    assert gen.prompt.startswith("tool get_weather\ntool ping\nuser: Hi")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tools": TOOLS}, "tool_choice"),  # "auto" is OpenAI's default when tools are sent
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": {"get_weather": WEATHER}, "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
            "tools[0].function.name",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}], "function_call": {"name": "f"}}, "functions"),
        ({"function_call": "auto"}, "function_call"),
    ],
)
def test_tool_errors_name_the_parameter(wide, extra: dict, param: str) -> None:
    assert _param_of(lambda: wide.chat({"model": "m", "messages": HI, **extra})) == (400, param)


def _join(deltas: list[dict]) -> str:
    return "".join(d["function"]["arguments"] for d in deltas)


@pytest.mark.parametrize("cuts", [1, 3, 7, 100])
def test_tool_call_stream_deltas_join_to_the_whole_call(cuts: int) -> None:
    required = tool_plan({"tools": TOOLS, "tool_choice": "required"})
    named = tool_plan({"tools": TOOLS, "tool_choice": NAMED})
    cases = [
        (named, '{"city": "Pa}ris "}', "get_weather", '{"city": "Pa}ris "}'),
        (
            required,
            '{"name": "get_weather", "parameters": {"city": "Pa}ris"}}',
            "get_weather",
            '{"city": "Pa}ris"}',
        ),
        (required, '{"name": "ping", "parameters": {}}', "ping", "{}"),
    ]
    for plan, text, name, arguments in cases:
        stream = plan.stream()
        deltas = stream.opening()
        for i in range(0, len(text), cuts):
            deltas += stream.push(text[i : i + cuts])
        deltas += stream.finish(complete=True)
        assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == name
        assert deltas[0]["type"] == "function" and all(set(d) == {"index", "function"} for d in deltas[1:])
        assert _join(deltas) == arguments
        whole = plan.stream()
        whole.push(text)
        assert whole.whole(complete=True)[0]["function"] == {"name": name, "arguments": arguments}
    assert required.stream().finish_reason("stop") == "stop"  # no call read: not "tool_calls"


def test_tool_call_cut_by_max_tokens_keeps_the_partial_arguments() -> None:
    required = tool_plan({"tools": TOOLS, "tool_choice": "required"})
    stream = required.stream()
    stream.push('{"name": "get_weather", "parameters": {"city": "Par')
    calls = stream.whole(complete=False)
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert stream.finish_reason("length") == "length" and stream.finish_reason("stop") == "tool_calls"
    headless = required.stream()
    headless.push('{"name": "get_w')
    assert headless.whole(complete=False) is None  # no name yet: the text is returned as content


def test_tool_call_response_shapes() -> None:
    builder = ResponseBuilder("chat", "m", logprobs=False)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    whole = builder.whole("{}", "stop", [], [], {"prompt_tokens": 1}, [call])
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [call]}
    first = builder.chunk(Delta(""), first=True, tool_calls=[{"index": 0, **call}])
    assert first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"index": 0, **call}],
    }
    later = builder.chunk(Delta('{"a'), tool_calls=[{"index": 0, "function": {"arguments": '{"a'}}])
    assert later["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a'}}]}


# Tool-loop turns: the call sent back, then its result.

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},  # as the openai SDK sends it back
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C, sunny"}]},
]


def test_tool_loop_turns_become_plain_text_for_a_template_without_tool_support(wide) -> None:
    assert not wide.encoder.template_has_tool_turns  # the tiny template, like SmolLM2's
    two = {**CALL, "id": "call_2", "function": {"name": "ping", "arguments": "{}"}}
    messages = [
        LOOP[0],
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, two]},
        {"role": "tool", "tool_call_id": "call_2", "content": "pong"},  # any order within the turn
        LOOP[2],
        {"role": "assistant", "content": "It is 18 C."},
        {"role": "user", "content": "Thanks"},
    ]
    gen = wide.chat({"model": "m", "messages": messages, "max_tokens": 8})
    assert gen.prompt == (
        "user\nWeather in Paris?</s>\n"
        '<s>assistant\nChecking.\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
        '{"name": "ping", "parameters": {}}</s>\n'
        "<s>user\nResult of ping: pong\nResult of get_weather: 18 C, sunny</s>\n"
        "<s>assistant\nIt is 18 C.</s>\n<s>user\nThanks</s>\n<s>assistant\n"
    )  # the tokenizer's own BOS comes first, as for any chat prompt
    assert gen.prompt_tokens == wide.encoder.count(gen.prompt)
    cut = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}  # cut by max_tokens
    messages = [LOOP[0], {"role": "assistant", "tool_calls": [cut]}, LOOP[2]]
    assert (
        '{"name": "get_weather", "parameters": "{\\"city\\": \\"Pa"}'
        in wide.chat({"model": "m", "messages": messages, "max_tokens": 8}).prompt
    )


def test_a_template_with_tool_turns_renders_calls_and_results() -> None:
    tokenizer = build_tokenizer(add_bos=True)
    tokenizer.chat_template = (  # the shape of Qwen2.5's: calls with their arguments as JSON, tool results
        "{% for m in messages %}{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>\n"
        "{% elif m.tool_calls %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls %}"
        "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}\n"
        "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    )
    encoder = PromptEncoder(tokenizer)
    assert encoder.template_has_tool_turns
    gen = RequestTranslator(encoder, 256, "m").chat({"model": "m", "messages": LOOP, "max_tokens": 8})
    # (HF's trim_blocks drops the newline after the calls' endfor.)
    assert gen.prompt == (
        "user: Weather in Paris?\n"
        'assistant: <tool_call>get_weather {"city": "Paris"}</tool_call>'
        "<tool_response>18 C, sunny</tool_response>\n"
    )


def _with(index: int, **fields) -> list[dict]:
    messages = [dict(m) for m in LOOP]
    messages[index] = {k: v for k, v in {**messages[index], **fields}.items() if v is not ...}
    return messages


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (_with(2, tool_call_id="call_9"), "messages[2].tool_call_id"),  # matches no earlier call
        (_with(2, tool_call_id=...), "messages[2].tool_call_id"),  # missing
        ([LOOP[0], LOOP[2]], "messages[1].tool_call_id"),  # no call before it
        ([*LOOP, LOOP[2]], "messages[3].tool_call_id"),  # answered twice
        ([*LOOP[:2], LOOP[0]], "messages[1].tool_calls"),  # a call never answered
        (LOOP[:2], "messages[1].tool_calls"),
        (_with(1, tool_calls=[{**CALL, "id": ...}]), "messages[1].tool_calls[0].id"),
        (_with(1, tool_calls=[{**CALL, "type": "code"}]), "messages[1].tool_calls[0].type"),
        (
            _with(1, tool_calls=[{**CALL, "function": {"name": "f"}}]),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (_with(1, tool_calls={"id": "call_1"}), "messages[1].tool_calls"),
        (
            [*LOOP, {"role": "assistant", "content": None, "tool_calls": [CALL]}],
            "messages[3].tool_calls[0].id",
        ),
        (_with(0, tool_calls=[CALL]), "messages[0].tool_calls"),  # only assistant messages carry calls
        (_with(1, tool_calls=None), "messages[1].content"),  # null content needs tool_calls
        (_with(2, content=None), "messages[2].content"),
        (_with(1, function_call={"name": "f", "arguments": "{}"}), "messages[1].function_call"),
    ],
)
def test_tool_turn_errors_name_the_message_and_field(wide, messages: list[dict], param: str) -> None:
    assert _param_of(lambda: wide.chat({"model": "m", "messages": messages})) == (400, param)


# The gRPC messages, built and read without tritonclient's tensors: the same bytes and Pieces.


def test_grpc_request_is_the_one_tritonclient_builds() -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc._utils import _get_inference_request
    from tritonllm_client.transport import grpc_tensor

    from tritonllm.openai.triton import build_request

    inputs = {
        "text_input": "héllo <|im_start|>",
        "max_tokens": 5,
        "temperature": 0.7,
        "top_p": 1.0,
        "seed": 2**64 - 1,
        "priority": -3,
        "stop_words": ["a", "bç"],
        "stream": True,
        "exclude_input_in_output": False,
        "guided_decoding_guide": "",
    }
    outputs = ["finish_reason", "num_output_tokens", "text_output"]
    ours = build_request("tensorrt_llm_bls", inputs, outputs, "req-1")
    theirs = _get_inference_request(  # what tritonclient's stream_infer sends for the same request
        model_name="tensorrt_llm_bls",
        inputs=[grpc_tensor(n, v) for n, v in inputs.items()],
        model_version="",
        request_id="req-1",
        outputs=[grpcclient.InferRequestedOutput(n) for n in outputs],
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        parameters=None,
    )
    assert ours == theirs
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)


def _response(outputs: dict, typed: bool = False):
    import numpy as np
    from tritonclient.grpc import service_pb2

    response = service_pb2.ModelInferResponse(model_name="m", id="r")
    for name, (datatype, values) in outputs.items():
        tensor = response.outputs.add(name=name, datatype=datatype, shape=[len(values)])
        if datatype == "BYTES":
            if typed:
                tensor.contents.bytes_contents.extend(v.encode() for v in values)
            else:
                raw = b"".join(len(v.encode()).to_bytes(4, "little") + v.encode() for v in values)
                response.raw_output_contents.append(raw)  # Triton's layout: a 4-byte length per element
        else:
            dtype = {"UINT32": np.uint32, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}[
                datatype
            ]
            response.raw_output_contents.append(np.array(values, dtype=dtype).tobytes())
    return response


@pytest.mark.parametrize(
    ("outputs", "typed"),
    [
        ({"text_output": ("BYTES", [" Paris"]), "num_output_tokens": ("UINT32", [2])}, False),
        (
            {
                "text_output": ("BYTES", ["é"]),
                "finish_reason": ("BYTES", ["length"]),
                "num_output_tokens": ("UINT32", [1]),
                "cum_log_probs": ("FP32", [-1.25]),
                "output_log_probs": ("FP32", [-0.5, -0.75]),
            },
            False,
        ),
        ({"text_output": ("BYTES", []), "finish_reason": ("BYTES", [""])}, False),  # empty text: ""
        ({"text_output": ("BYTES", ["x"]), "output_log_probs": ("FP32", [-0.5, -0.25])}, False),  # no count
        ({"text_output": ("BYTES", ["x"]), "num_output_tokens": ("INT32", [3])}, False),
        ({"text_output": ("BYTES", ["x"]), "num_output_tokens": ("UINT64", [2**40])}, False),
        ({"text_output": ("BYTES", ["x"]), "finish_reason": ("BYTES", ["stop"])}, True),  # typed contents
    ],
)
def test_grpc_responses_read_as_tritonclient_reads_them(outputs: dict, typed: bool) -> None:
    from dataclasses import replace

    from tritonclient.grpc import InferResult
    from tritonllm_client.results import piece_from_outputs

    from tritonllm.openai.triton import read_piece

    response = _response(outputs, typed)
    result = InferResult(response)
    expected = piece_from_outputs({o.name: result.as_numpy(o.name) for o in response.outputs})
    ours = read_piece(response)
    assert replace(ours, received_s=0.0) == replace(expected, received_s=0.0)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_content_events_are_the_chunks_bytes(kind: str) -> None:
    from tritonllm.openai.responses import sse

    builder = ResponseBuilder(kind, 'm "quoted"', logprobs=True)
    for text in [" Paris", 'a "b" \\ c\n', "é🙂", "\x00", "</s>"]:
        assert builder.content_event(text) == sse(builder.chunk(Delta(text)))


def test_prompt_tokens_are_counted_as_the_tokenizer_counts_them(translator) -> None:
    encoder = translator.encoder
    assert encoder._backend is not None  # the fast path is taken for a fast tokenizer
    for text in ["", "The fox", "<s>user\nHi</s>\n<s>assistant\n", "ünïcode  \t 🙂 " * 5]:
        assert encoder.count(text) == len(encoder.tokenizer(text)["input_ids"])


class _FakeBackend:
    """Pieces as Triton's BLS streams them: one token each, the last with its finish reason."""

    def __init__(self, texts: list[str], stall: bool = False):
        self.texts = texts
        self.stall = stall  # after the texts, never send the last piece
        self.inputs: list[dict] = []

    async def generate(self, inputs: dict, priority: int, request_id: str):
        self.inputs.append(inputs)
        for i, text in enumerate(self.texts):
            last = i == len(self.texts) - 1 and not self.stall
            yield Piece(text, 1, [], None, "length" if last else None, 0.0)
        if self.stall:
            await asyncio.Event().wait()

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def _sse_events(body: bytes) -> list:
    events = [line[len(b"data: ") :] for line in body.split(b"\n\n") if line]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


@pytest.mark.parametrize("stop", [None, "cd"])
def test_streamed_chat_events_through_the_app(stop: str | None) -> None:
    """The whole streamed answer through the aiohttp app with a fake backend: role chunk, a chunk per
    token, finish chunk, usage, [DONE]; the writes are gathered, the events are OpenAI's."""
    from aiohttp.test_utils import TestClient, TestServer

    from tritonllm.openai.app import FrontDoor

    config = FrontDoorConfig(tokenizer_dir="m", served_model_name="m", max_model_len=64)
    backend = _FakeBackend(["ab", "c", "de", "f"])
    door = FrontDoor(config, build_tokenizer(add_bos=True), backend=backend)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": stop,
    }

    async def run() -> tuple[int, dict, bytes]:
        async with TestClient(TestServer(door.app())) as client:
            response = await client.post("/v1/chat/completions", json=body)
            return response.status, dict(response.headers), await response.read()

    status, headers, raw = asyncio.run(run())
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    finish, use = chunks[-2], chunks[-1]
    if stop is None:
        assert deltas == ["ab", "c", "de", "f"]
        assert finish["choices"][0]["finish_reason"] == "length"
        assert use["usage"]["completion_tokens"] == 4
    else:  # "c" is held back until "de" shows it starts the stop string; the text ends before it
        assert deltas == ["ab"]
        assert finish["choices"][0]["finish_reason"] == "stop"
        assert use["usage"]["completion_tokens"] == 3
    assert finish["choices"][0]["delta"] == {} and use["choices"] == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_deadline_gets_the_same_504_body_whole_or_streamed(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A streamed request that times out after its headers ends with the same error as a whole one:
    code `timeout`, the limit in the message, then [DONE]. Both are logged, as every 5xx is."""
    from aiohttp.test_utils import TestClient, TestServer

    from tritonllm.openai.app import FrontDoor

    config = FrontDoorConfig(
        tokenizer_dir="m", served_model_name="m", max_model_len=64, request_timeout_s=0.3
    )
    door = FrontDoor(config, build_tokenizer(add_bos=True), backend=_FakeBackend(["ab"], stall=True))
    body = {"model": "m", "prompt": "Hi", "max_tokens": 4, "stream": stream}

    async def run() -> tuple[int, bytes]:
        async with TestClient(TestServer(door.app())) as client:
            response = await client.post("/v1/completions", json=body)
            return response.status, await response.read()

    with caplog.at_level(logging.ERROR, logger="tritonllm.openai.app"):
        status, raw = asyncio.run(run())
    assert [r.getMessage() for r in caplog.records] == [
        "answered 504 (timeout): the request did not finish within 0.3s"
    ]
    expected = {
        "message": "the request did not finish within 0.3s",
        "type": "server_error",
        "param": None,
        "code": "timeout",
    }
    if not stream:
        assert status == 504 and json.loads(raw) == {"error": expected}
        return
    events = _sse_events(raw)
    assert status == 200 and events[0]["choices"][0]["text"] == "ab"
    assert events[1:] == [{"error": expected}, "[DONE]"]


class _StalledResponse:
    """An SSE response whose client stopped reading: a write waits for a drain that never comes."""

    async def write(self, data: bytes) -> None:
        await asyncio.Event().wait()


class _Transport:
    aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_a_write_to_a_client_that_stopped_reading_is_bounded_and_aborts_the_connection() -> None:
    """Else such a client holds its generation and concurrency slot for ever; the error is a
    ConnectionResetError, so the stream ends as for a client that went away (the engine cancels)."""
    request = type("Request", (), {"transport": _Transport()})()
    events = _Events(request, _StalledResponse(), write_timeout_s=0.05)  # type: ignore[arg-type]
    events.add_bytes(b"data: {}\n\n")

    async def flush() -> None:
        async with asyncio.timeout(10):  # the test's own bound, far above the write's
            await events.flush()

    with pytest.raises(ConnectionResetError, match="read nothing for 0.05s"):
        asyncio.run(flush())
    assert request.transport.aborted


def test_front_door_loop_is_uvloop_where_installed_else_asyncio(monkeypatch):
    loop = new_event_loop()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now fails, as where it has no wheel
    loop = new_event_loop()
    try:
        assert not type(loop).__module__.startswith("uvloop")
        assert loop.run_until_complete(asyncio.sleep(0, result="ran")) == "ran"
    finally:
        loop.close()


def test_an_unhealthy_python_stub_is_503_with_retry_after() -> None:
    """Triton's Python backend fails the request it was handing to a stub that missed its health check
    (seen twice in ~3,000 front-door requests on a loaded 2-core machine): the engine never saw it, so
    the caller gets a retryable 503, not a 500."""
    from tritonllm_client.errors import classify

    from tritonllm.openai.triton import api_error

    error = api_error(classify("Stub process 'tensorrt_llm_bls_0_0' is not healthy.", "m"), 2.0)
    assert (error.status, error.code, error.headers()) == (503, "backend_unavailable", {"Retry-After": "2"})


def test_engine_inputs_travel_as_the_bls_inputs_would() -> None:
    """Straight into `tensorrt_llm`, the front door's values become the arrays `input_tensor` sends."""
    inputs = {"text_input": "hi", "stop_words": ["a", "bc"], "stream": True, "max_tokens": 4, "seed": 7}
    inputs["top_p"] = 0.5
    outputs = ["text_output", "num_output_tokens"]
    arrays = {name: input_array(name, value) for name, value in inputs.items()}
    assert infer_request("m", "id", arrays, outputs) == build_request("m", inputs, outputs, "id")


def test_engine_request_errors_name_the_parameter(tiny_llama_dir: Path) -> None:
    """A request `tensorrt_llm`'s text code refuses is the caller's 400, naming the OpenAI parameter."""

    async def requests() -> tuple[Any, APIError]:
        backend = TritonBackend("127.0.0.1:1", "tensorrt_llm", 1.0, 1.0, tokenizer_dir=str(tiny_llama_dir))
        text = await backend._text_requests()
        good = backend._engine_request(text, {"text_input": "hi", "max_tokens": 4}, ["finish_reason"], "id")
        with pytest.raises(APIError) as info:
            backend._engine_request(text, {"text_input": "", "max_tokens": 4}, [], "id")
        await backend.close()
        return good, info.value

    request, error = asyncio.run(requests())
    assert {"request_output_len", "input_ids", "input_lengths"} <= {t.name for t in request.inputs}
    assert [o.name for o in request.outputs] == [*TEXT_OUTPUTS, "finish_reason"]
    assert error.status == 400 and error.param == "prompt", error


def test_a_token_id_model_without_context_ids_is_refused_clearly(tiny_llama_dir: Path) -> None:
    """NVIDIA's tensorrt_llm sends no `output_context_ids`: the front door cannot detokenize its stream."""

    async def generate() -> None:
        backend = TritonBackend("127.0.0.1:1", "tensorrt_llm", 1.0, 1.0, tokenizer_dir=str(tiny_llama_dir))
        backend._names = (frozenset({"input_ids", "request_output_len"}), frozenset({"output_ids"}))
        try:
            async for _ in backend.generate({"text_input": "hi", "max_tokens": 2}, 0, "id"):
                pass
        finally:
            await backend.close()

    with pytest.raises(APIError) as info:
        asyncio.run(generate())
    message = str(info.value)
    assert info.value.status == 500 and "output_context_ids" in message and "tensorrt_llm_bls" in message


def test_an_error_response_is_raised_after_the_stream_is_read_to_its_end() -> None:
    """After an error response (a busy rejection) the server still sends the stream's end. Leaving the call
    at the error cancels it while Triton 2.51 is finishing the stream: its handler then waited for a
    cancellation that never came and held the model, so a later unload waited out the drain deadline."""
    import grpc
    from tritonclient.grpc import service_pb2

    error = service_pb2.ModelStreamInferResponse(error_message="the engine is busy (max_waiting reached)")
    final = service_pb2.ModelStreamInferResponse()
    final.infer_response.parameters["triton_final_response"].bool_param = True

    class Call:
        def __init__(self) -> None:
            self.responses = [error, final]
            self.cancelled_with_unread: list[int] = []

        async def write(self, request: object) -> None:
            pass

        async def done_writing(self) -> None:
            pass

        async def read(self) -> object:
            return self.responses.pop(0) if self.responses else grpc.aio.EOF

        def cancel(self) -> None:
            self.cancelled_with_unread.append(len(self.responses))

    call = Call()

    async def generate() -> None:
        backend = TritonBackend("127.0.0.1:1", "tensorrt_llm_bls", 1.0, 1.0)
        backend._names = (frozenset({"text_input", "max_tokens"}), frozenset({"text_output"}))
        backend._stream = lambda: call  # type: ignore[method-assign]
        try:
            async for _ in backend.generate({"text_input": "hi", "max_tokens": 2}, 0, "id"):
                pass
        finally:
            await backend.close()

    with pytest.raises(APIError, match="busy"):
        asyncio.run(generate())
    assert call.cancelled_with_unread == [0], "the stream was left before its end"
