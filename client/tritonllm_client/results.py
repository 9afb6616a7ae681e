"""What a generation returns, and how it is assembled from the server's responses.

Token counts are exact, not estimated: the client asks for `num_output_tokens` (the tokens each response
adds, as Triton's OpenAI frontend reads it), else counts `output_log_probs` entries when log-probs were
requested; a server with neither falls back to one token per streamed response. The prompt count
comes from the `preprocessing` model when `ClientConfig.count_prompt_tokens` is set, else it is None.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Piece:
    """One server response, normalised across gRPC and HTTP."""

    text: str
    num_tokens: int | None  # None when the server sends neither `num_output_tokens` nor `output_log_probs`
    log_probs: list[float]
    cum_log_prob: float | None
    finish_reason: str | None  # this project's extension; absent on NVIDIA's backend
    received_s: float  # time.perf_counter() on arrival


def _flat(value: Any) -> np.ndarray:
    return np.asarray(value).reshape(-1)


def _text(value: Any) -> str:
    flat = _flat(value)
    if flat.size == 0:
        return ""
    item = flat[0]
    return item.decode("utf-8", errors="replace") if isinstance(item, bytes) else str(item)


def piece_from_outputs(outputs: Mapping[str, Any]) -> Piece:
    """Build a Piece from output tensors (numpy arrays over gRPC, JSON values over HTTP)."""
    log_probs = (
        _flat(outputs["output_log_probs"]).astype(float).tolist() if "output_log_probs" in outputs else None
    )
    cum = _flat(outputs["cum_log_probs"]) if "cum_log_probs" in outputs else None
    reason = _text(outputs["finish_reason"]) if "finish_reason" in outputs else ""
    if "num_output_tokens" in outputs:
        num_tokens: int | None = int(_flat(outputs["num_output_tokens"])[0])
    else:
        num_tokens = None if log_probs is None else len(log_probs)
    return Piece(
        text=_text(outputs.get("text_output", "")),
        num_tokens=num_tokens,
        log_probs=log_probs or [],
        cum_log_prob=float(cum[0]) if cum is not None and cum.size else None,
        finish_reason=reason or None,
        received_s=time.perf_counter(),
    )


@dataclass(frozen=True)
class Chunk:
    """A streamed piece of text as the caller sees it."""

    text: str
    num_tokens: int
    log_probs: list[float]


@dataclass(frozen=True)
class GenerationResult:
    """The whole generation with its measured latencies (client-side clock)."""

    text: str
    output_tokens: int
    prompt_tokens: int | None
    finish_reason: str | None
    log_probs: list[float] | None
    cum_log_prob: float | None
    ttft_s: float  # request sent -> first response with tokens (non-streamed: the whole request)
    itls_s: list[float]  # gaps between consecutive streamed responses
    e2e_s: float
    request_id: str
    model: str

    @property
    def tokens_per_s(self) -> float:
        """Output tokens over the whole request time (queueing and prefill included)."""
        return self.output_tokens / self.e2e_s if self.e2e_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        record = {
            "text": self.text,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "ttft_s": round(self.ttft_s, 6),
            "e2e_s": round(self.e2e_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "mean_itl_s": round(sum(self.itls_s) / len(self.itls_s), 6) if self.itls_s else None,
        }
        if self.log_probs is not None:
            record["log_probs"] = self.log_probs
            record["cum_log_prob"] = self.cum_log_prob
        return record


@dataclass
class ResultBuilder:
    """Accumulates pieces into chunks and the final result."""

    request_id: str
    model: str
    want_log_probs: bool
    sent_s: float = field(default_factory=time.perf_counter)
    prompt_tokens: int | None = None
    pieces: list[Piece] = field(default_factory=list)

    def add(self, piece: Piece) -> Chunk:
        self.pieces.append(piece)
        return Chunk(piece.text, self._tokens(piece), piece.log_probs if self.want_log_probs else [])

    @staticmethod
    def _tokens(piece: Piece) -> int:
        return 1 if piece.num_tokens is None else piece.num_tokens

    def result(self) -> GenerationResult:
        with_tokens = [p for p in self.pieces if self._tokens(p) > 0] or self.pieces
        end_s = self.pieces[-1].received_s if self.pieces else time.perf_counter()
        first_s = with_tokens[0].received_s if with_tokens else end_s
        times = [p.received_s for p in with_tokens]
        cum = next((p.cum_log_prob for p in reversed(self.pieces) if p.cum_log_prob is not None), None)
        return GenerationResult(
            text="".join(p.text for p in self.pieces),
            output_tokens=sum(self._tokens(p) for p in self.pieces),
            prompt_tokens=self.prompt_tokens,
            finish_reason=next((p.finish_reason for p in reversed(self.pieces) if p.finish_reason), None),
            log_probs=[x for p in self.pieces for x in p.log_probs] if self.want_log_probs else None,
            cum_log_prob=cum if self.want_log_probs else None,
            ttft_s=first_s - self.sent_s,
            itls_s=[b - a for a, b in zip(times, times[1:], strict=False)],
            e2e_s=end_s - self.sent_s,
            request_id=self.request_id,
            model=self.model,
        )
