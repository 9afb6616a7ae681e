"""Triton's streamed pieces -> the text deltas, token counts and finish reason the caller sees.

Stop strings end the text as OpenAI defines it: the returned text stops before the stop string (the
engine's stop words include it). Text that could be the start of a stop string is held back until the
next piece decides, so a streamed client never sees part of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tritonllm_client.results import Piece


class StopFilter:
    """Cuts text at the first stop string; holds back a tail that may begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string was found (nothing more may follow)."""
        if not self.stops:
            return text, False
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self._pending = self._pending[: min(hits)], ""
            return out, True
        hold = self._held_tail()
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def _held_tail(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


@dataclass
class Delta:
    """What one piece adds for the caller: text, and per token its log-probability and text."""

    text: str
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)


class OutputAssembler:
    """Accumulates a generation: completion token count (exact, from the server), text, finish reason."""

    def __init__(self, stops: tuple[str, ...], max_tokens: int, want_logprobs: bool):
        self.filter = StopFilter(stops)
        self.max_tokens = max_tokens
        self.want_logprobs = want_logprobs
        self.completion_tokens = 0
        self.text_parts: list[str] = []
        self.logprobs: list[float] = []
        self.token_texts: list[str] = []
        self.stopped = False
        self._server_reason: str | None = None

    def add(self, piece: Piece) -> Delta:
        """Take one piece (ignored once a stop string ended the text)."""
        if self.stopped:
            return Delta("")
        tokens = 1 if piece.num_tokens is None else piece.num_tokens
        self.completion_tokens += tokens
        if piece.finish_reason:
            self._server_reason = piece.finish_reason
        text, self.stopped = self.filter.push(piece.text)
        delta = Delta(text)
        if self.want_logprobs and tokens:
            # The server sends text per response, not per token: a response's text goes to its first token.
            delta.logprobs = list(piece.log_probs[:tokens]) + [0.0] * (tokens - len(piece.log_probs))
            delta.token_texts = [piece.text] + [""] * (tokens - 1)
            self.logprobs += delta.logprobs
            self.token_texts += delta.token_texts
        self.text_parts.append(text)
        return delta

    def finish(self) -> Delta:
        """The held-back tail at the end of the generation."""
        text = "" if self.stopped else self.filter.flush()
        self.text_parts.append(text)
        return Delta(text)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def finish_reason(self) -> str:
        """`stop` or `length` as OpenAI reports them; the server's `abort`/`timeout`/`error` pass through."""
        if self.stopped:
            return "stop"
        if self._server_reason in ("stop", "length", "abort", "timeout", "error"):
            return self._server_reason
        # A server without the `finish_reason` output (NVIDIA's backend): judge by the length.
        return "length" if self.completion_tokens >= self.max_tokens else "stop"
