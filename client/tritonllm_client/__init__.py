"""Clients for LLMs served by Triton Inference Server (this project's models or NVIDIA's TRT-LLM backend)."""

from tritonllm_client.client import AsyncClient, Client, Generation, SyncGeneration
from tritonllm_client.errors import (
    CircuitOpenError,
    ClientError,
    GenerationInterruptedError,
    InvalidOptionError,
    InvalidRequestError,
    ModelNotFoundError,
    RateLimitTimeoutError,
    RequestTimeoutError,
    ServerBusyError,
    ServerError,
    ServerUnavailableError,
)
from tritonllm_client.options import BreakerPolicy, ClientConfig, RateLimit, RetryPolicy, SamplingOptions
from tritonllm_client.results import Chunk, GenerationResult

__all__ = [
    "AsyncClient",
    "BreakerPolicy",
    "Chunk",
    "CircuitOpenError",
    "Client",
    "ClientConfig",
    "ClientError",
    "Generation",
    "GenerationInterruptedError",
    "GenerationResult",
    "InvalidOptionError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "RateLimit",
    "RateLimitTimeoutError",
    "RequestTimeoutError",
    "RetryPolicy",
    "SamplingOptions",
    "ServerBusyError",
    "ServerError",
    "ServerUnavailableError",
    "SyncGeneration",
]
