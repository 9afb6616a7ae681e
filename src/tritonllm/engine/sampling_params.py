"""Per-request sampling parameters, validated so a bad request fails alone with a clear error."""

from __future__ import annotations

from dataclasses import dataclass, field

from tritonllm.engine.errors import InvalidRequestError
from tritonllm.engine.guided import grammar_for


@dataclass
class SamplingParams:
    """What to generate. `temperature == 0` or `top_k == 1` means greedy.

    `end_id=None` uses the model's EOS tokens; `ignore_eos` generates through them.
    `stop_token_ids` are token sequences that end the generation (included in the output);
    `bad_token_ids` are token sequences never generated (their last token is banned wherever the
    tokens before it were just generated, as HF's `bad_words_ids` and TensorRT-LLM's bad words).
    `guided_decoding_guide_type` (`json`, `json_schema`, `regex`, `ebnf_grammar`) and
    `guided_decoding_guide` constrain the output to a grammar (NVIDIA's names; see guided.py): the
    request ends with `stop` when the grammar is complete, `length` if max_tokens comes first.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    end_id: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[list[int]] = field(default_factory=list)
    bad_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: bool = False
    guided_decoding_guide_type: str | None = None
    guided_decoding_guide: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be > 0 (1 disables it), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidRequestError("seed", f"must be in [0, 2**64), got {self.seed}")
        if self.end_id is not None and self.end_id < 0:
            raise InvalidRequestError("end_id", f"must be >= 0, got {self.end_id}")
        if any(len(stop) == 0 for stop in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "a stop sequence is empty")
        if any(len(bad) == 0 for bad in self.bad_token_ids):
            raise InvalidRequestError("bad_token_ids", "a bad-words sequence is empty")
        if self.guided:
            grammar_for(self.guided_decoding_guide_type, self.guided_decoding_guide)

    @property
    def guided(self) -> bool:
        """Whether the output is constrained to a grammar."""
        return self.guided_decoding_guide_type is not None or self.guided_decoding_guide is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
