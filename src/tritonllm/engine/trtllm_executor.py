"""A TensorRT-LLM engine behind the `Engine` protocol that `ServingEngine` satisfies too.

TensorRT-LLM's executor (`tensorrt_llm.bindings.executor`, 1.2.x) does the in-flight batching, the paged
KV cache with block reuse and the scheduling; this adapter only maps our requests, outputs and statistics
onto it, so the Triton bridge and the metrics work unchanged. It cannot run without a GPU: the mapping is
unit tested against a fake module, the rest is unverified here.

Guided decoding is the executor's own (xgrammar, compiled in its C++ runtime); the names below are taken
from TensorRT-LLM's sources (NVIDIA/TensorRT-LLM): the bindings `cpp/tensorrt_llm/nanobind/executor/
executorConfig.cpp` (`GuidedDecodingConfig(backend, encoded_vocab, tokenizer_str, stop_token_ids)`,
`ExecutorConfig(guided_decoding_config=...)`) and `request.cpp` (`GuidedDecodingParams(guide_type, guide)`,
`GuideType`, `Request(guided_decoding_params=...)`), NVIDIA's Triton model
`triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/1/model.py` (guide type names, config),
`tensorrt_llm/llmapi/tokenizer.py` (`_xgrammar_tokenizer_info`) and
`cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp` (what the runtime compiles for each guide type).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tritonllm.engine.errors import EngineDeadError, EngineError, InvalidRequestError
from tritonllm.engine.guided import TYPE_FIELD
from tritonllm.engine.llm_engine import EngineStats, RequestOutput
from tritonllm.engine.protocol import check_admission
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.sequence import FinishReason
from tritonllm.engine.serving import RequestStream
from tritonllm.engine_format import read_build_info

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")
# TensorRT-LLM's FinishReason names -> ours.
FINISH_REASONS = {
    "END_ID": FinishReason.STOP,
    "STOP_WORDS": FinishReason.STOP,
    "LENGTH": FinishReason.LENGTH,
    "TIMED_OUT": FinishReason.TIMEOUT,
    "CANCELLED": FinishReason.ABORT,
}
# Our guide types -> `GuidedDecodingParams.GuideType` members, as NVIDIA's Triton model maps them
# (`get_guided_decoding_params_from_request`). `STRUCTURAL_TAG` has no guide type of ours.
TRTLLM_GUIDE_TYPES = {
    "json": "JSON",
    "json_schema": "JSON_SCHEMA",
    "regex": "REGEX",
    "ebnf_grammar": "EBNF_GRAMMAR",
}


TRTLLM_SERIES = "1.2."  # NVIDIA removed the engine workflow after 1.2
TRTLLM_PIN = "1.2.1"


class TensorrtLlmUnavailableError(ValueError):
    """TensorRT-LLM 1.2.x or the GPU it needs is missing; the message says what to do."""


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def tensorrt_llm_installed() -> bool:
    return importlib.util.find_spec("tensorrt_llm") is not None


def tensorrt_llm_version() -> str | None:
    try:
        return importlib.metadata.version("tensorrt_llm")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_tensorrt_llm() -> str:
    """The installed TensorRT-LLM version; a clear error unless it is 1.2.x and a GPU is present."""
    version = tensorrt_llm_version() if tensorrt_llm_installed() else None
    if version is None:
        raise TensorrtLlmUnavailableError(
            "--backend tensorrt_llm: TensorRT-LLM is not installed. Build in NVIDIA's TensorRT-LLM 1.2 "
            f"container (pip install tensorrt-llm=={TRTLLM_PIN}), or use --backend torch"
        )
    if not version.startswith(TRTLLM_SERIES):
        raise TensorrtLlmUnavailableError(
            f"--backend tensorrt_llm needs TensorRT-LLM {TRTLLM_SERIES}x (the last release line with "
            f"TensorRT engines and trtllm-build); found {version}"
        )
    if not gpu_available():
        raise TensorrtLlmUnavailableError(
            "--backend tensorrt_llm needs an NVIDIA GPU (torch.cuda.is_available() is False)"
        )
    return version


def executor_module() -> ModuleType:
    """`tensorrt_llm.bindings.executor`, after checking for TensorRT-LLM 1.2.x and a GPU."""
    require_tensorrt_llm()
    import tensorrt_llm.bindings.executor as trtllm

    return trtllm


@dataclass
class ExecutorSettings:
    """Runtime settings of the executor (the engine's shapes are fixed at build time)."""

    max_seq_len: int
    max_input_len: int
    tokens_per_block: int
    eos_token_ids: tuple[int, ...] = ()
    free_gpu_memory_fraction: float = 0.9
    enable_block_reuse: bool = True
    enable_chunked_context: bool = True
    scheduler_policy: str = "guaranteed_no_evict"
    max_waiting: int = 256
    poll_interval_s: float = 0.005
    stats_interval_s: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.free_gpu_memory_fraction <= 1:
            raise ValueError(
                f"free_gpu_memory_fraction must be in (0, 1], got {self.free_gpu_memory_fraction}"
            )
        if self.scheduler_policy not in SCHEDULER_POLICIES:
            raise ValueError(
                f"scheduler_policy must be one of {SCHEDULER_POLICIES}, got {self.scheduler_policy!r}"
            )
        if self.max_waiting <= 0:
            raise ValueError(f"max_waiting must be positive, got {self.max_waiting}")

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, **overrides: Any) -> ExecutorSettings:
        info = read_build_info(engine_dir)
        if info is None or info["backend"] != "tensorrt_llm":
            raise ValueError(
                f"{engine_dir} is not a TensorRT-LLM engine directory from build_engines/build.py"
            )
        limits = info["limits"]
        gen = Path(engine_dir) / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        values = dict(
            max_seq_len=limits["max_seq_len"],
            max_input_len=limits["max_input_len"],
            tokens_per_block=limits["tokens_per_block"],
            eos_token_ids=eos_ids,
        )
        return cls(**{**values, **overrides})


