"""Validated configuration: sampling options (the models' inputs) and client policies."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from tritonllm_client.errors import InvalidOptionError

Protocol = Literal["grpc", "http"]
PROTOCOLS: tuple[str, ...] = ("grpc", "http")
DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}
UINT64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1


def _check(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise InvalidOptionError(f"{name}: {message}")


def _check_range(name: str, value: float | None, low: float, high: float = math.inf) -> None:
    if value is not None:
        _check(
            math.isfinite(value) and low <= value <= high, name, f"must be in [{low}, {high}], got {value}"
        )


@dataclass(frozen=True)
class SamplingOptions:
    """Inputs of `ensemble` / `tensorrt_llm_bls`; None leaves the server's default (greedy)."""

    max_tokens: int = 64
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    seed: int | None = None
    end_id: int | None = None
    stop_words: tuple[str, ...] = ()
    return_log_probs: bool = False
    priority: int | None = None  # lower is served first (the server's default is 0)

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int), "max_tokens", "must be an int")
        _check_range("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_range("temperature", self.temperature, 0.0)
        _check_range("top_k", self.top_k, 0, INT32_MAX)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        if self.repetition_penalty is not None:
            _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_range("seed", self.seed, 0, UINT64_MAX)
        _check_range("end_id", self.end_id, 0, INT32_MAX)
        _check_range("priority", self.priority, -INT32_MAX - 1, INT32_MAX)
        _check(
            all(isinstance(w, str) and w for w in self.stop_words), "stop_words", "must be non-empty strings"
        )
        object.__setattr__(self, "stop_words", tuple(self.stop_words))

    def inputs(self) -> dict[str, Any]:
        """The non-default inputs by tensor name (the transports pick each tensor's data type)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["stop_words"] = list(self.stop_words) or None
        values["return_log_probs"] = self.return_log_probs or None
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True)
class RateLimit:
    """Token bucket shared by all calls of a client: `rate` per second, up to `burst` at once.

    With `unit="tokens"` a request takes its `max_tokens` (its budget: the exact count is only known
    after it ran). A request waits at most `timeout_s` for the bucket, then fails.
    """

    rate: float
    burst: float = 1.0
    unit: Literal["requests", "tokens"] = "requests"
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _check(math.isfinite(self.rate) and self.rate > 0, "rate", f"must be > 0, got {self.rate}")
        _check(math.isfinite(self.burst) and self.burst >= 1, "burst", f"must be >= 1, got {self.burst}")
        _check(
            self.unit in ("requests", "tokens"), "unit", f"must be 'requests' or 'tokens', got {self.unit!r}"
        )
        _check(self.timeout_s > 0, "timeout_s", "must be > 0")


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for unavailable/busy errors raised before any token arrived."""

    attempts: int = 4  # including the first; 1 disables retries
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    jitter_s: float = 0.2

    def __post_init__(self) -> None:
        _check(self.attempts >= 1, "attempts", "must be >= 1")
        _check(self.initial_backoff_s >= 0, "initial_backoff_s", "must be >= 0")
        _check(self.max_backoff_s >= self.initial_backoff_s, "max_backoff_s", "must be >= initial_backoff_s")
        _check(self.jitter_s >= 0, "jitter_s", "must be >= 0")


@dataclass(frozen=True)
class BreakerPolicy:
    """Open after `failures` consecutive unavailable/busy errors; probe again after `reset_timeout_s`."""

    failures: int = 5
    reset_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        _check(self.failures >= 1, "failures", "must be >= 1")
        _check(self.reset_timeout_s > 0, "reset_timeout_s", "must be > 0")


@dataclass(frozen=True)
class ClientConfig:
    """Where to connect and the policies shared by every call of one client."""

    url: str | None = None  # host:port; the protocol's default port on localhost when None
    protocol: Protocol = "grpc"
    model: str = "ensemble"
    max_concurrency: int = 16
    request_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    rate_limit: RateLimit | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    count_prompt_tokens: bool = False  # one extra `preprocessing` call per request for an exact count

    def __post_init__(self) -> None:
        _check(self.protocol in PROTOCOLS, "protocol", f"must be one of {PROTOCOLS}, got {self.protocol!r}")
        url = self.url or DEFAULT_URLS[self.protocol]
        for scheme in ("http://", "grpc://"):
            url = url.removeprefix(scheme)
        host, _, port = url.rstrip("/").rpartition(":")
        _check(
            bool(host) and port.isdigit() and 0 < int(port) < 65536, "url", f"expected host:port, got {url!r}"
        )
        object.__setattr__(self, "url", f"{host}:{port}")
        _check(bool(self.model) and "/" not in self.model, "model", f"invalid model name {self.model!r}")
        _check(self.max_concurrency >= 1, "max_concurrency", "must be >= 1")
        _check(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        _check(self.connect_timeout_s > 0, "connect_timeout_s", "must be > 0")
