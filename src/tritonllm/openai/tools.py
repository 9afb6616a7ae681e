"""Tool calls forced by guided decoding: `tools` + `tool_choice` -> a JSON-schema guide, and the
generated JSON -> OpenAI's `tool_calls` (whole or as streamed deltas).

This server has no tool-call parser for free text, so it only answers calls it can force:

- a named choice `{"type": "function", "function": {"name": X}}`: the output is X's arguments,
  constrained by X's `parameters` schema; the reply is one call of X (finish_reason `stop`, as OpenAI
  and vLLM report a named call).
- `"required"`: the output is one object `{"name": X, "parameters": {...}}`, an `anyOf` over the
  tools (as vLLM builds it, one call instead of an array); the name and the arguments are read back
  from it (finish_reason `tool_calls`).
- `"none"` or no tools: plain generation, the tools are not shown to the model.
- `"auto"` (OpenAI's default when tools are sent) is refused with 400: without a parser for the
  model's own call format the server could not tell a call from text reliably.

The model sees the tools through its chat template when the template reads a `tools` variable;
otherwise a short system note describes the function(s) and their schema, so a small model has a hint
(the grammar alone would force valid JSON with arbitrary values).

A generation that reaches `max_tokens` before the JSON is complete ends with finish_reason `length`
and the partial arguments string (as OpenAI does); for `"required"`, if even the name is incomplete,
the partial text is returned as `content` without `tool_calls`.

The next turn of a tool loop sends the call back (an assistant message with `content` null and
`tool_calls`) followed by one `tool` message per call (`tool_call_id`, `content`: the result). They are
checked as OpenAI checks them (`ToolTurns`: a 400 names the message and field at fault) and rendered:

- through the chat template when it renders tool turns (it mentions `tool_calls` and a `tool` role,
  as Qwen2.5, Llama 3.1, Mistral and Hermes templates do): in the form HF templates expect, the
  arguments as a JSON object (`{"type": "function", "function": {"name", "arguments": {...}}}`), the
  result as `{"role": "tool", "tool_call_id", "name", "content"}`;
- as plain text otherwise (SmolLM2's template ignores `tool_calls`, fails on null content and would
  show `tool` as a role the model never saw): the assistant turn says each call on its own line in the
  form a "required" call is generated, `{"name": "X", "parameters": <arguments>}` (after its content, if
  any), and the results of one turn's calls become one user message, a line per result in the order
  sent: `Result of X: <content>`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from tritonllm.openai.errors import invalid, unsupported

# A function without `parameters` takes none (OpenAI): its arguments are exactly `{}`.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# The head of a "required" call as the guide lays it out: {"name": "X", "parameters": <arguments>}
REQUIRED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*(?=\S)')
AUTO_MESSAGE = (
    "'auto' (the default when tools are sent) is not supported: this server cannot detect tool calls "
    'in free text. Use a named tool_choice ({"type": "function", "function": {"name": ...}}) or '
    '"required" to force a call, or "none" for a plain reply'
)


@dataclass(frozen=True)
class Tool:
    """One function the caller offers: its name, description and parameters schema."""

    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as chat templates expect it (`tools=[{"type": "function", "function": ...}]`)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request calls a tool: `named` (one given function) or `required` (any of them)."""

    mode: Literal["named", "required"]
    tools: tuple[Tool, ...]
    name: str | None = None  # the function of a named choice

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema the output is constrained to."""
        if self.mode == "named":
            return next(t.parameters for t in self.tools if t.name == self.name)
        return {"anyOf": [_call_schema(t) for t in self.tools]}

    @property
    def param(self) -> str:
        """The request field a bad schema is blamed on."""
        if self.mode == "named":
            index = next(i for i, t in enumerate(self.tools) if t.name == self.name)
            return f"tools[{index}].function.parameters"
        return "tools"

    def guide_inputs(self) -> dict[str, Any]:
        return {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(self.schema)}

    def system_note(self) -> str:
        """The hint for a template without tools: the function(s), their schema, the reply's form."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.name)
            return (
                f"Call the function {tool.name}{_described(tool)}. Reply with its arguments only, as a JSON "
                f"object following this JSON schema: {json.dumps(tool.parameters)}"
            )
        lines = [
            'Call one of these functions. Reply only with a JSON object {"name": <function name>, '
            '"parameters": <its arguments>}.'
        ]
        for t in self.tools:
            lines.append(f"- {t.name}{_described(t)}; parameters schema: {json.dumps(t.parameters)}")
        return "\n".join(lines)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def _described(tool: Tool) -> str:
    return f" ({tool.description})" if tool.description else ""


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "parameters": tool.parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _tool(i: int, item: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(item, dict) or item.get("type") != "function":
        raise invalid(f"{where}.type", "only tools of type 'function' are supported")
    function = item.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function", "must be an object with 'name'", "invalid_type")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise invalid(f"{where}.function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise invalid(f"{where}.function.description", "must be a string", "invalid_type")
    parameters = function.get("parameters")
    if parameters is None or parameters == {}:
        parameters = NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise invalid(f"{where}.function.parameters", "must be a JSON schema object", "invalid_type")
    return Tool(name, description, parameters)


def tool_plan(body: dict[str, Any]) -> ToolPlan | None:
    """The request's forced tool call, None for plain generation; 400s name the field at fault."""
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise unsupported(name, "the legacy function-call API is not supported: use tools, tool_choice")
    raw_tools = body.get("tools")
    choice = body.get("tool_choice")
    if raw_tools is not None and not isinstance(raw_tools, list):
        raise invalid("tools", "must be a list of tools", "invalid_type")
    tools = tuple(_tool(i, item) for i, item in enumerate(raw_tools or []))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools", "function names must be unique")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise invalid("tool_choice", "needs a non-empty 'tools' list")
    if choice == "auto":
        raise unsupported("tool_choice", AUTO_MESSAGE)
    if choice == "required":
        return ToolPlan("required", tools)
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise invalid("tool_choice", f"names no function in tools: {json.dumps(name)} (tools: {names})")
        return ToolPlan("named", tools, name)
    raise invalid(
        "tool_choice",
        '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    )


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCallStream:
    """Turns the generated text into OpenAI tool-call deltas, piece by piece.

    Named: every text piece is an arguments fragment; the first delta carries id, type and name.
    Required: the text is held until the `{"name": "X", "parameters": ` head is complete; then
    arguments are streamed, holding back a trailing run of `}` and whitespace, since the last `}`
    closes the call object rather than the arguments. Joining the deltas' `arguments` gives the same
    string as the whole reply (`whole`), which uses this same code.
    """

    plan: ToolPlan
    text: str = ""
    id: str = field(default_factory=call_id)
    name: str | None = None
    arguments: str = ""
    _sent: int = 0  # characters of `text` given out as arguments (required) or all of them (named)
    _head_end: int | None = None

    def __post_init__(self) -> None:
        if self.plan.mode == "named":
            self.name = self.plan.name
            self._head_end = 0

    def _delta(self, fragment: str, first: bool) -> dict[str, Any]:
        self.arguments += fragment
        if first:
            function = {"name": self.name, "arguments": fragment}
            return {"index": 0, "id": self.id, "type": "function", "function": function}
        return {"index": 0, "function": {"arguments": fragment}}

    def opening(self) -> list[dict[str, Any]]:
        """The deltas known before any token: a named call's id, type and name."""
        if self.plan.mode == "named":
            return [self._delta("", first=True)]
        return []

    def push(self, text: str) -> list[dict[str, Any]]:
        """Deltas for one text piece (possibly none while the required call's head is incomplete)."""
        self.text += text
        if self.plan.mode == "named":
            return [self._delta(text, first=False)] if text else []
        first = False
        if self._head_end is None:
            head = REQUIRED_HEAD.match(self.text)
            if head is None:
                return []
            self.name, self._head_end, first = json.loads(f'"{head.group(1)}"'), head.end(), True
            self._sent = self._head_end
        body = self.text[self._sent :]
        held = len(body) - len(body.rstrip("} \t\r\n"))
        fragment = body[: len(body) - held]
        if not fragment and not first:
            return []
        self._sent += len(fragment)
        return [self._delta(fragment, first)]

    def finish(self, complete: bool) -> list[dict[str, Any]]:
        """The held-back tail. `complete`: the JSON ended (the call object's own `}` is dropped)."""
        if self.plan.mode == "named" or self._head_end is None:
            return []
        tail = self.text[self._sent :]
        if complete:
            tail = tail.rstrip()
            tail = tail[:-1].rstrip() if tail.endswith("}") else tail
        self._sent = len(self.text)
        return [self._delta(tail, first=False)] if tail else []

    def finish_reason(self, reason: str) -> str:
        """OpenAI's: `stop` for a named call, `tool_calls` for a finished "required" one."""
        if self.plan.mode == "required" and reason == "stop" and self.name is not None:
            return "tool_calls"
        return reason

    def whole(self, complete: bool) -> list[dict[str, Any]] | None:
        """The reply's `tool_calls` once all text is pushed; None if no call could be read."""
        self.finish(complete)
        if self.name is None:
            return None
        function = {"name": self.name, "arguments": self.arguments}
        return [{"id": self.id, "type": "function", "function": function}]


def _call_record(where: str, raw: Any) -> dict[str, Any]:
    """One earlier call as sent back by the caller: `{"id", "type": "function", "function": {...}}`."""
    if not isinstance(raw, dict):
        raise invalid(where, "must be an object with 'id', 'type' and 'function'", "invalid_type")
    call_id = raw.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(
            f"{where}.id", "is required (the id of the call, a string)", "missing_required_parameter"
        )
    if raw.get("type", "function") != "function":
        raise invalid(f"{where}.type", f"must be 'function', got {json.dumps(raw.get('type'))}")
    function = raw.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function", "must be an object with 'name' and 'arguments'", "invalid_type")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.function.name", "is required (a string)", "missing_required_parameter")
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        raise invalid(
            f"{where}.function.arguments", "must be a string (the arguments as JSON)", "invalid_type"
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolTurns:
    """The calls of a conversation's assistant turns and the `tool` messages that answer them."""

    names: dict[str, str] = field(default_factory=dict)  # every call id so far -> its function's name
    answered: dict[str, int] = field(default_factory=dict)  # call id -> index of its tool message
    pending: list[str] = field(default_factory=list)  # ids of the last call turn not answered yet
    turn: int | None = None  # index of the last assistant message with tool_calls

    def calls(self, index: int, raw: Any) -> list[dict[str, Any]]:
        """Validate message `index`'s `tool_calls`; its calls now wait for their results."""
        where = f"messages[{index}].tool_calls"
        if not isinstance(raw, list):
            raise invalid(where, "must be a list of tool calls", "invalid_type")
        records = [_call_record(f"{where}[{j}]", item) for j, item in enumerate(raw)]
        for j, record in enumerate(records):
            if record["id"] in self.names:
                raise invalid(
                    f"{where}[{j}].id", f"repeats the id of an earlier call: {json.dumps(record['id'])}"
                )
            self.names[record["id"]] = record["function"]["name"]
        self.pending = [r["id"] for r in records]
        self.turn = index
        return records

    def answer(self, index: int, call_id: Any) -> tuple[str, str]:
        """Validate message `index` (role `tool`): the id it answers and that call's function name."""
        where = f"messages[{index}].tool_call_id"
        if not isinstance(call_id, str) or not call_id:
            raise invalid(
                where,
                "is required in a tool message (the id of the call it answers)",
                "missing_required_parameter",
            )
        if call_id in self.answered:
            raise invalid(
                where, f"{json.dumps(call_id)} was already answered by messages[{self.answered[call_id]}]"
            )
        if call_id not in self.pending:
            earlier = (
                f"the calls waiting for a result are {self.pending}"
                if self.pending
                else "no earlier assistant message has tool_calls waiting for a result"
            )
            raise invalid(
                where,
                f"{json.dumps(call_id)} matches no tool call of the assistant message before it ({earlier}); "
                "a tool message must answer a call of the preceding assistant message",
            )
        self.pending.remove(call_id)
        self.answered[call_id] = index
        return call_id, self.names[call_id]

    def check_answered(self) -> None:
        """Before any message but a tool result: the last call turn must have all its results."""
        if self.pending:
            raise invalid(
                f"messages[{self.turn}].tool_calls",
                "an assistant message with tool_calls must be followed by a tool message for each call; "
                f"no result for {self.pending}",
            )


def _arguments_object(arguments: str) -> Any:
    """The arguments as the JSON value they encode (HF templates dump them with `tojson`), else as sent."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def template_tool_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool turns in the form HF chat templates read (`apply_chat_template` docs, "tool use")."""
    out = []
    for message in messages:
        if "tool_calls" in message:
            calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": _arguments_object(c["function"]["arguments"]),
                    },
                }
                for c in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def _plain_call(call: dict[str, Any]) -> str:
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    try:
        json.loads(arguments)
    except ValueError:
        arguments = json.dumps(arguments)  # not JSON (e.g. cut by max_tokens): quoted as a string
    return f'{{"name": {json.dumps(name)}, "parameters": {arguments}}}'


def plain_tool_turns(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Tool turns as plain text for a template without tool support (the module's docstring)."""
    out: list[dict[str, str]] = []
    results: list[str] = []
    for message in messages:
        if message["role"] == "tool":
            results.append(f"Result of {message['name']}: {message['content']}")
            continue
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results = []
        if "tool_calls" in message:
            lines = [message["content"]] if message["content"] else []
            lines += [_plain_call(c) for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(lines)})
        else:
            out.append(message)
    if results:
        out.append({"role": "user", "content": "\n".join(results)})
    return out
