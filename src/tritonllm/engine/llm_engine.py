"""The engine: requests in, tokens out, one `step()` at a time (single-threaded; see serving.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.errors import InvalidRequestError
from tritonllm.engine.guided import GuideCompiler
from tritonllm.engine.kv_cache_manager import KVCacheManager
from tritonllm.engine.model_runner import ModelRunner
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import Scheduler
from tritonllm.engine.sequence import FinishReason, Sequence

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request: usually one new token; the last one says why it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float | None]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    arrival_time_ns: int
    first_scheduled_time_ns: int
    first_token_time_ns: int
    last_token_time_ns: int
    error: str | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    tokens_per_block: int
    kv_tokens_stored: int
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    num_preemptions: int
    prompt_tokens: int
    generated_tokens: int
    finished: dict[str, int] = field(default_factory=dict)
    dtype: str = ""  # what the engine runs with ("auto" resolved), for logs and /metrics readers
    quantization: str = ""
    kv_cache_dtype: str = ""
    kernels: str = ""  # e.g. "cpu-avx2 (avx avx2 f16c fma)", or "pytorch"

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        args = self.runner.args
        self.vocab_size = args.vocab_size
        self.eos_ids = frozenset(args.eos_token_ids)
        capacity = self.runner.num_blocks * config.tokens_per_block
        limit = min(args.max_position_embeddings, capacity)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds what the model and KV pool hold ({limit}: "
                f"max_position_embeddings={args.max_position_embeddings}, KV capacity={capacity} tokens)"
            )
        self.max_model_len = config.max_model_len or limit
        self.runner.model.cache_rope(self.max_model_len)
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.tokens_per_block, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.max_waiting
        )
        self.guides = GuideCompiler(config.model, self.vocab_size, self.eos_ids)
        self._requests: dict[str, Sequence] = {}
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._finished: dict[str, int] = {}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; raises InvalidRequestError (naming the field) or EngineBusyError."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        self.validate(prompt_token_ids, params)
        if params.ignore_eos:
            end_ids = frozenset()
        else:
            end_ids = frozenset([params.end_id]) if params.end_id is not None else self.eos_ids
        guide = (
            self.guides.matcher(params.guided_decoding_guide_type, params.guided_decoding_guide)
            if params.guided
            else None
        )
        seq = Sequence(request_id, prompt_token_ids, params, priority, end_ids, guide)
        self.scheduler.add(seq)
        self._requests[request_id] = seq

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check a request against the model's limits; pure, so any thread may call it."""
        if not prompt_token_ids:
            raise InvalidRequestError("input_ids", "the prompt is empty")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                "input_ids", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "input_ids",
                f"prompt has {len(prompt_token_ids)} tokens; the limit is {self.max_model_len - 1}",
            )
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"{params.max_tokens} + prompt {len(prompt_token_ids)} tokens exceeds max_model_len "
                f"{self.max_model_len}; at most {self.max_model_len - len(prompt_token_ids)}",
            )
        for stop in params.stop_token_ids:
            if any(not 0 <= t < self.vocab_size for t in stop):
                raise InvalidRequestError("stop_token_ids", f"token ids {stop} are outside the vocabulary")
        if params.guided:  # compiled here, on the caller's thread, and cached for add_request
            self.guides.compile(params.guided_decoding_guide_type, params.guided_decoding_guide)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """End a request now, wherever it is; its blocks are back in the pool when this returns."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, reason)
        self._finished[reason.value] = self._finished.get(reason.value, 0) + 1
        return self._output(seq, [], [])

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        tables = {c.seq.request_id: self.kv.block_table(c.seq.request_id) for c in plan.chunks}
        try:
            sampled = self.runner.execute(plan, tables)
        except Exception as exc:  # a failed step fails its requests, not the engine
            log.exception("engine step failed")
            return [self._fail(c.seq, f"engine step failed: {exc}") for c in plan.chunks]
        now = time.time_ns()
        for chunk in plan.chunks:
            self._prompt_tokens += max(
                0, min(chunk.num_tokens, chunk.seq.num_prompt_tokens - chunk.seq.num_computed_tokens)
            )
            self.scheduler.advance(chunk)
        outputs = []
        for chunk, token, logprob in sampled:
            seq = chunk.seq
            if seq.guide is not None and token not in seq.end_ids and not seq.guide.accept(token):
                outputs.append(self._fail(seq, f"guided decoding: {seq.guide.error}"))
                continue
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            self._generated_tokens += 1
            seq.first_token_time_ns = seq.first_token_time_ns or now
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                del self._requests[seq.request_id]
                self._finished[reason.value] = self._finished.get(reason.value, 0) + 1
            outputs.append(self._output(seq, [token], [logprob], now))
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if seq.guide is not None and seq.guide.is_complete:
            return FinishReason.STOP
        if seq.num_output_tokens >= p.min_tokens:
            if token in seq.end_ids:
                return FinishReason.STOP
            out = seq.output_token_ids
            if any(out[-len(stop) :] == stop for stop in p.stop_token_ids if len(stop) <= len(out)):
                return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        self.abort(seq.request_id, FinishReason.ERROR)
        out = self._output(seq, [], [])
        out.error = message
        return out

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list, now: int = 0) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            arrival_time_ns=seq.arrival_time_ns,
            first_scheduled_time_ns=seq.first_scheduled_time_ns,
            first_token_time_ns=seq.first_token_time_ns,
            last_token_time_ns=now or time.time_ns(),
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=self.runner.num_blocks,
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_free=self.kv.num_free_blocks,
            tokens_per_block=self.config.tokens_per_block,
            kv_tokens_stored=sum(s.num_computed_tokens for s in self.scheduler.running),
            prefix_hit_tokens=self.kv.prefix_hit_tokens,
            prefix_queried_tokens=self.kv.prefix_queried_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated_tokens,
            finished=dict(self._finished),
            dtype=self.config.dtype,
            quantization=self.config.quantization,
            kv_cache_dtype=self.config.kv_cache_dtype,
            kernels=self.runner.kernels,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Offline helper: run prompts to completion, return their output token ids in order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list, strict=False):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._requests for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]
