"""Front-door configuration: where Triton is, what to serve, and who may call with which limits.

API keys come from a JSON file (`--api-keys-file`) or the environment (`TRITONLLM_OPENAI_API_KEYS`,
comma-separated `key` or `key:tier`). Keys are off on loopback unless some are configured, and
required when listening beyond it: a front door on a public address without keys refuses to start.

Keys file:

    {"tiers": {"premium": 0, "standard": 1, "batch": 2},
     "keys": [{"key": "sk-...", "name": "alice", "tier": "premium", "requests_per_minute": 600,
               "tokens_per_minute": 200000, "max_concurrency": 8, "max_queue": 32,
               "queue_timeout_s": 10, "burst_s": 60}]}

A tier maps to the engine priority sent with the key's requests (lower is served first).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEYS_ENV = "TRITONLLM_OPENAI_API_KEYS"
DEFAULT_TIERS: dict[str, int] = {"premium": 0, "standard": 1, "batch": 2}
DEFAULT_TIER = "standard"
LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrency",
    "max_queue",
    "queue_timeout_s",
    "burst_s",
)


@dataclass(frozen=True)
class KeyLimits:
    """One key's limits; None means unlimited.

    Token buckets hold `burst_s` seconds of their per-minute rate (at least one request or the largest
    request): 60 lets a key spend its whole minute at once, a few seconds smooths it out.
    """

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrency: int | None = None
    max_queue: int | None = None  # requests waiting for a slot; default 4 x max_concurrency
    queue_timeout_s: float = 30.0
    burst_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if not (math.isfinite(self.queue_timeout_s) and self.queue_timeout_s > 0):
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s}")
        if not (math.isfinite(self.burst_s) and self.burst_s > 0):
            raise ValueError(f"burst_s must be > 0, got {self.burst_s}")

    @property
    def queue_bound(self) -> int:
        if self.max_queue is not None:
            return self.max_queue
        return 4 * self.max_concurrency if self.max_concurrency is not None else 0


@dataclass(frozen=True)
class ApiKey:
    """A caller: its secret, a name for logs and metrics, its tier and limits."""

    key: str
    name: str
    tier: str = DEFAULT_TIER
    limits: KeyLimits = field(default_factory=KeyLimits)

    def __post_init__(self) -> None:
        if not self.key or any(c.isspace() for c in self.key):
            raise ValueError(f"API key {self.name!r}: must be non-empty without spaces")


ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class KeyStore:
    """Every configured key, and the tier -> engine priority map."""

    keys: tuple[ApiKey, ...] = ()
    tiers: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    default_tier: str = DEFAULT_TIER

    def __post_init__(self) -> None:
        if self.default_tier not in self.tiers:
            raise ValueError(f"default tier {self.default_tier!r} is not one of {sorted(self.tiers)}")
        seen: set[str] = set()
        for key in self.keys:
            if key.tier not in self.tiers:
                raise ValueError(
                    f"API key {key.name!r}: tier {key.tier!r} is not one of {sorted(self.tiers)}"
                )
            if key.key in seen:
                raise ValueError(f"API key {key.name!r} is listed twice")
            seen.add(key.key)

    def priority(self, tier: str) -> int:
        return self.tiers[tier]


def _key_from_json(item: dict[str, Any], index: int) -> ApiKey:
    if not isinstance(item, dict) or "key" not in item:
        raise ValueError(f"keys[{index}]: expected an object with a 'key'")
    unknown = set(item) - {"key", "name", "tier", *LIMIT_FIELDS}
    if unknown:
        raise ValueError(f"keys[{index}]: unknown field(s) {sorted(unknown)}")
    limits = KeyLimits(**{k: item[k] for k in LIMIT_FIELDS if k in item})
    return ApiKey(
        key=str(item["key"]),
        name=str(item.get("name", f"key{index}")),
        tier=str(item.get("tier", DEFAULT_TIER)),
        limits=limits,
    )


def load_keys(path: str | Path | None = None, env: dict[str, str] | None = None) -> KeyStore:
    """Keys from the JSON file `path` and from `$TRITONLLM_OPENAI_API_KEYS` (both may be used)."""
    env = os.environ if env is None else env
    tiers = dict(DEFAULT_TIERS)
    keys: list[ApiKey] = []
    if path is not None:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object with 'keys' (and optional 'tiers')")
        if "tiers" in data:
            tiers = {str(k): int(v) for k, v in data["tiers"].items()}
        keys += [_key_from_json(item, i) for i, item in enumerate(data.get("keys", []))]
    for i, entry in enumerate(filter(None, (e.strip() for e in env.get(KEYS_ENV, "").split(",")))):
        secret, _, tier = entry.partition(":")
        keys.append(ApiKey(key=secret, name=f"env{i}", tier=tier or DEFAULT_TIER))
    default = DEFAULT_TIER if DEFAULT_TIER in tiers else min(tiers, key=tiers.__getitem__)
    return KeyStore(tuple(keys), tiers, default)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class FrontDoorConfig:
    """How the front door listens, which Triton model it calls, and its own limits."""

    tokenizer_dir: str
    triton_url: str = "127.0.0.1:8001"  # gRPC host:port
    triton_model: str = "tensorrt_llm_bls"
    served_model_name: str = ""  # the `model` clients send; default: the tokenizer folder's name
    host: str = "127.0.0.1"
    port: int = 9000
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    retry_after_s: int = 1  # Retry-After on the engine's busy error and on Triton unavailable
    keys: KeyStore = field(default_factory=KeyStore)
    require_keys: bool | None = None  # None: required unless listening on loopback only

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", Path(os.path.abspath(self.tokenizer_dir)).name)
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        for name in ("request_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):  # NaN passed `<= 0` and made every deadline NaN
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.retry_after_s < 0:
            raise ValueError("retry_after_s must be >= 0")
        if self.auth_required and not self.keys.keys:
            raise ValueError(
                f"listening on {self.host} (beyond loopback) needs API keys: give --api-keys-file or "
                f"${KEYS_ENV}"
            )

    @property
    def auth_required(self) -> bool:
        if self.require_keys is not None:
            return self.require_keys
        return bool(self.keys.keys) or not is_loopback(self.host)
