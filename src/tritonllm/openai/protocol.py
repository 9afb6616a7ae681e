"""OpenAI request bodies -> validated generation requests for `tensorrt_llm_bls`.

Every rejection names the parameter at fault. The prompt is tokenized here with the model's own
tokenizer exactly as the BLS tokenizes `text_input`, so `usage.prompt_tokens` is exact and a prompt
too long for the model is refused with the limit before it reaches the engine. Chat requests are
rendered with the model's chat template into the text sent as `text_input`. A forced tool call
(`tools` + a named or "required" `tool_choice`, see `tools.py`) becomes a JSON-schema guide. Earlier
turns of a tool loop (assistant `tool_calls`, `tool` results) are validated and rendered as `tools.py`
describes: through the template when it renders them, as plain text otherwise.

vLLM's extensions `top_k`, `min_tokens`, `ignore_eos` and `repetition_penalty` are accepted.
`ignore_eos` is sent as `min_tokens = max_tokens` (the BLS has no such input; end ids are masked
until `max_tokens`, so the output has exactly `max_tokens` tokens, which is what benchmarks use it for).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import jinja2
from jinja2 import meta
from transformers import PreTrainedTokenizerBase

from tritonllm.openai.errors import APIError, invalid, unsupported
from tritonllm.openai.tools import (
    ToolPlan,
    ToolTurns,
    plain_tool_turns,
    template_tool_turns,
    tool_plan,
)

UINT64_MAX = 2**64 - 1
MAX_STOP_STRINGS = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})  # `response_format: json_object`

COMMON_FIELDS = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "user",
    "n",
    "logit_bias",
    "logprobs",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
}


@dataclass
class GenerationRequest:
    """One validated request: the prompt as sent to Triton, its exact token count, and the inputs."""

    kind: Literal["completion", "chat"]
    prompt: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    logprobs: bool
    echo: bool = False
    stop: tuple[str, ...] = ()
    inputs: dict[str, Any] = field(default_factory=dict)  # tensorrt_llm_bls inputs by name
    tools: ToolPlan | None = None  # a forced tool call: the output is read back as `tool_calls`


class PromptEncoder:
    """The model's tokenizer, used exactly as the BLS uses it (`tokenizer(text)`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        ids = tokenizer("a")["input_ids"]  # (this also clears any truncation or padding on the backend)
        self._backend = _plain_backend(tokenizer)
        bos = tokenizer.bos_token
        # A tokenizer that adds BOS itself would add a second one in front of a template that starts
        # with it; the template's is dropped so the ids equal apply_chat_template(tokenize=True)'s.
        self._strip_bos = bos if bos and ids and ids[0] == tokenizer.bos_token_id else None

        self.template_has_tools = _template_reads_tools(tokenizer.chat_template)
        self.template_has_tool_turns = _template_renders_tool_turns(tokenizer.chat_template)

    def count(self, text: str) -> int:
        if self._backend is not None:
            return len(self._backend.encode(text).ids)
        return len(self.tokenizer(text)["input_ids"])

    def render_chat(self, messages: list[dict[str, Any]], tools: ToolPlan | None = None) -> str:
        """The prompt text; a forced tool call shows its tools via the template or a system note.

        Tool-loop turns (validated by `_chat_messages`) go to a template that renders them in the form
        HF templates expect, to any other as plain text (`tools.plain_tool_turns`)."""
        if not self.tokenizer.chat_template:
            raise invalid("messages", "this model has no chat template: use /v1/completions")
        if any(m["role"] == "tool" or "tool_calls" in m for m in messages):
            turns = template_tool_turns if self.template_has_tool_turns else plain_tool_turns
            messages = turns(messages)
        extra: dict[str, Any] = {}
        if tools is not None and self.template_has_tools:
            extra["tools"] = [t.openai() for t in tools.tools]
        elif tools is not None:
            messages = _with_system_note(messages, tools.system_note())
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **extra
        )
        if self._strip_bos and text.startswith(self._strip_bos):
            text = text[len(self._strip_bos) :]
        return text


