"""One request's state as the scheduler sees it."""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

import torch

from tritonllm.engine.guided import GuideMatcher
from tritonllm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tritonllm.engine.sampler import TokenCounts

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end id or a stop sequence
    LENGTH = "length"  # max_tokens, or the model's length limit
    ABORT = "abort"  # cancelled by the caller
    TIMEOUT = "timeout"
    ERROR = "error"


class Sequence:
    """Tokens (prompt then output), how many have KV in the cache, and scheduling keys.

    `num_computed_tokens` counts tokens whose KV is in the cache; the scheduler advances it.
    After preemption it goes back to 0 and the whole sequence is recomputed. `guide` (a guided
    request's grammar position) follows the output tokens only, so a recompute leaves it as it is.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        end_ids: frozenset[int] = frozenset(),
        guide: GuideMatcher | None = None,
    ):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival_order = next(_arrival_counter)
        self.arrival_time_ns = time.time_ns()
        self.first_scheduled_time_ns = 0
        self.first_token_time_ns = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens = 0  # prefix-cache hits at first scheduling
        self.num_preemptions = 0
        self.logprobs: list[float | None] = []
        # Tokens that end the request; masked while fewer than min_tokens were generated.
        self.end_ids = end_ids
        self.blocked_ids = end_ids | {stop[0] for stop in params.stop_token_ids if len(stop) == 1}
        # Made by the sampler on the logits' device: a generator for a seeded request, penalty counts.
        self.generator: torch.Generator | None = None
        self.token_counts: TokenCounts | None = None
        self.guide = guide

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Lower is served first: priority, then arrival."""
        return (self.priority, self.arrival_order)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={len(self)}, "
            f"computed={self.num_computed_tokens}, priority={self.priority})"
        )
