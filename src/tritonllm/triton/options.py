"""What `tritonllm launch` serves and how: `LaunchOptions` and the command line that fills them."""

from __future__ import annotations

import argparse
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tritonllm.precision import DTYPES, ENGINE_QUANTIZATIONS, KV_CACHE_DTYPES

DEFAULT_MAX_ENGINE_RESTARTS = 3  # engine restarts in place before a dead engine stops the server
DEFAULT_SEND_STALL_TIMEOUT_S = 60.0  # a response send stuck this long stops the server (recovery)


@dataclass
class LaunchOptions:
    """What to serve and how; engine fields left None use the engine's defaults."""

    model: str
    tokenizer_dir: str | None = None
    repository: str | None = None  # where to render; a temporary folder when None
    address: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    max_batch_size: int = 64
    preprocessing_instances: int = 1
    max_num_seqs: int | None = None
    max_waiting: int | None = None
    num_kv_blocks: int | None = None
    tokens_per_block: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    num_threads: int | None = None
    quantization: str | None = None  # None: the engine's default (as built, else none); the CLI's is auto
    dtype: str | None = None
    kv_cache_dtype: str | None = None  # None: the engine's auto_kv_cache_dtype
    drain_timeout_s: float = 5.0
    stream_interval: int = 1  # streamed tokens a response after the first (fewer responses, less CPU)
    max_engine_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS  # then a dead engine loop stops the server
    send_stall_timeout_s: float = DEFAULT_SEND_STALL_TIMEOUT_S
    decoupled: bool = True  # False: tensorrt_llm and the BLS answer unary calls, one response each
    disable_kernels: bool = False  # engine: PyTorch attention instead of the C++ kernel (no build)
    # After the drain Triton only unloads the stubs (seconds) and waits for open HTTP connections;
    # 2.51 counts one for every past `/generate` call to a decoupled model, so it always waits this long.
    exit_timeout_s: int = 15
    restrict_admin: bool = True
    admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    log_verbose: int = 0
    openai_port: int | None = None  # also start the OpenAI front door (tritonllm.openai) here

    def __post_init__(self) -> None:
        """Reject values the templates would carry into a config Triton or the engine refuses later."""
        for name in ("http_port", "grpc_port", "metrics_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in 1..65535, got {getattr(self, name)}")
        for name in ("max_batch_size", "preprocessing_instances", "stream_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        engine_limits = ("max_num_seqs", "max_waiting", "num_kv_blocks", "tokens_per_block")
        for name in (*engine_limits, "max_num_batched_tokens", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.quantization is not None and self.quantization not in ENGINE_QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {ENGINE_QUANTIZATIONS}, got {self.quantization!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.drain_timeout_s < 0 or self.exit_timeout_s < 0 or self.max_engine_restarts < 0:
            raise ValueError("drain_timeout_s, exit_timeout_s and max_engine_restarts must be >= 0")
        if not self.send_stall_timeout_s > 0:
            raise ValueError(f"send_stall_timeout_s must be positive, got {self.send_stall_timeout_s}")
        if self.restrict_admin and not self.admin_key:
            raise ValueError("admin_key must not be empty while the admin APIs are restricted")

    def template_values(self) -> dict[str, str]:
        values = {k: "" if v is None else str(v) for k, v in asdict(self).items()}
        values["engine_dir"] = str(Path(self.model).resolve())
        values["tokenizer_dir"] = str(Path(self.tokenizer_dir or self.model).resolve())
        values["decoupled"] = "true" if self.decoupled else "false"
        values["engine_grpc_url"] = f"{self.local_host()}:{self.grpc_port}"
        return values

    def local_host(self) -> str:
        """The host that reaches this server from its own machine: loopback when it listens on all
        addresses, else its address (bracketed if IPv6, for a URL)."""
        host = "127.0.0.1" if self.address in ("0.0.0.0", "::", "") else self.address
        return f"[{host}]" if ":" in host else host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    parser.add_argument("--repository", help="render the model repository here (default: a temporary folder)")
    parser.add_argument("--address", default="127.0.0.1", help="listen address (default: loopback only)")
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds Triton may take to load the models (a first start builds the CPU kernels; default 300)",
    )
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--max-batch-size", type=int, default=64, help="Triton max_batch_size of every model")
    parser.add_argument("--max-num-seqs", type=int, help="engine: requests in the running batch")
    parser.add_argument("--max-waiting", type=int, help="engine: waiting requests before 'busy' errors")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="engine: tokens a step computes, prefill chunks included (default 512); fewer give running "
        "streams steadier inter-token times under bursts of prompts, at some time to first token",
    )
    parser.add_argument("--num-kv-blocks", type=int)
    parser.add_argument(
        "--tokens-per-block",
        type=int,
        help="engine: tokens a KV cache block holds, the prefix cache's granularity (default: an engine "
        "directory's own, else the engine's)",
    )
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--threads", type=int, help="engine CPU threads (default: the cores available)")
    parser.add_argument(
        "--quantization",
        choices=ENGINE_QUANTIZATIONS,
        default="auto",
        help="engine weights; auto: an engine directory's own, else int8 where the CPU kernels run (faster "
        "than bf16 at every batch size measured, closer to fp32), else none; int7: int8 with 7-bit weights, "
        "on CPUs without VNNI (AVX2) decode 1.1x and prefill 1.2x int8's speed from 8 tokens, perplexity as "
        "int8's, greedy output further from fp32's (default: auto)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="engine compute dtype; auto: the fastest accurate one for this machine (default: auto)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="engine KV cache; int8: a scale per row, half bf16's bytes for attention to read and twice the "
        "tokens in the same memory (perplexity within 0.6%% of fp32 on the default model); auto: the compute "
        "dtype, bf16 under int8/int7/int4 weights on the CPU kernels (default: auto)",
    )
    parser.add_argument("--preprocessing-instances", type=int, default=1)
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="streamed responses: the first token at once, then N tokens a response; fewer responses "
        "leave the engine more CPU under load (default 1: one response per token)",
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=5.0, help="on stop: seconds in-flight requests may finish"
    )
    parser.add_argument(
        "--exit-timeout", type=int, default=15, help="on stop: seconds Triton may take to exit"
    )
    parser.add_argument(
        "--max-engine-restarts",
        type=int,
        default=DEFAULT_MAX_ENGINE_RESTARTS,
        help="if the engine loop dies: restarts in place, then the server stops "
        f"(default {DEFAULT_MAX_ENGINE_RESTARTS})",
    )
    parser.add_argument(
        "--send-stall-timeout",
        type=float,
        default=DEFAULT_SEND_STALL_TIMEOUT_S,
        help="seconds one response send may take before the server stops for its supervisor to restart it: "
        "a send that never returns (its consumer, e.g. a BLS stub, died) hangs every request "
        f"(default {DEFAULT_SEND_STALL_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--decoupled",
        choices=["true", "false"],
        default="true",
        help="false: tensorrt_llm and tensorrt_llm_bls answer non-streaming (unary) calls, no streaming",
    )
    parser.add_argument("--no-restrict-admin", action="store_true", help="leave the admin APIs open")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument(
        "--openai-port",
        type=int,
        help="also serve the OpenAI-compatible API on this port (keys: $TRITONLLM_OPENAI_API_KEYS)",
    )


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    from tritonllm.default_model import model_path_or_default

    model = model_path_or_default(args.model)
    return LaunchOptions(
        model=model,
        tokenizer_dir=args.tokenizer,
        repository=args.repository,
        address=args.address,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        max_batch_size=args.max_batch_size,
        preprocessing_instances=args.preprocessing_instances,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        tokens_per_block=args.tokens_per_block,
        max_model_len=args.max_model_len,
        num_threads=args.threads,
        quantization=args.quantization,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        drain_timeout_s=args.drain_timeout,
        stream_interval=args.stream_interval,
        max_engine_restarts=args.max_engine_restarts,
        send_stall_timeout_s=args.send_stall_timeout,
        decoupled=args.decoupled == "true",
        exit_timeout_s=args.exit_timeout,
        restrict_admin=not args.no_restrict_admin,
        log_verbose=args.log_verbose,
        openai_port=args.openai_port,
    )