def _plain_backend(tokenizer: PreTrainedTokenizerBase) -> Any:
    """A fast tokenizer's Rust backend, called directly: `tokenizer(text)` is that call plus ~50 us of
    Python per prompt. Only when it gives the same ids on a sample with special tokens, and sets no
    truncation or padding of its own; None otherwise (the tokenizer is then called as the BLS does)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    specials = "".join(t for t in (tokenizer.bos_token, tokenizer.eos_token) if isinstance(t, str))
    sample = f"{specials}Hello wörld,  \n\t12345 {specials}ünïcode 🙂 end"
    if backend.encode(sample).ids != tokenizer(sample)["input_ids"]:
        return None
    return backend


def _template_reads_tools(template: str | None) -> bool:
    """Whether a chat template renders a `tools` variable (then tools go to the template)."""
    if not template:
        return False
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:  # custom tags (e.g. {% generation %}): a plain look for the name
        return re.search(r"\btools\b", template) is not None


def _template_renders_tool_turns(template: str | None) -> bool:
    """Whether a chat template renders assistant `tool_calls` and `tool` messages (Qwen2.5, Llama 3.1,
    Mistral and Hermes templates do; SmolLM2's drops the calls and would show `tool` as an unknown role)."""
    if not template:
        return False
    return (
        re.search(r"\btool_calls\b", template) is not None
        and re.search(r"""['"]tool['"]""", template) is not None
    )


def _with_system_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """The note appended to the system message, or as a new first system message."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{note}"}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def _number(body: dict[str, Any], name: str, low: float, high: float, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, f"must be a number, got {json.dumps(value)}", "invalid_type")
    if integer and not (isinstance(value, int) or float(value).is_integer()):
        raise invalid(name, f"must be an integer, got {value}", "invalid_type")
    if not low <= value <= high:  # false for NaN; compared as int, so a huge int is no OverflowError
        raise invalid(name, f"must be in [{low:g}, {high:g}], got {value}")
    return int(value) if integer else float(value)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"must be a boolean, got {json.dumps(value)}", "invalid_type")
    return value


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise invalid("stop", "must be a non-empty string or a list of non-empty strings", "invalid_type")
    if len(items) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    return tuple(dict.fromkeys(items))


def _reject_unsupported(body: dict[str, Any], allowed: set[str]) -> None:
    for name in body:
        if name not in allowed:
            raise invalid(name, "is not a known parameter of this endpoint", "unknown_parameter")
    if body.get("n") not in (None, 1):
        raise unsupported("n", "only n=1 is supported")
    if body.get("best_of") not in (None, 1):
        raise unsupported("best_of", "only best_of=1 is supported")
    if body.get("logit_bias"):
        raise unsupported("logit_bias")
    if body.get("suffix"):
        raise unsupported("suffix")
    if not isinstance(body.get("parallel_tool_calls", False), bool):  # accepted; one call is returned
        raise invalid("parallel_tool_calls", "must be a boolean", "invalid_type")


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options", "is only allowed with stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise invalid("stream_options", 'expected {"include_usage": true|false}')
    return _bool(options, "include_usage")


def _text(content: Any, where: str) -> str | None:
    """A message's content as one string (None when absent); only text parts are accepted."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "must be a string or a list of text parts", "invalid_type")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise unsupported(f"{where}.content[{j}]", "only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages, validated: roles, text content, and the tool loop's calls and results.

    An assistant message with `tool_calls` (content may be null) must be followed by one `tool`
    message per call, each naming its call's id in `tool_call_id`, before any other message (as
    OpenAI requires). Returned messages are `{"role", "content"}`; an assistant call turn also has
    `tool_calls` (`{"id", "type", "function": {"name", "arguments"}}`), a tool result `tool_call_id`
    and the called function's `name`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of messages", "invalid_type")
    out: list[dict[str, Any]] = []
    turns = ToolTurns()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, "must be an object with 'role' and 'content'", "invalid_type")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"{where}.role", f"must be one of {sorted(CHAT_ROLES)}, got {json.dumps(role)}")
        if message.get("function_call"):
            raise unsupported(
                f"{where}.function_call", "the legacy function-call API is not supported: send tool_calls"
            )
        if role != "tool":
            turns.check_answered()
        content = _text(message.get("content"), where)
        raw_calls = message.get("tool_calls")
        if raw_calls and role != "assistant":
            raise invalid(f"{where}.tool_calls", "only assistant messages carry tool_calls")
        if raw_calls:
            calls = turns.calls(i, raw_calls)
            out.append({"role": "assistant", "content": content or "", "tool_calls": calls})
            continue
        if content is None:
            raise invalid(f"{where}.content", "must be a string or a list of text parts", "invalid_type")
        if role == "tool":
            call_id, name = turns.answer(i, message.get("tool_call_id"))
            out.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": content})
            continue
        out.append({"role": "system" if role == "developer" else role, "content": content})
    turns.check_answered()
    return out


