"""The project's paged-KV, continuous-batching engine."""

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.errors import EngineBusyError, EngineDeadError, EngineError, InvalidRequestError
from tritonllm.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.sequence import FinishReason

__all__ = [
    "EngineBusyError",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "InvalidRequestError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
