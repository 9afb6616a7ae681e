"""What to build: `BuildOptions` (validated at construction) and the resolved shape `Limits`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from tritonllm.engine import trtllm_executor
from tritonllm.engine_format import BACKENDS
from tritonllm.precision import DTYPES, QUANTIZATIONS, TORCH_QUANTIZATIONS, TRTLLM_QUANTIZATIONS

KV_CACHE_DTYPES = ("auto", "fp8", "int8")
# Per backend: tokens per KV block and tokens per step when not given (the engines' own defaults).
DEFAULT_TOKENS_PER_BLOCK = {"torch": 16, "tensorrt_llm": 32}
DEFAULT_MAX_NUM_TOKENS = {"torch": 512, "tensorrt_llm": 8192}
DEFAULT_MAX_SEQ_LEN = 4096  # capped by the model's max_position_embeddings
DEFAULT_CALIB_SIZE = 512


class BuildError(ValueError):
    """A build that cannot be done as asked; the message says why and what to change."""


def require_tensorrt_llm() -> str:
    """`trtllm_executor.require_tensorrt_llm` with its error as a BuildError (the CLI reports those)."""
    try:
        return trtllm_executor.require_tensorrt_llm()
    except trtllm_executor.TensorrtLlmUnavailableError as exc:
        raise BuildError(str(exc)) from None


def resolve_backend(backend: str) -> str:
    """`auto`: TensorRT-LLM when it is installed and a GPU is present, else the project's engine."""
    if backend != "auto":
        return backend
    installed = trtllm_executor.tensorrt_llm_installed() and trtllm_executor.gpu_available()
    return "tensorrt_llm" if installed else "torch"


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise BuildError(f"--{name.replace('_', '-')} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class BuildOptions:
    """One build: HF checkpoint `model` -> engine directory `output` (see `build_engines/build.py --help`)."""

    model: str
    output: str
    backend: str = "auto"
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    max_batch_size: int = 64
    max_input_len: int | None = None
    max_seq_len: int | None = None
    max_num_tokens: int | None = None
    tokens_per_block: int | None = None
    tp_size: int = 1
    calib_dataset: str | None = None
    calib_size: int | None = None
    model_repository: str | None = None
    force: bool = False

    def __post_init__(self) -> None:
        _choice("backend", self.backend, ("auto", *BACKENDS))
        _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("dtype", self.dtype, DTYPES)
        for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "tokens_per_block"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise BuildError(f"--{name.replace('_', '-')} must be positive; got {value}")
        if self.tp_size <= 0:
            raise BuildError(f"--tp-size must be positive; got {self.tp_size}")
        if self.calib_size is not None and self.calib_size <= 0:
            raise BuildError(f"--calib-size must be positive; got {self.calib_size}")
        if self.max_input_len is not None and self.max_seq_len is not None:
            check_input_len(self.max_input_len, self.max_seq_len)
        model, output = Path(self.model).resolve(), Path(self.output).resolve()
        if not model.is_dir():
            raise BuildError(f"--model {self.model}: no such checkpoint directory")
        if output == model or output in model.parents or model in output.parents:
            raise BuildError(
                f"--output {self.output} overlaps the checkpoint {self.model}: choose another folder"
            )
        requested = self.backend
        self.backend = resolve_backend(self.backend)
        if self.backend == "torch":
            self._check_torch_backend(requested)
        else:
            if self.quantization not in TRTLLM_QUANTIZATIONS:
                raise BuildError(
                    f"--quantization {self.quantization} is the project's CPU engine format "
                    f"(--backend torch); TensorRT-LLM takes {', '.join(TRTLLM_QUANTIZATIONS)}"
                )
            require_tensorrt_llm()

    def _check_torch_backend(self, requested: str) -> None:
        why = (
            "TensorRT-LLM is not installed or no GPU is present, so --backend auto chose the project's engine"
            if requested == "auto"
            else "--backend torch is the project's engine"
        )
        if self.quantization not in TORCH_QUANTIZATIONS:
            raise BuildError(
                f"--quantization {self.quantization} needs the TensorRT-LLM backend (a GPU and "
                f"tensorrt_llm 1.2.x); {why}, which supports {', '.join(TORCH_QUANTIZATIONS)}"
            )
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise BuildError(
                f"--kv-cache-dtype {self.kv_cache_dtype} needs the TensorRT-LLM backend; {why}, "
                "whose KV cache is auto (the compute dtype; bf16 under int8/int7/int4 weights) or int8"
            )
        if self.tp_size != 1:
            raise BuildError(f"--tp-size {self.tp_size} needs the TensorRT-LLM backend; {why} (one device)")
        if self.calib_dataset is not None or self.calib_size is not None:
            raise BuildError(
                f"--calib-dataset/--calib-size apply to TensorRT-LLM's calibrated quantization; {why}, "
                "whose weight-only quantization needs no calibration"
            )


def check_input_len(max_input_len: int, max_seq_len: int) -> None:
    if max_input_len >= max_seq_len:
        raise BuildError(
            f"--max-input-len ({max_input_len}) must be smaller than --max-seq-len ({max_seq_len}): "
            "a sequence holds its prompt and at least one generated token"
        )


@dataclass(frozen=True)
class Limits:
    """The shapes the engine is built for, after defaults from the model and the backend."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int

    @classmethod
    def resolve(cls, options: BuildOptions, max_position_embeddings: int) -> Limits:
        max_seq_len = options.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, max_position_embeddings)
        if max_seq_len > max_position_embeddings:
            raise BuildError(
                f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
                f"({max_position_embeddings})"
            )
        return cls(
            max_batch_size=options.max_batch_size,
            max_input_len=options.max_input_len or max_seq_len // 2,
            max_seq_len=max_seq_len,
            max_num_tokens=options.max_num_tokens or DEFAULT_MAX_NUM_TOKENS[options.backend],
            tokens_per_block=options.tokens_per_block or DEFAULT_TOKENS_PER_BLOCK[options.backend],
        )

    def __post_init__(self) -> None:
        check_input_len(self.max_input_len, self.max_seq_len)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
