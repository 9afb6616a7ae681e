"""Forced tool calls, the tool loop's next turn (the call and its result sent back) and `response_format`
through the OpenAI front door, with the official `openai` client, on the real Triton server with the
real default model (SmolLM2-135M-Instruct).

One Triton server and one front door (no keys: loopback) serve the module. The tiny random model of
`test_openai_server.py` would satisfy the grammar too, but its arguments would be noise; the real model
shows that the system note (SmolLM2's template has no `tools`) gives sensible values. Greedy requests,
`max_tokens` <= 48, so the module adds little time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
import requests
from test_openai_server import _error, start_front_door, stop_process
from triton_fixture import start_server, tiny_server_options

pytestmark = pytest.mark.slow

MODEL = "smollm2"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIMER = {
    "type": "object",
    "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 120}},
    "required": ["minutes"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "set_timer", "description": "Start a timer", "parameters": TIMER},
    },
]
SCHEMAS = {"get_weather": WEATHER, "set_timer": TIMER}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):
    from tritonllm.tokenization import load_tokenizer

    return load_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="module")
def client(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    tmp = tmp_path_factory.mktemp("openai_tools")
    triton = start_server(tiny_server_options(smollm2_dir, max_num_seqs=4), tmp / "tritonserver.log")
    try:
        requests.post(  # the first step may build the attention kernel: warm up straight on Triton
            f"http://{triton.http_url}/v2/models/tensorrt_llm_bls/generate",
            json={"text_input": "warm up", "max_tokens": 2},
            timeout=300,
        )
        args = ["--model", str(smollm2_dir), "--served-model-name", MODEL, "--triton-url", triton.grpc_url]
        process, url = start_front_door(args, tmp / "front_door.log")
        try:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        finally:
            stop_process(process)
    finally:
        triton.stop(timeout_s=30)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_named_tool_choice_forces_valid_arguments(client: openai.OpenAI) -> None:
    for city, question in (("Paris", "What's the weather in Paris?"), ("Oslo", "Is it cold in Oslo today?")):
        reply = client.chat.completions.create(
            model=MODEL, messages=ask(question), tools=TOOLS, tool_choice=NAMED, max_tokens=48, temperature=0
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER)
        assert arguments["city"] == city  # the system note told the model what the function is for
    plain = client.chat.completions.create(
        model=MODEL, messages=ask("Hi"), tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_streamed_tool_call_deltas_join_to_the_whole_arguments(client: openai.OpenAI) -> None:
    params = dict(
        model=MODEL, messages=ask("Weather in Rome, please"), tools=TOOLS, max_tokens=48, temperature=0
    )
    for choice in (NAMED, "required"):
        whole = client.chat.completions.create(**params, tool_choice=choice).choices[0]
        chunks = list(client.chat.completions.create(**params, tool_choice=choice, stream=True))
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.choices[0].delta.content is None for c in chunks), choice
        first, rest = deltas[0], deltas[1:]
        (call,) = whole.message.tool_calls
        assert (first.index, first.type, first.function.name) == (0, "function", call.function.name), deltas
        assert first.id.startswith("call_") and all(d.id is None and d.function.name is None for d in rest)
        joined = "".join(d.function.arguments or "" for d in deltas)
        assert joined == call.function.arguments, (choice, joined, call.function.arguments)
        finals = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert finals == [whole.finish_reason] == ["stop" if choice == NAMED else "tool_calls"]


def test_required_tool_choice_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask("Set a timer for 10 minutes"),
        tools=TOOLS,
        tool_choice="required",
        max_tokens=48,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_max_tokens_too_small_gives_length_and_partial_arguments(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask("Weather in Paris?"),
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=4,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 4
    arguments = choice.message.tool_calls[0].function.arguments
    assert arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(arguments)


def test_two_turn_tool_loop_ends_with_a_text_answer(client: openai.OpenAI, tokenizer) -> None:
    """The openai SDK's loop: a forced call, the call message appended as returned plus the tool's
    result, then a plain answer. SmolLM2's template has no tool support: the turns go as plain text."""
    messages: list = ask("What's the weather in Paris?")
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=NAMED, max_tokens=48, temperature=0
    )
    call_message = first.choices[0].message
    (call,) = call_message.tool_calls
    result = json.dumps({"city": "Paris", "temperature": 18, "unit": "celsius", "sky": "sunny"})
    messages += [call_message, {"role": "tool", "tool_call_id": call.id, "content": result}]
    params = dict(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    second = client.chat.completions.create(**params)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content.strip(), answer
    assert answer.finish_reason in ("stop", "length")
    assert "18" in answer.message.content, answer.message.content  # the result reached the model
    rendered = [  # the documented plain-text form of the call and its result
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": f'{{"name": "get_weather", "parameters": {call.function.arguments}}}',
        },
        {"role": "user", "content": f"Result of get_weather: {result}"},
    ]
    ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
    assert second.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(**params, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.message.content


def test_tool_loop_errors_name_the_message_and_field(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    turn = [*ask("Weather?"), {"role": "assistant", "content": None, "tool_calls": [call]}]
    cases = [
        ([*turn, {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}], "messages[2].tool_call_id"),
        ([*turn, {"role": "tool", "content": "sunny"}], "messages[2].tool_call_id"),
        (
            [*ask("Hi"), {"role": "tool", "tool_call_id": "call_1", "content": "x"}],
            "messages[1].tool_call_id",
        ),
        ([*turn, *ask("And now?")], "messages[1].tool_calls"),
        (
            [
                *ask("Weather?"),
                {"role": "assistant", "content": None, "tool_calls": [{"function": call["function"]}]},
            ],
            "messages[1].tool_calls[0].id",
        ),
    ]
    for messages, param in cases:
        error = _error(
            lambda messages=messages: client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8
            )
        )
        assert error.status_code == 400 and error.body["param"] == param, (messages, error.body)
        assert error.body["type"] == "invalid_request_error"


def test_tool_errors_name_the_parameter(client: openai.OpenAI) -> None:
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    cases = [
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "required"),
        ({"tools": TOOLS}, "tool_choice", "auto"),  # OpenAI's default with tools is "auto"
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": bad_schema, "tool_choice": "required"}, "tools", "nonsense"),
        (
            {"tools": bad_schema, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tools[0].function.parameters",
            "nonsense",
        ),
    ]
    for extra, param, words in cases:
        error = _error(
            lambda extra=extra: client.chat.completions.create(
                model=MODEL, messages=ask("hi"), max_tokens=8, **extra
            )
        )
        assert error.status_code == 400 and error.body["param"] == param, (extra, error.body)
        assert words in error.body["message"], error.body
    error = _error(
        lambda: client.chat.completions.create(
            model=MODEL, messages=ask("hi"), max_tokens=8, extra_body={"tools": {"f": 1}}
        )
    )
    assert error.status_code == 400 and error.body["param"] == "tools"


def test_response_format_json_object_and_json_schema(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask("Reply with a JSON object with keys name and age for Alice, 30."),
        response_format={"type": "json_object"},
        max_tokens=48,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop", reply
    jsonschema.validate(json.loads(reply.choices[0].message.content), {"type": "object"})
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask("The weather in Paris, as JSON"),
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}},
        max_tokens=48,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), WEATHER)
    error = _error(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=ask("hi"),
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        )
    )
    assert error.status_code == 400 and error.body["param"] == "response_format"
    assert "nonsense" in error.body["message"]