# `tensorrt_llm` model parameters (config.pbtxt, NVIDIA's names) -> ExecutorSettings fields.
PARAMETERS = {
    "kv_cache_free_gpu_mem_fraction": ("free_gpu_memory_fraction", float),
    "enable_kv_cache_reuse": ("enable_block_reuse", lambda v: v.strip().lower() == "true"),
    "enable_chunked_context": ("enable_chunked_context", lambda v: v.strip().lower() == "true"),
    "batch_scheduler_policy": ("scheduler_policy", str.strip),
    "max_waiting": ("max_waiting", int),
}


def settings_from_parameters(engine_dir: str | Path, params: dict[str, str]) -> ExecutorSettings:
    """Executor settings from the model's parameters; empty or absent ones keep the defaults."""
    overrides = {
        field: parse(params[key]) for key, (field, parse) in PARAMETERS.items() if params.get(key, "").strip()
    }
    return ExecutorSettings.from_engine_dir(engine_dir, **overrides)


def xgrammar_tokenizer_info(tokenizer: PreTrainedTokenizerBase, eos_ids: Iterable[int]) -> dict[str, Any]:
    """`GuidedDecodingConfig`'s tokenizer arguments, built as TensorRT-LLM's `_xgrammar_tokenizer_info`
    builds them: the vocabulary in id order and the fast tokenizer's JSON. The stop tokens add the
    engine's EOS ids (generation_config.json) to the tokenizer's: the grammar, once complete, allows only
    these, and a request must be able to end on its own end id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # TensorRT-LLM also takes tiktoken vocabularies; not mapped here
        raise ValueError(f"xgrammar needs a fast tokenizer (tokenizer.json), got {type(tokenizer).__name__}")
    vocab = tokenizer.get_vocab()
    stop = {*eos_ids, tokenizer.eos_token_id} - {None}
    return {
        "encoded_vocab": sorted(vocab, key=vocab.__getitem__),
        "tokenizer_str": backend.to_str(),
        "stop_token_ids": sorted(stop),
    }


@dataclass(frozen=True)
class GuidedDecoding:
    """The executor's guided decoding: its config and stop tokens, or why it is off."""

    config: Any = None
    stop_token_ids: frozenset[int] = frozenset()
    off_reason: str | None = None

    @classmethod
    def from_engine_dir(
        cls, trtllm: ModuleType, engine_dir: str | Path, eos_ids: Iterable[int]
    ) -> GuidedDecoding:
        """xgrammar (the only backend of the C++ runtime) over the engine directory's tokenizer; without
        a usable tokenizer the engine still serves, and refuses guided requests with the reason."""
        from tritonllm.tokenization import load_tokenizer

        try:
            info = xgrammar_tokenizer_info(load_tokenizer(engine_dir), eos_ids)
        except (OSError, ValueError) as exc:
            reason = f"no usable tokenizer in {engine_dir}: {str(exc)[:200]}"
            log.warning("guided decoding is off: %s", reason)
            return cls(off_reason=reason)
        backend = trtllm.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR
        config = trtllm.GuidedDecodingConfig(backend=backend, **info)
        return cls(config, frozenset(info["stop_token_ids"]))


