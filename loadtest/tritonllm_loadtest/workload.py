"""Seeded request generator: prompts of a controlled length in the served model's own tokens.

Synthetic prompts are slices of a bundled corpus cut to the sampled number of tokens with the model's
``tokenizer.json`` (re-encoded to measure what the server will actually see); ``bundled`` picks from a
small prompt set. Requests may carry a priority tier drawn from a weighted mix (``priorities``). The same
seed and stream index always give the same requests.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer

from tritonllm_loadtest.distributions import IntDistribution

PROMPT_SOURCES = ("synthetic", "bundled")
DEFAULT_MODEL_SUBDIR = Path("models") / "SmolLM2-135M-Instruct"
# Decoding a token slice and re-encoding it can merge or split tokens at the edges: retry a few lengths.
LENGTH_FIT_TRIES = 4


def default_tokenizer_dir() -> Path:
    """The default model's folder: ``$TRITONLLM_CACHE_DIR/models/...``, else ``./.cache/models/...``."""
    cache = os.environ.get("TRITONLLM_CACHE_DIR")
    return (Path(cache).expanduser() if cache else Path(".cache")) / DEFAULT_MODEL_SUBDIR


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A ``tokenizers`` tokenizer from a ``tokenizer.json`` file or a model folder holding one."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {file} (pass the served model's folder)")
    return Tokenizer.from_file(str(file))


def bundled_prompts() -> list[str]:
    text = resources.files("tritonllm_loadtest.data").joinpath("prompts.jsonl").read_text()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def bundled_corpus() -> str:
    return resources.files("tritonllm_loadtest.data").joinpath("corpus.txt").read_text()


@dataclass(frozen=True)
class WorkloadConfig:
    tokenizer: str
    input_tokens: IntDistribution
    max_tokens: IntDistribution
    prompts: str = "synthetic"
    seed: int = 0
    priorities: tuple[tuple[int, float], ...] = ()  # (priority, weight) tiers; empty: all at the default

    def __post_init__(self) -> None:
        if self.prompts not in PROMPT_SOURCES:
            raise ValueError(f"prompts must be one of {PROMPT_SOURCES}, got {self.prompts!r}")
        if any(weight <= 0 for _, weight in self.priorities):
            raise ValueError(f"priority weights must be positive, got {self.priorities}")


def parse_priorities(spec: str) -> tuple[tuple[int, float], ...]:
    """``"0:1,5:3"`` -> one request in four at priority 0 (served first), three at 5; ``""`` -> none."""
    tiers = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        priority, _, weight = part.partition(":")
        try:
            tiers.append((int(priority), float(weight or 1)))
        except ValueError:
            raise ValueError(
                f"priorities: expected priority:weight pairs like 0:1,5:3, got {spec!r}"
            ) from None
    return tuple(tiers)


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    input_tokens: int  # measured with the model's tokenizer (no special tokens)
    max_tokens: int
    priority: int = 0  # lower is served first; 0 is the server's default


class Workload:
    """Builds request streams; each stream (a Locust user) has its own seeded random generator."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)

    @cached_property
    def _corpus_ids(self) -> list[int]:
        ids = self._encode(bundled_corpus())
        # Long enough for the longest prompt starting anywhere in the first copy.
        copies = 2 + self.config.input_tokens.upper_bound // max(1, len(ids))
        return ids * copies

    @cached_property
    def bundled_with_lengths(self) -> list[tuple[str, int]]:
        return [(p, len(self._encode(p))) for p in bundled_prompts()]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def count_tokens(self, text: str) -> int:
        return len(self._encode(text))

    def stream(self, index: int) -> RequestStream:
        return RequestStream(self, random.Random(f"{self.config.seed}:{index}"))

    def synthetic_prompt(self, rng: random.Random, n_tokens: int) -> tuple[str, int]:
        """A corpus slice whose re-encoded length is ``n_tokens`` (or the closest of a few tries)."""
        ids = self._corpus_ids
        start = rng.randrange(0, len(ids) - self.config.input_tokens.upper_bound)
        best: tuple[str, int] | None = None
        take = n_tokens
        for _ in range(LENGTH_FIT_TRIES):
            text = self.tokenizer.decode(ids[start : start + take])
            measured = len(self._encode(text))
            if best is None or abs(measured - n_tokens) < abs(best[1] - n_tokens):
                best = (text, measured)
            if measured == n_tokens:
                break
            take = max(1, take + n_tokens - measured)
        assert best is not None
        return best


class RequestStream:
    def __init__(self, workload: Workload, rng: random.Random) -> None:
        self.workload = workload
        self.rng = rng

    def next(self) -> GenerationRequest:
        config = self.workload.config
        if config.prompts == "bundled":
            prompt, n_input = self.rng.choice(self.workload.bundled_with_lengths)
        else:
            prompt, n_input = self.workload.synthetic_prompt(self.rng, config.input_tokens.sample(self.rng))
        max_tokens = config.max_tokens.sample(self.rng)
        priority = 0
        if config.priorities:
            tiers, weights = zip(*config.priorities, strict=True)
            priority = self.rng.choices(tiers, weights)[0]
        return GenerationRequest(prompt, n_input, max_tokens, priority)
