"""`Engine`: what the Triton bridge and metrics need from an engine, so they work with either engine.

`ServingEngine` (the project's engine in a thread) and `TrtllmEngine` (TensorRT-LLM's executor) both
satisfy it; `check_admission` is the refusal both make before queueing a request, with the errors the
bridge maps to response codes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tritonllm.engine.errors import EngineBusyError, EngineDeadError, EngineError
from tritonllm.engine.llm_engine import EngineStats, RequestOutput
from tritonllm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tritonllm.engine.serving import RequestStream


@runtime_checkable
class Engine(Protocol):
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> RequestStream:
        """Queue a request. Raises InvalidRequestError, EngineBusyError or EngineDeadError at once."""
        ...

    def cancel(self, request_id: str) -> bool:
        """Abort a request; False if it is not in flight."""
        ...

    def stats(self) -> EngineStats: ...

    @property
    def num_in_flight(self) -> int: ...

    @property
    def alive(self) -> bool:
        """False once the engine's loop died of an error."""
        ...

    def shutdown(self, drain_timeout_s: float = 0.0, join_timeout_s: float = 30.0) -> None: ...


def check_admission(
    request_id: str,
    *,
    dead: BaseException | None,
    stopping: bool,
    in_flight: bool,
    num_waiting: int,
    max_waiting: int,
) -> None:
    """Refuse a request a dead or stopping engine, a duplicate id or a full waiting queue cannot take."""
    if dead is not None or stopping:
        raise EngineDeadError(f"engine is not running: {dead or 'shutting down'}")
    if in_flight:
        raise EngineError(f"request_id {request_id!r} is already in flight")
    if num_waiting >= max_waiting:
        raise EngineBusyError(f"server busy: {max_waiting} requests already waiting")
