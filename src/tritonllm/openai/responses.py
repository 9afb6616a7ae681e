"""OpenAI response objects: whole completions, SSE chunks, usage, log-probabilities."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from tritonllm.openai.output import Delta

SSE_DONE = b"data: [DONE]\n\n"
# Made once: `json.dumps` with options builds a new encoder per call, a microsecond per streamed token.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _json(value: Any) -> bytes:
    return _ENCODER.encode(value).encode()


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + _json(event) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseBuilder:
    """Builds the objects of one request (`kind` completion or chat), all with one id and timestamp."""

    def __init__(self, kind: Literal["completion", "chat"], model: str, logprobs: bool):
        self.kind = kind
        self.model = model
        self.logprobs = logprobs
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._text_offset = 0
        self._content: tuple[bytes, bytes] | None = None  # an event's bytes around its text

    def content_event(self, text: str) -> bytes:
        """`sse(self.chunk(Delta(text)))` for a non-empty text without log-probabilities, the same
        bytes, from the request's envelope rendered once (the event streamed for every token)."""
        if self._content is None:
            marker = "\x00text\x00"
            head, tail = sse(self.chunk(Delta(marker))).split(_json(marker))
            self._content = (head, tail)
        head, tail = self._content
        return head + _json(text) + tail

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, logprobs: list[float], token_texts: list[str]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            content = [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(token_texts, logprobs, strict=True)
            ]
            return {"content": content}
        offsets = []
        for t in token_texts:
            offsets.append(self._text_offset)
            self._text_offset += len(t)
        return {
            "tokens": token_texts,
            "token_logprobs": logprobs,
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def whole(
        self,
        text: str,
        finish_reason: str,
        logprobs: list[float],
        token_texts: list[str],
        use: dict[str, int],
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The whole reply; with `tool_calls` the message is a call and its `content` null."""
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(logprobs, token_texts)}
        if self.kind == "chat" and tool_calls:
            choice["message"] = {"role": "assistant", "content": None, "tool_calls": tool_calls}
            obj = "chat.completion"
        elif self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            obj = "chat.completion"
        else:
            choice["text"] = text
            obj = "text_completion"
        choice["finish_reason"] = finish_reason
        return {**self._envelope(obj, [choice]), "usage": use}

    def chunk(
        self,
        delta: Delta,
        finish_reason: str | None = None,
        first: bool = False,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A streamed chunk, without a `usage` field (`usage_chunk` carries it, when asked for).

        `tool_calls` (a list, maybe empty) marks a tool-call reply: its deltas go in `delta.tool_calls`
        and the first chunk's `content` is null, as OpenAI streams a call."""
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat" and tool_calls is not None:
            content: dict[str, Any] = {"role": "assistant", "content": None} if first else {}
            if tool_calls:
                content["tool_calls"] = tool_calls
            choice["delta"] = content
            obj = "chat.completion.chunk"
        elif self.kind == "chat":
            content = {"role": "assistant", "content": delta.text} if first else {}
            if delta.text and not first:
                content["content"] = delta.text
            choice["delta"] = content
            obj = "chat.completion.chunk"
        else:
            choice["text"] = delta.text
            obj = "text_completion"
        choice["logprobs"] = self._logprobs(delta.logprobs, delta.token_texts) if delta.logprobs else None
        choice["finish_reason"] = finish_reason
        return self._envelope(obj, [choice])

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, []), "usage": use}