def _guided_decoding(body: dict[str, Any]) -> dict[str, Any]:
    """`response_format` -> NVIDIA's guided-decoding inputs (the engine answers if it cannot)."""
    fmt = body.get("response_format")
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":  # an object, as OpenAI's: guide type `json` would let an array through too
        return {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema", "must be a JSON schema object")
        return {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(schema)}
    raise invalid("response_format", "type must be 'text', 'json_object' or 'json_schema'")


def _completion_prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise unsupported("prompt", "one prompt per request (send a list of prompts as separate requests)")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        raise unsupported("prompt", "token-id prompts are not supported: send the prompt as text")
    if not isinstance(prompt, str) or not prompt:
        raise invalid("prompt", "must be a non-empty string", "invalid_type")
    return prompt


class RequestTranslator:
    """Validates OpenAI bodies against the model's limits and builds GenerationRequests."""

    def __init__(self, encoder: PromptEncoder, max_model_len: int | None, served_model: str):
        self.encoder = encoder
        self.max_model_len = max_model_len
        self.served_model = served_model

    def completion(self, body: dict[str, Any]) -> GenerationRequest:
        _reject_unsupported(body, COMPLETION_FIELDS)
        self._check_model(body)
        prompt = _completion_prompt(body)
        logprobs = _number(body, "logprobs", 0, 20, integer=True)
        if logprobs:
            raise unsupported("logprobs", "only logprobs=0 (the chosen token's log-probability) is supported")
        echo = _bool(body, "echo")
        if echo and logprobs is not None:
            raise unsupported("echo", "echo with logprobs needs prompt log-probabilities, not supported")
        return self._build(
            body, "completion", prompt, "prompt", logprobs is not None, echo, COMPLETION_DEFAULT_MAX_TOKENS
        )

    def chat(self, body: dict[str, Any]) -> GenerationRequest:
        _reject_unsupported(body, CHAT_FIELDS)
        self._check_model(body)
        tools = tool_plan(body)
        guide = _guided_decoding(body)
        if tools is not None and guide:
            raise invalid("response_format", "cannot be combined with a forced tool call (tool_choice)")
        prompt = self.encoder.render_chat(_chat_messages(body), tools)
        logprobs = _bool(body, "logprobs")
        top = _number(body, "top_logprobs", 0, 20, integer=True)
        if top:
            raise unsupported("top_logprobs", "only the chosen token's log-probability is available")
        if top is not None and not logprobs:
            raise invalid("top_logprobs", "requires logprobs=true")
        if body.get("max_completion_tokens") is not None:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        request = self._build(body, "chat", prompt, "messages", logprobs, False, None)
        request.inputs |= tools.guide_inputs() if tools is not None else guide
        request.tools = tools
        return request

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise invalid("model", "is required", "missing_required_parameter")
        if model != self.served_model:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.served_model}'",
                param="model",
                code="model_not_found",
                reason="model_not_found",
            )

    def _build(
        self,
        body: dict[str, Any],
        kind: Literal["completion", "chat"],
        prompt: str,
        prompt_param: str,
        logprobs: bool,
        echo: bool,
        default_max_tokens: int | None,
    ) -> GenerationRequest:
        stream = _bool(body, "stream")
        include_usage = _stream_options(body, stream)
        prompt_tokens = self.encoder.count(prompt)
        room = None if self.max_model_len is None else self.max_model_len - prompt_tokens
        if room is not None and room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the {prompt_param} "
                f"has {prompt_tokens} tokens, leaving no room for the completion",
                param=prompt_param,
                code="context_length_exceeded",
                reason="context_length_exceeded",
            )
        max_tokens = _number(body, "max_tokens", 1, 2**31 - 1, integer=True)
        if max_tokens is None:
            max_tokens = default_max_tokens or room
            if max_tokens is None:
                raise invalid("max_tokens", "is required (the model's context length is unknown)")
            if room is not None:
                max_tokens = min(max_tokens, room)
        elif room is not None and max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_param}, {max_tokens} "
                f"for the completion): lower max_tokens to at most {room}",
                param="max_tokens",
                code="context_length_exceeded",
                reason="context_length_exceeded",
            )
        inputs = self._sampling_inputs(body, max_tokens)
        inputs |= {"text_input": prompt, "exclude_input_in_output": True, "stream": True}
        stop = _stop_strings(body)
        if stop:
            inputs["stop_words"] = list(stop)
        if logprobs:
            inputs["return_log_probs"] = True
        return GenerationRequest(
            kind=kind,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            stream=stream,
            include_usage=include_usage,
            logprobs=logprobs,
            echo=echo,
            stop=stop,
            inputs=inputs,
        )

    @staticmethod
    def _sampling_inputs(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
        temperature = _number(body, "temperature", 0, 2)
        top_p = _number(body, "top_p", 0, 1)
        if top_p == 0:
            raise invalid("top_p", "must be in (0, 1]")
        top_k = _number(body, "top_k", -1, 2**31 - 1, integer=True)
        inputs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if temperature is None else temperature,
            "top_p": 1.0 if top_p is None else top_p,
        }
        if top_k is not None and top_k > 0:
            inputs["top_k"] = top_k
        seed = _number(body, "seed", 0, UINT64_MAX, integer=True)
        if seed is not None:
            inputs["seed"] = seed
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(body, name, -2, 2)
            if value is not None:
                inputs[name] = value
        repetition = _number(body, "repetition_penalty", 0, 10)
        if repetition is not None:
            if repetition <= 0:
                raise invalid("repetition_penalty", "must be > 0")
            inputs["repetition_penalty"] = repetition
        min_tokens = _number(body, "min_tokens", 0, 2**31 - 1, integer=True)
        if min_tokens is not None and min_tokens > max_tokens:
            raise invalid("min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}")
        if _bool(body, "ignore_eos"):
            min_tokens = max_tokens
        if min_tokens:
            inputs["min_tokens"] = min_tokens
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise invalid("user", "must be a string", "invalid_type")
        return inputs