def executor_config(trtllm: ModuleType, settings: ExecutorSettings, guided_config: Any = None) -> Any:
    policy = getattr(trtllm.CapacitySchedulerPolicy, settings.scheduler_policy.upper())
    return trtllm.ExecutorConfig(
        max_beam_width=1,
        scheduler_config=trtllm.SchedulerConfig(policy),
        kv_cache_config=trtllm.KvCacheConfig(
            free_gpu_memory_fraction=settings.free_gpu_memory_fraction,
            enable_block_reuse=settings.enable_block_reuse,
        ),
        enable_chunked_context=settings.enable_chunked_context,
        max_queue_size=settings.max_waiting,
        guided_decoding_config=guided_config,
    )


def end_token(params: SamplingParams, eos_ids: tuple[int, ...]) -> int | None:
    """The request's end id for the executor: -1 (none) under ignore_eos, else its own or the first EOS."""
    if params.ignore_eos:
        return -1
    return params.end_id if params.end_id is not None else (eos_ids[0] if eos_ids else None)


def guided_decoding_params(trtllm: ModuleType, params: SamplingParams) -> Any:
    """Our guide -> `GuidedDecodingParams`, None without one (`json` takes no guide string)."""
    if not params.guided:
        return None
    guide_type = getattr(
        trtllm.GuidedDecodingParams.GuideType, TRTLLM_GUIDE_TYPES[params.guided_decoding_guide_type]
    )
    return trtllm.GuidedDecodingParams(guide_type=guide_type, guide=params.guided_decoding_guide or None)


def executor_request(
    trtllm: ModuleType, prompt: list[int], params: SamplingParams, eos_ids: tuple[int, ...]
) -> Any:
    """Our request -> `trtllm.Request` (streamed, new tokens only)."""
    sampling = {
        "top_k": 1 if params.greedy else (params.top_k or None),
        "top_p": None if params.greedy or params.top_p == 1.0 else params.top_p,
        "temperature": None if params.greedy else params.temperature,
        "seed": params.seed,
        "min_tokens": params.min_tokens or None,
        "repetition_penalty": None if params.repetition_penalty == 1.0 else params.repetition_penalty,
        "presence_penalty": params.presence_penalty or None,
        "frequency_penalty": params.frequency_penalty or None,
    }
    return trtllm.Request(
        input_token_ids=prompt,
        max_tokens=params.max_tokens,
        streaming=True,
        sampling_config=trtllm.SamplingConfig(
            beam_width=1, **{k: v for k, v in sampling.items() if v is not None}
        ),
        output_config=trtllm.OutputConfig(return_log_probs=params.logprobs, exclude_input_from_output=True),
        end_id=end_token(params, eos_ids),
        stop_words=params.stop_token_ids or None,
        bad_words=params.bad_token_ids or None,
        guided_decoding_params=guided_decoding_params(trtllm, params),
    )


@dataclass
class _Live:
    request_id: str
    executor_id: int
    prompt_len: int
    stream: RequestStream
    deadline: float | None
    arrival_ns: int = field(default_factory=time.time_ns)
    num_output: int = 0
    first_token_ns: int = 0
    timed_out: bool = False


class TrtllmEngine:
    """The `Engine` protocol over `tensorrt_llm.bindings.executor.Executor`."""

    def __init__(self, engine_dir: str | Path, settings: ExecutorSettings, trtllm: ModuleType | None = None):
        self._trt = trtllm or executor_module()
        self.settings = settings
        self.tokens_per_block = settings.tokens_per_block
        self.guided = GuidedDecoding.from_engine_dir(self._trt, engine_dir, settings.eos_token_ids)
        self.executor = self._trt.Executor(
            str(engine_dir),
            self._trt.ModelType.DECODER_ONLY,
            executor_config(self._trt, settings, self.guided.config),
        )
        self._lock = threading.Lock()
        self._live: dict[int, _Live] = {}
        self._ids: dict[str, int] = {}
        self._counters = {"prompt_tokens": 0, "generated_tokens": 0}
        self._finished: dict[str, int] = {}
        self._stats = EngineStats(0, 0, 0, 0, 0, self.tokens_per_block, 0, 0, 0, 0, 0, 0, {})
        self._stopping = threading.Event()
        self._closing = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tritonllm-trtllm", daemon=True)
        # Tensor parallel under MPI: only the leader (rank 0) takes requests. A worker rank blocks
        # here, as in NVIDIA's model, until the leader's executor shuts down.
        self.is_leader = bool(self.executor.can_enqueue_requests())
        if self.is_leader:
            self._thread.start()
        else:
            self.executor.shutdown()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> RequestStream:
        """Queue a request (priority is not mapped: the executor schedules first come, first served)."""
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params)
        stream = RequestStream(request_id, params.max_tokens + 2, on_output)
        with self._lock:
            check_admission(
                request_id,
                dead=self._dead,
                stopping=self._stopping.is_set(),
                in_flight=request_id in self._ids,
                num_waiting=self._stats.num_waiting,
                max_waiting=self.settings.max_waiting,
            )
            request = executor_request(self._trt, prompt_token_ids, params, self.settings.eos_token_ids)
            executor_id = self.executor.enqueue_request(request)
            deadline = time.monotonic() + timeout_s if timeout_s else None
            self._live[executor_id] = _Live(request_id, executor_id, len(prompt_token_ids), stream, deadline)
            self._ids[request_id] = executor_id
        return stream

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise InvalidRequestError("input_ids", "the prompt is empty")
        if params.guided:
            self._validate_guided(params)
        if len(prompt) > self.settings.max_input_len:
            raise InvalidRequestError(
                "input_ids",
                f"{len(prompt)} tokens exceed the engine's max_input_len={self.settings.max_input_len}",
            )
        if len(prompt) + params.max_tokens > self.settings.max_seq_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceed the engine's "
                f"max_seq_len={self.settings.max_seq_len}",
            )

    def _validate_guided(self, params: SamplingParams) -> None:
        """What xgrammar in the executor cannot do is refused here rather than left to the GPU."""
        if self.guided.off_reason is not None:
            raise InvalidRequestError(TYPE_FIELD, f"guided decoding is off: {self.guided.off_reason}")
        # Once the grammar is complete only its stop tokens are allowed; a request that does not end on
        # one (or on none, under ignore_eos) would go on feeding a finished matcher (guidedDecoder.cpp).
        if end_token(params, self.settings.eos_token_ids) not in self.guided.stop_token_ids:
            raise InvalidRequestError(
                "ignore_eos" if params.ignore_eos else "end_id",
                "a guided request must end on one of the grammar's stop tokens "
                f"{sorted(self.guided.stop_token_ids)} with TensorRT-LLM engines",
            )

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            executor_id = self._ids.get(request_id)
        if executor_id is None:
            return False
        self.executor.cancel_request(executor_id)
        return True

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    @property
    def alive(self) -> bool:
        """False once the response loop died of an error."""
        return self._dead is None

    def shutdown(self, drain_timeout_s: float = 0.0, join_timeout_s: float = 30.0) -> None:
        """Let in-flight requests finish for up to `drain_timeout_s`, cancel the rest, stop the executor."""
        if not self.is_leader:
            return  # its executor was shut down when the leader's was
        deadline = time.monotonic() + drain_timeout_s
        with self._lock:
            self._stopping.set()
        while self._live and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(self.settings.poll_interval_s)
        for request_id in list(self._ids):
            self.cancel(request_id)
        cancel_deadline = time.monotonic() + 5.0
        while self._live and time.monotonic() < cancel_deadline and self._thread.is_alive():
            time.sleep(self.settings.poll_interval_s)
        self._closing.set()
        self._thread.join(join_timeout_s)
        self.executor.shutdown()
        for live in list(self._live.values()):  # the executor never answered them
            self._finish(live, EngineDeadError("the engine stopped"))

    # The response thread.

    def _run(self) -> None:
        timeout = datetime.timedelta(seconds=self.settings.poll_interval_s)
        next_stats = 0.0
        try:
            while not self._closing.is_set():
                for response in self.executor.await_responses(timeout=timeout):
                    self._on_response(response)
                now = time.monotonic()
                for live in [lv for lv in list(self._live.values()) if lv.deadline and lv.deadline <= now]:
                    live.deadline, live.timed_out = None, True
                    self.executor.cancel_request(live.executor_id)  # answered as CANCELLED
                if now >= next_stats:
                    self._stats = self._stats_from(self.executor.get_latest_iteration_stats())
                    next_stats = now + self.settings.stats_interval_s
        except BaseException as exc:  # noqa: BLE001 -- every stream must learn the engine died
            log.exception("TensorRT-LLM response loop died")
            self._dead = exc
            for live in list(self._live.values()):
                self._finish(live, EngineDeadError(f"engine loop died: {exc}"))

    def _on_response(self, response: Any) -> None:
        with self._lock:  # submit() registers the request under the lock it enqueues it with
            live = self._live.get(response.request_id)
        if live is None:
            return
        if response.has_error():
            self._finish(live, EngineError(response.error_msg))
            return
        result = response.result
        tokens = list(result.output_token_ids[0])
        now = time.time_ns()
        if tokens and not live.first_token_ns:
            live.first_token_ns = now
        live.num_output += len(tokens)
        self._counters["generated_tokens"] += len(tokens)
        log_probs = list(result.log_probs[0])[-len(tokens) :] if tokens and result.log_probs else []
        reason = None
        if result.is_final:
            name = result.finish_reasons[0].name
            reason = FINISH_REASONS.get(name, FinishReason.STOP)
            if reason == FinishReason.ABORT and live.timed_out:
                reason = FinishReason.TIMEOUT
        out = RequestOutput(
            request_id=live.request_id,
            new_token_ids=tokens,
            new_logprobs=log_probs or [None] * len(tokens),
            finished=bool(result.is_final),
            finish_reason=reason,
            num_prompt_tokens=live.prompt_len,
            num_output_tokens=live.num_output,
            num_cached_tokens=0,
            arrival_time_ns=live.arrival_ns,
            first_scheduled_time_ns=live.first_token_ns,
            first_token_time_ns=live.first_token_ns,
            last_token_time_ns=now,
        )
        if out.finished:
            self._finish(live, out)
        else:
            live.stream._deliver(out)

    def _finish(self, live: _Live, item: RequestOutput | BaseException) -> None:
        with self._lock:
            if self._live.pop(live.executor_id, None) is None:
                return
            self._ids.pop(live.request_id, None)
        if isinstance(item, RequestOutput) and item.finish_reason is not None:
            key = item.finish_reason.value
            self._finished[key] = self._finished.get(key, 0) + 1
        live.stream._deliver(item)

    def _stats_from(self, iterations: list[Any]) -> EngineStats:
        """EngineStats from the latest `IterationStats` (counters summed over every iteration seen)."""
        for it in iterations:
            if it.inflight_batching_stats is not None:
                self._counters["prompt_tokens"] += it.inflight_batching_stats.num_ctx_tokens
        if not iterations:  # no iteration since the last poll: only the token counters moved
            return replace(
                self._stats,
                generated_tokens=self._counters["generated_tokens"],
                finished=dict(self._finished),
            )
        latest = iterations[-1]
        kv = latest.kv_cache_stats
        ifb = latest.inflight_batching_stats
        running = ifb.num_scheduled_requests if ifb is not None else latest.num_active_requests
        tpb = kv.tokens_per_block or self.tokens_per_block
        return EngineStats(
            num_running=running,
            num_waiting=latest.num_queued_requests + max(0, latest.num_active_requests - running),
            kv_blocks_total=kv.max_num_blocks,
            kv_blocks_used=kv.used_num_blocks,
            kv_blocks_free=kv.free_num_blocks,
            tokens_per_block=tpb,
            kv_tokens_stored=kv.used_num_blocks * tpb,
            prefix_hit_tokens=kv.reused_blocks * tpb,
            prefix_queried_tokens=(kv.reused_blocks + kv.missed_blocks) * tpb,
            num_preemptions=0,
            prompt_tokens=self._counters["prompt_tokens"],
            generated_tokens=self._counters["generated_tokens"],
            finished=dict(self._finished),
        )
